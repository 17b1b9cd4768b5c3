"""What ``tools/gpu_check.py`` reads off its stages: the machine (:func:`env_report`), a run
directory's figures (:func:`run_figures`), two runs field by field (:func:`compare_metrics`),
``gspo-plan``'s peaks against a run's (:func:`plan_vs_measured`) and the zero-mismatch stage's
verdict (:func:`zero_mismatch_summary`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_report() -> dict:
    import importlib.util

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), capability=list(p.major_minor)
                   if hasattr(p, "major_minor") else [p.major, p.minor],
                   memory_gib=p.total_memory / 2**30, sms=p.multi_processor_count)
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("megatron-core", "transformer-engine", "flash-attn", "einops", "grouped_gemm",
                 "apex"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["torch._grouped_mm"] = hasattr(torch, "_grouped_mm")
    out["triton"] = importlib.util.find_spec("triton") is not None
    usage = shutil.disk_usage(HERE)
    out["disk_free_gib"] = usage.free / 2**30
    return out


def run_figures(run_dir: str) -> dict:
    """The figures the report needs from a run directory's metrics.jsonl and summary.json."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    rows = [json.loads(line) for line in open(path) if line.strip()]
    keys = ("kl/rollout_vs_train", "loss/policy", "clip/fraction", "optim/grad_norm",
            "reward/mean", "eval/accuracy", "perf/step_s", "perf/rollout_s", "perf/reward_s",
            "perf/old_logprobs_s", "perf/update_s", "perf/checkpoint_s", "perf/publish_weights_s",
            "perf/rollout_tokens_per_s", "perf/peak_mem_gib", "perf/rollout_peak_mem_gib",
            "perf/train_peak_mem_gib", "response/mean_length", "ratio/first_minibatch_max_abs_log",
            "clip/first_minibatch_fraction",
            "routing/drift/after_1_updates", "routing/drift/after_3_updates",
            "routing/rollout/change_rate", "routing/rollout/token_change_rate",
            "mismatch/tokens_differ")
    out: dict = {"steps": [r.get("step") for r in rows]}
    for k in keys:
        vals = [r[k] for r in rows if k in r]
        if vals:
            out[k] = vals
    for name, key in (("summary.json", "summary"), ("memory_profile.json", "memory_profile")):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            out[key] = json.load(open(path))
    return out


def compare_metrics(run_a: str, run_b: str) -> dict:
    """Field-by-field comparison of two runs' metrics (perf/ and time fields excluded): count of
    fields, how many differ, and the largest absolute difference."""
    def load(d):
        return [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if line.strip()]

    a, b = load(run_a), load(run_b)
    n = differ = 0
    worst, worst_key = 0.0, None
    for ra, rb in zip(a, b):
        for k in set(ra) & set(rb):
            if k.startswith(("perf/", "time")):
                continue
            n += 1
            if ra[k] != rb[k]:
                differ += 1
                if isinstance(ra[k], (int, float)) and isinstance(rb[k], (int, float)):
                    d = abs(ra[k] - rb[k])
                    if d > worst:
                        worst, worst_key = d, f"step {ra.get('step')} {k}"
    return {"records": [len(a), len(b)], "fields": n, "differ": differ,
            "max_abs_diff": worst, "max_abs_diff_at": worst_key}


def plan_vs_measured(plan_output: str, figures: dict) -> dict:
    """``gspo-plan``'s ``training peak`` / ``rollout peak`` lines (GiB) against a run's largest
    ``perf/train_peak_mem_gib`` / ``perf/rollout_peak_mem_gib``: each pair and measured / planned
    (the issue's bar: within 15 %)."""
    out: dict = {}
    for phase in ("training", "rollout"):
        match = re.search(rf"^\s*{phase} peak\s+([\d.]+) GiB", plan_output, re.MULTILINE)
        key = f"perf/{'train' if phase == 'training' else phase}_peak_mem_gib"
        if match and figures.get(key):
            planned, measured = float(match.group(1)), max(figures[key])
            out[phase] = {"planned_gib": planned, "measured_gib": measured,
                          "measured_over_planned": measured / planned}
    return out


def zero_mismatch_summary(on: dict, off: dict) -> dict:
    """``tiny_zero_mismatch``'s verdict from the two runs' :func:`run_figures`: tokens differing
    and ``kl/rollout_vs_train`` per step with the mode on and off, whether every step of the mode
    is 0 / 0.0 / routes equal, and the cost (median step, rollout and update seconds on / off)."""
    import statistics

    def med(figs, key):
        vals = figs.get(key) or []
        return statistics.median(vals) if vals else None

    out = {side: {k: figs.get(k) for k in ("mismatch/tokens_differ", "kl/rollout_vs_train",
                                            "routing/rollout/change_rate")}
           for side, figs in (("on", on), ("off", off))}
    differ = on.get("mismatch/tokens_differ") or [None]
    out["zero"] = (all(v == 0 for v in differ)
                   and all(v == 0.0 for v in on.get("kl/rollout_vs_train") or [None])
                   and all(v == 0.0 for v in on.get("routing/rollout/change_rate") or [0.0]))
    for key in ("perf/step_s", "perf/rollout_s", "perf/update_s"):
        a, b = med(on, key), med(off, key)
        out[f"{key}_on_vs_off"] = a / b if a is not None and b else None
    return out
