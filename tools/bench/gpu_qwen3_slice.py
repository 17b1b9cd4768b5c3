"""Benchmark 6 (GPU): Megatron-Core's CUDA path in bf16 on a Qwen3-30B-A3B-shaped slice, one GPU.

    PYTHONPATH=. python -m tools.bench.gpu_qwen3_slice [--layers 4] [--seq 4096] [--iters 5]

Needs CUDA and megatron-core (Transformer Engine optional); without CUDA it returns a "not run"
record, and with ``--smoke`` also runs the slice code once on CPU (tiny preset, fp32, local spec)
so that the code a GPU session depends on is exercised by the test suite. Measured in one run, one
after the other on the same GPU:

1. bf16 matmul ceiling: ``torch.matmul`` of 8192^3 bf16 (CUDA events), the denominator of MFU.
2. The slice: ``qwen3-30b-a3b`` preset at full width (hidden 2048, 32 heads / 4 KV groups, head
   dim 128, 128 experts top-8, expert FFN 768, vocabulary 151,936) with ``--layers`` layers, bf16,
   micro-batch 1 x ``--seq`` tokens: forward + backward of the token NLL through the LM head and
   our log-prob kernel. tokens/s, model TFLOP/s (6 x matmul FLOPs per token + causal attention,
   counted below), MFU = TFLOP/s / the measured bf16 matmul TFLOP/s.
3. Megatron's local spec (experts as a loop; grouped only with the ``grouped_gemm`` package) vs
   the same spec with our local kernels (SDPA attention; the experts as two ``torch._grouped_mm``
   calls in bf16 on Hopper). Each then runs one more step under ``torch.profiler``: how busy the
   device is over the step's wall time, and its time split into GEMMs, attention and the rest
   (``tools/bench/profiling.py``), which says where the gap to the matmul peak lies.
4. Transformer Engine spec (bf16), and FP8 (``hybrid`` recipe) when TE imports.
5. The log-prob path at full vocabulary: ``torch.cuda.max_memory_allocated`` above the logits of
   ours vs a naive fp32 ``log_softmax`` (forward + backward, entropy detached), bf16 logits
   [``--seq``, 151936].

Each configuration is built, timed and freed before the next (``--iters`` timed iterations after
2 warm-up ones); a configuration that fails (e.g. FP8 on a GPU without FP8) is recorded with its
error and the others still run.
"""

from __future__ import annotations

import gc
import time


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1000 / iters
    del a, b
    return 2 * n ** 3 / sec / 1e12


def model_flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token (forward x3): every matmul of attention, router, the top-k experts'
    SwiGLU, dense MLPs and the LM head, plus causal attention scores (QK^T and AV, half masked)."""
    h, d = cfg.hidden_size, cfg.head_dim()
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    fwd = 0.0
    for moe in cfg.layer_is_moe():
        fwd += 2 * h * (q + 2 * kv) + 2 * q * h               # qkv + out projection
        fwd += 2 * 2 * q * seq / 2                            # scores + AV, causal
        if moe:
            fwd += 2 * h * cfg.num_moe_experts                # router
            fwd += cfg.moe_router_topk * 3 * 2 * h * cfg.moe_ffn_hidden_size
        else:
            fwd += 3 * 2 * h * cfg.ffn_hidden_size
    fwd += 2 * h * cfg.padded_vocab_size()                    # LM head
    return 3 * fwd


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_slice(layers: int, seq: int, iters: int, impl: str, grouped: bool,
               fp8: str | None = None, preset: str = "qwen3-30b-a3b",
               device: str = "cuda", local_kernels: bool = False, profile: bool = True) -> dict:
    """Forward + backward of ``preset`` with ``layers`` layers on ``[1, seq]`` tokens: seconds per
    step, tokens/s, model TFLOP/s and (CUDA) peak memory. bf16 on CUDA, fp32 on CPU. ``profile``:
    one more step under ``torch.profiler`` after the timed ones
    (:func:`tools.bench.profiling.profile_call`: device time by GEMM / attention / other, the top
    kernels, host waits)."""
    import torch

    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
    from gspo_megatron.backends.megatron.logprobs import vocab_parallel_logprobs
    from tools.bench.profiling import profile_call

    cfg = model_config_from_preset(preset, num_layers=layers, seq_length=seq)
    prec = PrecisionConfig(transformer_impl=impl, bf16=device == "cuda", fp8=fp8,
                           local_kernels=local_kernels)
    gpt = build_gpt_model(cfg, ParallelConfig(), prec, pre_process=True, post_process=True,
                          transformer_config_overrides={"moe_grouped_gemm": grouped})
    gpt.train()
    params = sum(p.numel() for p in gpt.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    pos = torch.arange(seq, device=device)[None]
    labels = torch.roll(tokens, -1, 1)

    def step():
        logits = gpt(tokens, pos, attention_mask=None)
        lp, _ = vocab_parallel_logprobs(logits, labels, vocab_size=cfg.vocab_size,
                                        compute_entropy=False)
        (-lp.mean()).backward()
        for p in gpt.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None

    ctx = _fp8_context(fp8)
    with ctx:
        for _ in range(2):
            step()
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        sec = (time.perf_counter() - t) / iters
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
        # After the timing (the profiler's own overhead is not in step_s): where a step's device
        # time goes, and how much of the wall time the device is busy at all.
        prof = profile_call(step, units=1) if profile else None
    del gpt
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    flops = model_flops_per_token(cfg, seq) * seq
    return {"impl": impl, "grouped_gemm": grouped, "fp8": fp8, "local_kernels": local_kernels,
            "layers": layers, "seq": seq,
            "params": params, "step_s": sec, "tokens_per_s": seq / sec,
            "tflops": flops / sec / 1e12, "peak_mem_gb": peak / 2**30, "profile": prof}


def _fp8_context(fp8: str | None):
    import contextlib

    if not fp8:
        return contextlib.nullcontext()
    # Megatron applies FP8 inside TE layers from config.fp8; TE's autocast is the outer switch.
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID if fp8 == "hybrid" else Format.E4M3)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def logprob_memory(seq: int, vocab: int = 151936) -> dict:
    import torch

    from gspo_megatron.backends.megatron.logprobs import vocab_parallel_logprobs

    out = {}
    for name in ("ours", "naive"):
        logits = torch.randn(seq, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
        target = torch.randint(0, vocab, (seq,), device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        if name == "ours":
            lp, ent = vocab_parallel_logprobs(logits, target, compute_entropy=True)
        else:
            logp_all = torch.log_softmax(logits.float(), -1)
            lp = logp_all.gather(-1, target[:, None]).squeeze(-1)
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
            del logp_all
        lp.sum().backward()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() - base
        out[name] = {"peak_extra_x_logits": peak / (logits.numel() * 2), "seconds": dt}
        del logits, target, lp, ent
        gc.collect()
        torch.cuda.empty_cache()
    return out


def run(smoke: bool = False, layers: int = 4, seq: int = 4096, iters: int = 5) -> dict:
    import torch

    from tools.bench.common import make_result, row

    title = "Qwen3-30B-A3B slice on one GPU (bf16, megatron-core CUDA path)"
    target = "report tokens/s, TFLOP/s, MFU vs measured bf16 matmul; grouped vs sequential experts"
    if not torch.cuda.is_available():
        rows, notes = [row("not run: no GPU lent to this session", None, "")], [
            "needs CUDA; run on a GPU box: python -m tools.bench.gpu_qwen3_slice"]
        if smoke:
            rows.append(row("CPU code-path check (tiny preset, fp32): tokens/s",
                            _cpu_code_path_check()["tokens_per_s"], "tok/s"))
            notes.append("--smoke without CUDA: the slice code ran once on CPU at toy size; "
                         "the figure is not a GPU measurement")
        return make_result("gpu_qwen3_slice", title, target, None, rows, notes=notes)
    from gspo_megatron.backends.megatron.model import transformer_engine_available
    from gspo_megatron.config.model import ParallelConfig, model_config_from_preset
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from tools.bench.common import quiet_megatron

    quiet_megatron()
    if smoke:
        layers, seq, iters = 1, 256, 1
    peak = matmul_tflops()
    rows = [row("bf16 matmul 8192^3", peak, "TFLOP/s")]
    from gspo_megatron.backends.megatron.model import grouped_gemm_available

    # (spec, grouped experts, fp8, our local kernels). Megatron's local spec runs the experts as a
    # loop unless the grouped_gemm package is installed; our kernels add SDPA attention.
    configs = [("local", False, None, False), ("local", False, None, True)]
    if grouped_gemm_available("local"):
        configs.append(("local", True, None, False))
    if transformer_engine_available():
        configs += [("transformer_engine", True, None, False),
                    ("transformer_engine", True, "hybrid", False)]
    results, notes = [], [f"device: {torch.cuda.get_device_name(0)}"]
    groups_cfg = model_config_from_preset("qwen3-30b-a3b", num_layers=layers, seq_length=seq)
    initialize_distributed(ParallelConfig(), groups_cfg, seed=0)
    try:
        for impl, grouped, fp8, lk in configs:
            label = (f"{impl}{' + our kernels' if lk else ''}"
                     f"{' grouped' if grouped else ' sequential'} experts{' fp8' if fp8 else ''}")
            try:
                r = time_slice(layers, seq, iters, impl, grouped, fp8, local_kernels=lk)
            except Exception as exc:  # noqa: BLE001 - record and go on with the others
                notes.append(f"{label}: failed: {type(exc).__name__}: {exc}"[:300])
                gc.collect()
                torch.cuda.empty_cache()
                continue
            r["mfu"] = r["tflops"] / peak
            results.append(r)
            rows += [row(f"{label}: tokens/s", r["tokens_per_s"], "tok/s"),
                     row(f"{label}: model TFLOP/s", r["tflops"], "TFLOP/s"),
                     row(f"{label}: MFU vs bf16 matmul", r["mfu"], "fraction"),
                     row(f"{label}: peak memory", r["peak_mem_gb"], "GiB")]
            rows += _profile_rows(label, r["profile"])
        lpm = logprob_memory(seq)
    finally:
        destroy_distributed()
    for name, m in lpm.items():
        rows.append(row(f"log-probs [{seq}, 151936] bf16 fwd+bwd, {name}: peak extra / logits",
                        m["peak_extra_x_logits"], "x"))
    ratios = {}
    base = [r for r in results if r["impl"] == "local" and not r["local_kernels"]
            and not r["grouped_gemm"]]
    ours = [r for r in results if r["local_kernels"]]
    if base and ours:
        ratios["our_kernels_vs_megatron_local_tokens_per_s"] = (
            ours[0]["tokens_per_s"] / base[0]["tokens_per_s"])
        rows.append(row("our local kernels / Megatron local spec tokens/s",
                        ratios["our_kernels_vs_megatron_local_tokens_per_s"], "x"))
    return make_result("gpu_qwen3_slice", title, target, None, rows, ratios,
                       config={"layers": layers, "seq": seq, "iters": iters, "results": results,
                               "logprob_memory": lpm}, notes=notes)


def _profile_rows(label: str, prof: dict | None) -> list[dict]:
    """The profiled step in a few rows: the device's busy share of the wall time (well under 1:
    the host sets the pace) and the device time's split by kernel kind."""
    from tools.bench.common import row

    if not prof:
        return []
    busy = prof["device_us_per_unit"]
    rows = [row(f"{label}: device busy / wall (profiled step)",
                busy / prof["wall_us_per_unit"], "fraction")]
    if busy > 0:
        rows += [row(f"{label}: device time in {kind}", us / busy, "fraction")
                 for kind, us in prof["device_by_kind_us_per_unit"].items()]
    return rows


def _cpu_code_path_check() -> dict:
    """``time_slice`` at toy size on CPU (tiny preset, local spec, fp32), in its own process group."""
    from gspo_megatron.config.model import model_config_from_preset
    from tools.bench import _model

    with _model.distributed(model_config_from_preset("tiny")):
        return time_slice(layers=2, seq=32, iters=1, impl="local", grouped=False,
                          preset="tiny", device="cpu")


def _args(ap) -> None:
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--iters", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
