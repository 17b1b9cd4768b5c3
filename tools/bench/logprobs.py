"""Benchmark 1: per-token log-probs + entropy at Qwen3's vocabulary, ours vs a naive fp32 path.

    python -m tools.bench.logprobs [--tokens 2048] [--vocab 151936] [--compare-ref GIT_REF]

Logits ``[T, V]`` in bf16 (what the LM head of a bf16 model produces), targets uniform. Two modes:

* ``train``: forward with entropy (the entropy detached, as in ``run_objective``), then backward
  of ``logprobs.sum()`` into a bf16 gradient;
* ``score``: no-grad forward of log-probs + entropy (``compute_logprobs``).

``ours`` is :func:`gspo_megatron.backends.megatron.logprobs.vocab_parallel_logprobs` (chunk_size 1024, the trainer's
default); ``naive`` is ``log_softmax(logits.float())`` + gather, entropy ``-(p * logp).sum()``
under no-grad, backward by autograd.

Time: both variants in this process, interleaved, median per-round ratio.
Peak extra memory: one fresh child process per (variant, mode) that builds the logits in place,
reads its RSS, runs the variant once, and reads ``getrusage(RUSAGE_SELF).ru_maxrss`` (the kernel's
high-water mark of resident memory); extra = high-water mark - RSS before the call, which counts
every temporary and the outputs (the gradient included), and nothing allocated before the call. A
1 ms RSS sampling thread cross-checks it. Reported relative to the logits tensor's own bytes.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

TARGET_MEM_X = 1.25
DEFAULT_CHUNK = 1024


def _variant_fn(name: str, ref_module_path: str | None = None):
    import torch

    if name == "naive":
        def naive(logits, target):
            logp_all = torch.log_softmax(logits.float(), -1)
            lp = logp_all.gather(-1, target[:, None]).squeeze(-1)
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
            return lp, ent
        return naive
    if name == "ours":
        from gspo_megatron.backends.megatron.logprobs import vocab_parallel_logprobs as fn
    else:  # "ours@REF": the module as committed at REF (loaded from a file)
        import importlib.util

        spec = importlib.util.spec_from_file_location("_logprobs_ref", ref_module_path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fn = mod.vocab_parallel_logprobs

    def ours(logits, target):
        return fn(logits, target, compute_entropy=True, chunk_size=DEFAULT_CHUNK)
    return ours


def _run_once(fn, logits, target, mode: str) -> None:
    import torch

    if mode == "train":
        logits.grad = None
        lp, ent = fn(logits, target)
        ent = ent.detach()
        lp.sum().backward()
        del lp, ent
        logits.grad = None
    else:
        with torch.no_grad():
            lp, ent = fn(logits, target)
        del lp, ent


def _make_inputs(tokens: int, vocab: int, dtype_name: str, seed: int = 0):
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=dtype)
    logits.normal_(0.0, 2.0, generator=gen)  # in place: no transient copy before the baseline
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    return logits.requires_grad_(), target


def child(spec: dict) -> dict:
    """Peak extra resident memory of one (variant, mode) in this fresh process."""
    import resource
    import threading

    import psutil
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    fn = _variant_fn(spec["variant"], spec.get("ref_path"))
    logits, target = _make_inputs(spec["tokens"], spec["vocab"], spec["dtype"])
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    hwm0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampled = [rss0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            sampled.append(proc.memory_info().rss)
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    _run_once(fn, logits, target, spec["mode"])
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    hwm1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logits_bytes = logits.numel() * logits.element_size()
    return {"logits_bytes": logits_bytes, "peak_extra_bytes": hwm1 - rss0,
            "sampled_extra_bytes": max(sampled) - rss0,
            # > 0: something before the call already went above the baseline (then the sampled
            # figure is the one to read); ~0 in practice.
            "pre_call_slack_bytes": max(0, hwm0 - rss0), "seconds": dt}


def _git_show(ref: str) -> str:
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = subprocess.run(["git", "show", f"{ref}:gspo_megatron/backends/megatron/logprobs.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    fd, path = tempfile.mkstemp(suffix="_logprobs_ref.py")
    with os.fdopen(fd, "w") as f:
        f.write(src)
    return path


def run(smoke: bool = False, tokens: int = 2048, vocab: int = 151936, dtype: str = "bf16",
        rounds: int = 3, threads: int = 1, compare_ref: str | None = None) -> dict:
    import torch

    from tools.bench.common import (interleaved, make_result, median, median_ratio, row,
                                    run_child)

    if smoke:
        tokens, vocab, rounds = 64, 2048, 1
    torch.set_num_threads(threads)
    variants = ["ours", "naive"]
    ref_path = None
    if compare_ref:
        ref_path = _git_show(compare_ref)
        variants.append(f"ours@{compare_ref}")
    modes = ["train", "score"]

    # Peak memory: one fresh process per (variant, mode), run one after the other.
    mem: dict[tuple[str, str], dict] = {}
    for mode in modes:
        for v in variants:
            spec = {"variant": v.split("@")[0] if "@" not in v else "ref", "mode": mode,
                    "tokens": tokens, "vocab": vocab, "dtype": dtype, "threads": threads,
                    "ref_path": ref_path}
            if smoke:  # toy sizes: the code path, in this process (figures meaningless)
                mem[(v, mode)] = child(spec)
            else:
                mem[(v, mode)] = run_child("tools.bench.logprobs", ["--child", json.dumps(spec)])

    # Time: all variants interleaved in this process on the same logits.
    logits, target = _make_inputs(tokens, vocab, dtype)
    fns = {v: _variant_fn(v.split("@")[0] if "@" not in v else "ref", ref_path) for v in variants}
    times = {}
    for mode in modes:
        t = interleaved({v: (lambda f=fns[v]: _run_once(f, logits, target, mode)) for v in variants},
                        rounds=rounds, warmup=0 if smoke else 1)
        times[mode] = t
    del logits
    gc.collect()

    logits_bytes = next(iter(mem.values()))["logits_bytes"]
    rows, ratios = [], {}
    for mode in modes:
        for v in variants:
            m = mem[(v, mode)]
            rows.append(row(f"{mode} {v}: time", median(times[mode][v]), "s"))
            rows.append(row(f"{mode} {v}: peak extra memory / logits",
                            m["peak_extra_bytes"] / logits_bytes, "x"))
        ratios[f"{mode}_time_ours_vs_naive"] = median_ratio(times[mode], "ours", "naive")
        ratios[f"{mode}_mem_ours_x_logits"] = mem[("ours", mode)]["peak_extra_bytes"] / logits_bytes
        ratios[f"{mode}_mem_naive_x_logits"] = mem[("naive", mode)]["peak_extra_bytes"] / logits_bytes
        if compare_ref:
            ratios[f"{mode}_time_ours_vs_ref"] = median_ratio(times[mode], "ours", variants[2])
    for k, v in ratios.items():
        rows.append(row(k.replace("_", " "), v, "x"))
    met = all(ratios[f"{m}_mem_ours_x_logits"] <= TARGET_MEM_X for m in modes) and \
        all(ratios[f"{m}_time_ours_vs_naive"] <= 1.0 for m in modes)
    slack = max(m["pre_call_slack_bytes"] for m in mem.values()) / logits_bytes
    notes = [f"logits [{tokens}, {vocab}] {dtype} = {logits_bytes / 2**20:.0f} MiB; "
             f"torch threads {threads}; {rounds} interleaved rounds",
             "memory: ru_maxrss high-water mark minus RSS before the call, fresh process per "
             f"variant (pre-call slack {slack:.3f}x; 1 ms RSS sampling agrees within "
             f"{max(abs(m['peak_extra_bytes'] - m['sampled_extra_bytes']) for m in mem.values()) / logits_bytes:.3f}x)"]
    if ref_path:
        os.unlink(ref_path)
    return make_result(
        "logprobs", "Log-probs + entropy at V=151,936: ours vs naive fp32 log_softmax",
        f"peak extra memory <= {TARGET_MEM_X}x the logits tensor; time <= naive (ratio <= 1.0)",
        met, rows, ratios,
        config={"tokens": tokens, "vocab": vocab, "dtype": dtype, "chunk_size": DEFAULT_CHUNK,
                "threads": threads, "rounds": rounds, "compare_ref": compare_ref,
                "memory": {f"{v}/{m}": mem[(v, m)] for (v, m) in mem}},
        notes=notes)


def _args(ap) -> None:
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--dtype", choices=["bf16", "fp32"])
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--compare-ref", help="also time the log-prob module as committed at this git ref")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(json.loads(argv[1]))), flush=True)
        return
    from tools.bench.common import module_main

    module_main(run, argv, _args)


if __name__ == "__main__":
    main()
