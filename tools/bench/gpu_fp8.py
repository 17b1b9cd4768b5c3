"""FP8 rollouts on the GPU slice (``tools/gpu_check``'s ``fp8_decode`` stage).

    PYTHONPATH=. python -m tools.bench.gpu_fp8 [--size smoke|quick|full] [--tiny]

The model of ``examples/configs/gpu_qwen3_slice_rl.yaml`` (Qwen3-30B-A3B's layer shapes, 2 layers,
random bf16 weights, our local kernels), sampled by the dynamic engine's multi-step rounds
(:mod:`tools.bench.gpu_rollout`'s sizes and timing) three ways:

``bf16``             the live bf16 model (``rollout.precision: auto``);
``fp8``              ``rollout.precision: fp8``: 128 x 128 block-scaled e4m3 weights; on Hopper
                     the decoding step's attention GEMMs run as ``torch._scaled_mm``
                     (:class:`gspo_megatron.rollouts.fp8.Fp8Linear`), the experts' grouped
                     GEMMs as ``torch._scaled_grouped_mm`` (row-wise scales,
                     :class:`gspo_megatron.rollouts.fp8.Fp8Experts`);
``fp8_dequantized``  the same weights with every GEMM in bf16 (the CPU path's numerics), to
                     separate the FP8 GEMMs' time from the weight refresh's;
``fp8_kv``           ``fp8`` with ``rollout.kv_cache_dtype: fp8`` (e4m3 keys and values, a scale
                     per token and head, dequantized on read).

Reported: ms per decoding step and tokens/s per path, the refresh (quantization) seconds, greedy
tokens of each FP8 path against bf16's (requests differing), and the GEMMs alone at the slice's
attention shapes (qkv ``[5120, 2048]``, proj ``[2048, 4096]``) for 1 / 32 / 128 tokens: bf16
``F.linear`` against :func:`~gspo_megatron.rollouts.fp8.fp8_linear`, with the FP8 result's
relative difference from its float32 twin (:func:`~gspo_megatron.rollouts.fp8.fp8_linear_reference`);
and the experts' grouped GEMMs alone at the slice's shapes (128 experts, ``w1 [1536, 2048]``,
``w2 [2048, 768]``, 8 routes a token) for 1 / 32 / 128 tokens: bf16 ``torch._grouped_mm``
against :func:`~gspo_megatron.rollouts.fp8.fp8_grouped_linear`, with the relative difference
from its twin and from the bf16 result. The ``fp8_kv`` path's ``rollout/kv_fp8_rel_err``.
``--tiny``: the tiny preset in fp32 on any device (the code path at toy size).
"""

from __future__ import annotations

import dataclasses
import time

from tools.bench.gpu_rollout import SIZES, _time_engines, sized_cli, slice_setup

PATHS = {"bf16": dict(precision="auto"), "fp8": dict(precision="fp8"),
         "fp8_dequantized": dict(precision="fp8"),
         "fp8_kv": dict(precision="fp8", kv_cache_dtype="fp8")}


def _ms(fn, iters: int) -> float:
    """ms per call of ``fn`` on CUDA (one warm-up call, synchronized)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def grouped_gemm_times(experts: int = 128, shapes=((1536, 2048), (2048, 768)), topk: int = 8,
                       tokens=(1, 32, 128), iters: int = 50) -> dict:
    """bf16 ``torch._grouped_mm`` vs the experts' FP8 grouped GEMM at ``shapes`` ``(N, K)``
    per expert, the routed rows ``tokens x topk`` spread over the experts at random: ms per
    call and the FP8 result's relative difference from its float32 twin and from bf16 (Hopper
    only; else ``skipped``)."""
    import torch

    from gspo_megatron.rollouts.fp8 import (fp8_grouped_gemm_works, fp8_grouped_linear,
                                            fp8_grouped_reference, quantize_rowwise)

    if not torch.cuda.is_available():
        return {"skipped": "needs a Hopper GPU"}
    why = fp8_grouped_gemm_works(torch.device("cuda"))
    if why is not None:
        return {"skipped": why}
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for n, k in shapes:
        w = (torch.randn(experts, n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        q, s = quantize_rowwise(w)
        for t in tokens:
            rows = t * topk
            counts = torch.bincount(torch.randint(0, experts, (rows,), device="cuda",
                                                  generator=g), minlength=experts)
            offs = counts.cumsum(0).to(torch.int32)
            x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
            try:
                got = fp8_grouped_linear(x, q, s, offs).float()
            except RuntimeError as exc:
                out[f"{experts}x{n}x{k}/tokens_{t}"] = {"error": str(exc).splitlines()[0][:200]}
                continue
            twin = fp8_grouped_reference(x.float(), q, s, offs)
            bf16 = torch._grouped_mm(x, w.transpose(1, 2), offs=offs).float()
            out[f"{experts}x{n}x{k}/tokens_{t}"] = {
                "fp8_vs_twin_rel": float((got - twin).norm() / twin.norm()),
                "fp8_vs_bf16_rel": float((got - bf16).norm() / bf16.norm()),
                "bf16_ms": _ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), iters),
                "fp8_ms": _ms(lambda: fp8_grouped_linear(x, q, s, offs), iters)}
    return out


def gemm_times(shapes=((5120, 2048), (2048, 4096)), tokens=(1, 32, 128), iters: int = 50) -> dict:
    """bf16 ``F.linear`` vs the FP8 GEMM at ``shapes`` ``(N, K)``: ms per call and the FP8
    result's relative difference from its float32 twin (Hopper only; else ``skipped``)."""
    import torch

    from gspo_megatron.rollouts.fp8 import (fp8_gemm_works, fp8_linear, fp8_linear_reference,
                                            quantize_blockwise)

    if not torch.cuda.is_available():
        return {"skipped": "needs a Hopper GPU"}
    why = fp8_gemm_works(torch.device("cuda"))
    if why is not None:
        return {"skipped": why}
    out = {}
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_blockwise(w, 128)
        for t in tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            ref = fp8_linear_reference(x, q, s)
            try:
                got = fp8_linear(x, q, s).float()
            except RuntimeError as exc:  # record the shape cuBLAS refuses, time the others
                out[f"{n}x{k}/tokens_{t}"] = {"error": str(exc).splitlines()[0][:200]}
                continue
            out[f"{n}x{k}/tokens_{t}"] = {
                "fp8_vs_twin_rel": float((got - ref).norm() / ref.norm()),
                "bf16_ms": _ms(lambda: torch.nn.functional.linear(x, w), iters),
                "fp8_ms": _ms(lambda: fp8_linear(x, q, s), iters)}
    return out


def run(size: str = "full", tiny: bool = False) -> dict:
    import torch

    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config import RolloutConfig

    batch, new, rounds = SIZES[size]
    cfg, model_cfg, vocab, precision = slice_setup(new, tiny)
    groups = initialize_distributed(cfg.parallel, model_cfg, seed=0)
    results: dict = {"model": "tiny" if tiny else "qwen3-30b-a3b x 2 layers", "batch": batch,
                     "new_tokens": new, "rounds": rounds,
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    prompts = torch.randint(1, vocab, (batch, 16), generator=torch.Generator().manual_seed(0)
                            ).tolist()
    rc = RolloutConfig(group_size=2, prompts_per_step=1, max_new_tokens=new, max_batch_size=batch,
                       temperature=1.0, dynamic_buffer_size_gb=0.05 if tiny else 4.0)
    try:
        gpt = build_gpt_model(model_cfg, cfg.parallel, precision, pre_process=True,
                              post_process=True)
        engines = {name: RolloutEngine(gpt, groups, eos_id=0, pad_id=0, vocab_size=vocab,
                                       config=dataclasses.replace(rc, **over))
                   for name, over in PATHS.items()}
        engines["fp8_dequantized"].fp8.gemm = None  # every GEMM in bf16
        engines["fp8_dequantized"].sampling_model.fp8_expert_gemm = None
        results["fp8_gemm"] = engines["fp8"].fp8.gemm is not None
        results["fp8_expert_gemm"] = getattr(engines["fp8"].sampling_model, "fp8_expert_gemm",
                                             None) is not None
        greedy = {name: [s.response_ids for s in e.with_sampling(
            dataclasses.replace(e.config, top_k=1)).generate(prompts, seed=0)]
            for name, e in engines.items()}
        results["greedy_requests_differing_from_bf16"] = {
            name: sum(a != b for a, b in zip(tokens, greedy["bf16"]))
            for name, tokens in greedy.items() if name != "bf16"}
        results["fp8_weight_rel_err"] = engines["fp8"].weight_metrics()
        results["kv_fp8_rel_err"] = engines["fp8_kv"].weight_metrics().get(
            "rollout/kv_fp8_rel_err")
        results["paths"] = _time_engines(engines, prompts, rounds)
        for name, e in engines.items():
            results["paths"].setdefault(name, {})["refresh_s"] = e.last_refresh_s
        results["gemms"] = gemm_times()
        results["grouped_gemms"] = grouped_gemm_times()
    finally:
        destroy_distributed()
    return results


def main(argv: list[str] | None = None) -> int:
    return sized_cli(__doc__, SIZES, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
