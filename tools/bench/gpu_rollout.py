"""Rollout engines on the GPU slice (``tools/gpu_check``'s ``rollout_bench`` stage).

    PYTHONPATH=. python -m tools.bench.gpu_rollout [--size smoke|quick|full] [--tiny]

The model of ``examples/configs/gpu_qwen3_slice_rl.yaml`` (Qwen3-30B-A3B's layer shapes, 2 layers,
random bf16 weights) built twice: with Megatron's own modules of the local spec (``SequentialMLP``:
two GEMMs and a host sync per expert) and with our local kernels (SDPA attention, the experts as
two ``torch._grouped_mm`` calls over weights stacked once per ``generate``). For each, the dynamic
and the static engine alternate on ``batch`` prompts of 16 random ids, ``new`` tokens each,
temperature 1 over a 1000-id vocabulary: one warm-up call each, then ``rounds`` timed calls.
Reported per engine (:data:`ENGINES`): tokens/s, seconds, and the cost of one decoding step of
the batch; beside them the step's memory-bound limit (:func:`memory_bound_step`) and whether
greedy tokens are the same on every dynamic path (:func:`_greedy_equal`).

Then one short call per engine (``PROFILE_TOKENS`` new tokens) under ``torch.profiler``: the ops
with the most self time on the host and on the device, and the count of what makes the host wait
for the device (``aten::item`` / ``aten::_local_scalar_dense``: a ``.item()`` or ``.tolist()`` of
a device tensor; ``aten::nonzero``; ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``) per
decoding step. On the H200 (2026-11-26) a decoding step of 128 requests on 2 layers took 96 ms
with the dynamic engine and 60 ms with the static one (Megatron's modules): far above the
arithmetic, so the host's launches and waits are what this looks for.

``--tiny``: the ``tiny`` preset in fp32 (on CPU: the code path of the GPU run, at toy size;
``tests/unit/test_bench_smoke.py`` runs it).
"""

from __future__ import annotations

import dataclasses
import gc
import time

from gspo_megatron.metrics import wait_for_device
from tools.bench.profiling import profile_call

SLICE_RECIPE = "examples/configs/gpu_qwen3_slice_rl.yaml"
PROFILE_TOKENS = 8
SIZES = {"smoke": (8, 16, 1), "quick": (32, 64, 1), "full": (128, 256, 1)}
"""size -> (requests, new tokens each, timed rounds). One timed round at full size: the H200's
two rounds of 2026-11-26 differed by 0.3 % (dynamic) and 2.3 % (static), and the check has 15
minutes of device time."""


def profile_generate(engine, prompts: list[list[int]], top: int = 12) -> dict:
    """One ``engine.generate(prompts)`` under ``torch.profiler``
    (:func:`tools.bench.profiling.profile_call`), every figure per decoding step (the longest
    response's length)."""
    out = profile_call(lambda: engine.generate(prompts, seed=0),
                       units=lambda samples: max(len(s.response_ids) for s in samples), top=top)
    out["decode_steps"] = out["units"]
    return out


ENGINES = {
    "dynamic_per_step": dict(engine="dynamic", decode_steps_per_sync=0),
    "dynamic_rounds_eager": dict(engine="dynamic", decode_cuda_graphs=False),
    "dynamic_rounds_graphs": dict(engine="dynamic", decode_cuda_graphs=True),
    "static": dict(engine="static"),
}
"""The engine paths compared: Megatron's forward and bookkeeping every step (the 2026-11-26
figure), multi-step rounds of the pure-torch step launched eagerly and replayed from CUDA graphs
(``rollout.decode_steps_per_sync``, ``rollout.decode_cuda_graphs``), the static engine."""


def _greedy_equal(engines: dict, prompts) -> dict:
    """Greedy tokens (``top_k`` 1, the call's new tokens) of every dynamic path against the per-step
    loop's: ``{path: number of requests whose tokens differ}`` (0: identical), and
    ``{path}/logprob_max_abs_diff``: the largest log-prob difference before each request's first
    different token (:func:`tools.bench.decode_probe.compare_greedy`)."""
    import traceback

    from tools.bench.decode_probe import compare_greedy

    out, ref = {}, None
    for name, engine in engines.items():
        if not name.startswith("dynamic"):
            continue
        try:
            greedy = engine.with_sampling(dataclasses.replace(engine.config, top_k=1))
            samples = greedy.generate(prompts, seed=0)
        except Exception:  # noqa: BLE001 - record it
            out[name] = traceback.format_exc()[-800:]
            continue
        if ref is None:
            ref = samples
        cmp = compare_greedy(ref, samples)
        out[name] = cmp["requests_differ"]
        out[f"{name}/logprob_max_abs_diff"] = cmp["logprob_max_abs_diff_before_first_differ"]
    return out


def memory_bound_step(model) -> dict:
    """The decoding step's memory-bound limit: bytes of weights it reads (every parameter: at 128
    requests x top-8 of 128 experts every expert is read) over the device's measured copy
    bandwidth (a 1 GiB device-to-device copy: read + write)."""
    import torch

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not torch.cuda.is_available():
        return {"weight_bytes": weight_bytes}
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 2 * 5 * x.numel() / (time.perf_counter() - t)
    del x, y
    return {"weight_bytes": weight_bytes, "bandwidth_gb_s": bandwidth / 1e9,
            "limit_ms": 1e3 * weight_bytes / bandwidth}


def slice_setup(new: int, tiny: bool):
    """``(recipe, model_cfg, vocab, precision)`` of the GPU benches: the slice recipe's model (or
    the tiny one, ``tiny``) long enough for 16 prompt + ``new`` tokens, prompts drawn from at most
    1000 ids, bf16 unless tiny, this project's kernels."""
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.config.model import model_config_from_preset

    cfg = load_config(SLICE_RECIPE)
    model_cfg = (model_config_from_preset("tiny", seq_length=16 + new) if tiny else
                 dataclasses.replace(cfg.model, seq_length=max(cfg.model.seq_length, 16 + new)))
    precision = dataclasses.replace(cfg.precision, bf16=cfg.precision.bf16 and not tiny,
                                    local_kernels=True)
    return cfg, model_cfg, min(1000, model_cfg.vocab_size), precision


def _time_engines(engines: dict, prompts, rounds: int) -> dict:
    """Alternating calls, the first of each engine a warm-up: tokens/s and seconds per call."""
    import traceback

    out: dict = {}
    for r in range(rounds + 1):
        for name, engine in engines.items():
            if "error" in out.get(name, {}):
                continue
            try:
                wait_for_device()
                t = time.perf_counter()
                samples = engine.generate(prompts, seed=r)
                wait_for_device()
                sec = time.perf_counter() - t
            except Exception:  # noqa: BLE001 - record it and measure the others
                out[name] = {"error": traceback.format_exc()[-1500:]}
                continue
            if r == 0:
                continue
            tokens = sum(len(s.response_ids) for s in samples)
            steps = max(len(s.response_ids) for s in samples)
            rec = out.setdefault(name, {"tokens_per_s": [], "seconds": [], "ms_per_step": []})
            rec["tokens_per_s"].append(tokens / sec)
            rec["seconds"].append(sec)
            rec["ms_per_step"].append(1e3 * sec / max(steps, 1))
            rec["tokens"] = tokens
    return out


def run(size: str = "full", tiny: bool = False) -> dict:
    import torch

    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.config.model import model_config_from_preset

    cfg = load_config(SLICE_RECIPE)
    batch, new, rounds = SIZES[size]
    vocab = 1000
    model_cfg = (model_config_from_preset("tiny", seq_length=16 + new) if tiny else
                 dataclasses.replace(cfg.model, seq_length=max(cfg.model.seq_length, 16 + new)))
    vocab = min(vocab, model_cfg.vocab_size)
    precision = dataclasses.replace(cfg.precision, bf16=cfg.precision.bf16 and not tiny)
    buffer_gb = 0.05 if tiny else 4.0
    groups = initialize_distributed(cfg.parallel, model_cfg, seed=0)
    results: dict = {"model": "tiny" if tiny else "qwen3-30b-a3b x 2 layers",
                     "batch": batch, "new_tokens": new, "prompt_tokens": 16, "rounds": rounds,
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (batch, 16), generator=gen).tolist()
    rc = RolloutConfig(group_size=2, prompts_per_step=1, max_new_tokens=new, max_batch_size=batch,
                       temperature=1.0, dynamic_buffer_size_gb=buffer_gb)
    try:
        for kernels in (False, True):
            variant = "our_kernels" if kernels else "megatron_modules"
            gpt = build_gpt_model(model_cfg, cfg.parallel,
                                  dataclasses.replace(precision, local_kernels=kernels),
                                  pre_process=True, post_process=True)
            engines, short = {}, {}
            for name, overrides in ENGINES.items():
                if not kernels and name.startswith("dynamic_rounds"):
                    continue  # (the rounds' step does not run Megatron's modules)
                cfg_e = dataclasses.replace(rc, **overrides)
                try:
                    engines[name] = RolloutEngine(gpt, groups, eos_id=0, pad_id=0,
                                                  vocab_size=vocab, config=cfg_e)
                    short[name] = engines[name].with_sampling(
                        dataclasses.replace(cfg_e, max_new_tokens=PROFILE_TOKENS))
                except Exception as exc:  # noqa: BLE001 - record it and measure the other
                    results[f"{variant}/{name}"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            if kernels:
                results["greedy_tokens_equal"] = _greedy_equal(engines, prompts)
                results["decode_limit"] = memory_bound_step(gpt)
            timed = _time_engines(engines, prompts, rounds)
            for name, rec in timed.items():
                if "error" not in rec:
                    try:
                        rec["profile"] = profile_generate(short[name], prompts)
                    except Exception as exc:  # noqa: BLE001
                        rec["profile"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                results[f"{variant}/{name}"] = rec
            if torch.cuda.is_available():
                results[f"{variant}/peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            del engines, short, gpt
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        destroy_distributed()
    return results


def sized_cli(doc: str, sizes: dict, run_fn, argv: list[str] | None = None) -> int:
    """``--size`` (one of ``sizes``) and ``--tiny`` -> ``run_fn(size, tiny)``'s record as one
    JSON line (the GPU-check benchmarks' command line)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--size", choices=sorted(sizes), default="full")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset in fp32 (CPU check)")
    args = ap.parse_args(argv)
    print(json.dumps(run_fn(args.size, args.tiny)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return sized_cli(__doc__, SIZES, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
