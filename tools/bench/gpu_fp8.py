"""FP8 rollouts on the GPU slice (``tools/gpu_check``'s ``fp8_decode`` stage).

    PYTHONPATH=. python -m tools.bench.gpu_fp8 [--size smoke|quick|full] [--tiny]

The model of ``examples/configs/gpu_qwen3_slice_rl.yaml`` (Qwen3-30B-A3B's layer shapes, 2 layers,
random bf16 weights, our local kernels), sampled by the dynamic engine's multi-step rounds
(:mod:`tools.bench.gpu_rollout`'s sizes and timing) three ways:

``bf16``             the live bf16 model (``rollout.precision: auto``);
``fp8``              ``rollout.precision: fp8``: 128 x 128 block-scaled e4m3 weights; on Hopper
                     the decoding step's attention GEMMs run as ``torch._scaled_mm``
                     (:class:`gspo_megatron.rollouts.fp8.Fp8Linear`), the experts dequantized;
``fp8_dequantized``  the same weights with every GEMM in bf16 (the CPU path's numerics), to
                     separate the FP8 GEMMs' time from the weight refresh's.

Reported: ms per decoding step and tokens/s per path, the refresh (quantization) seconds, greedy
tokens of each FP8 path against bf16's (requests differing), and the GEMMs alone at the slice's
attention shapes (qkv ``[5120, 2048]``, proj ``[2048, 4096]``) for 1 / 32 / 128 tokens: bf16
``F.linear`` against :func:`~gspo_megatron.rollouts.fp8.fp8_linear`, with the FP8 result's
relative difference from its float32 twin (:func:`~gspo_megatron.rollouts.fp8.fp8_linear_reference`).
``--tiny``: the tiny preset in fp32 on any device (the code path at toy size).
"""

from __future__ import annotations

import dataclasses
import time

from tools.bench.gpu_rollout import SIZES, _time_engines, sized_cli, slice_setup

PATHS = {"bf16": dict(precision="auto"), "fp8": dict(precision="fp8"),
         "fp8_dequantized": dict(precision="fp8")}


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
            rec = {"fp8_vs_twin_rel": float((got - ref).norm() / ref.norm())}
            for name, fn in (("bf16_ms", lambda: torch.nn.functional.linear(x, w)),
                             ("fp8_ms", lambda: fp8_linear(x, q, s))):
                fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                torch.cuda.synchronize()
                rec[name] = 1e3 * (time.perf_counter() - start) / iters
            out[f"{n}x{k}/tokens_{t}"] = rec
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
        results["fp8_gemm"] = engines["fp8"].fp8.gemm is not None
        greedy = {name: [s.response_ids for s in e.with_sampling(
            dataclasses.replace(e.config, top_k=1)).generate(prompts, seed=0)]
            for name, e in engines.items()}
        results["greedy_requests_differing_from_bf16"] = {
            name: sum(a != b for a, b in zip(tokens, greedy["bf16"]))
            for name, tokens in greedy.items() if name != "bf16"}
        results["fp8_weight_rel_err"] = engines["fp8"].weight_metrics()
        results["paths"] = _time_engines(engines, prompts, rounds)
        for name, e in engines.items():
            results["paths"].setdefault(name, {})["refresh_s"] = e.last_refresh_s
        results["gemms"] = gemm_times()
    finally:
        destroy_distributed()
    return results


def main(argv: list[str] | None = None) -> int:
    return sized_cli(__doc__, SIZES, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
