"""A learning run per registered loss on the CPU demo task: held-out accuracy before and after RL,
over seeds, into docs/results/loss_registry.json.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/loss_runs.py [--seeds 1,2,3] [--jobs 1]

Each run is the demo recipe (``gspo-train`` with no ``--config``: 300 SFT steps, 600 RL steps of
16 prompts x 8 responses, 4 minibatches per step) with only ``--loss.variant`` changed. Every
registered loss runs at its paper's defaults, except GSPO and GSPO-token, which keep the demo's
1e-2 (the recipe's ``loss.gspo`` / ``loss.gspo_token`` blocks: its 2-3-token answers make the
sequence ratio a token ratio; docs/getting-started.md explains). Three more arms: GRPO with the dual clip (3.0), GRPO with Dr. GRPO's
aggregation, GSPO with LUSPO's. Only ``trainer.seed`` changes between seeds (the SFT warm-up's
and the RL's sampling and order). Run directories go to ``--out`` (default runs/loss_runs/).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import time

from gspo_megatron.algorithms import LOSSES
from gspo_megatron.tools.provenance import git_commit, utc_now

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "docs", "results", "loss_registry.json")


def arms() -> dict[str, list[str]]:
    """``{arm: overrides}``: every registered loss, then the dual clip and two aggregations."""
    out = {v: [f"--loss.variant={v}"] for v in LOSSES}
    out["grpo_dual_clip"] = [*out["grpo"], "--loss.clip_ratio_c=3.0"]
    out["grpo_dr_grpo"] = [*out["grpo"], "--loss.aggregation=seq_mean_token_sum_norm"]
    out["gspo_luspo"] = [*out["gspo"], "--loss.aggregation=seq_mean_token_sum"]
    return out


def run(run_dir: str, overrides: list[str]) -> dict:
    """One demo run; its summary.json, wall time and the mean of its last 100 steps' reward."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "gspo_megatron.cli", f"--logging.run_dir={run_dir}",
           "--logging.progress=false", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    clip = [r["clip/fraction"] for r in rows if "clip/fraction" in r]
    return {"accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"],
            "reward_first_100": sum(rewards[:100]) / len(rewards[:100]),
            "reward_last_100": sum(rewards[-100:]) / len(rewards[-100:]),
            "clip_fraction_mean": sum(clip) / len(clip) if clip else None,
            "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--arms", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "loss_runs"))
    ap.add_argument("--result", default=RESULT)
    args = ap.parse_args(argv)
    table = arms()
    chosen = args.arms.split(",") if args.arms else list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {list(table)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    commit = git_commit(("gspo_megatron", "tools"))
    started = time.perf_counter()
    results: dict[str, dict[int, dict]] = {arm: {} for arm in chosen}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run, os.path.join(args.out, arm, f"seed_{seed}"),
                               [*table[arm], f"--trainer.seed={seed}"]): (arm, seed)
                   for arm in chosen for seed in seeds}
        for future in concurrent.futures.as_completed(futures):
            arm, seed = futures[future]
            results[arm][seed] = future.result()
            print(f"[{time.perf_counter() - started:6.0f} s] {arm} seed {seed}: "
                  f"{results[arm][seed]}", flush=True)
    record = {
        "what": "held-out greedy accuracy (120 problems) before and after RL, demo recipe, per "
                "loss and seed",
        "command": " ".join(["PYTHONPATH=. OMP_NUM_THREADS=1 python tools/loss_runs.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "arm_overrides": {arm: table[arm] for arm in chosen},
        "seeds": seeds, "commit": commit, "date": utc_now(),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                   f"{args.jobs} run(s) at a time, one thread each",
        "wall_s": round(time.perf_counter() - started, 1),
        "runs": {arm: {str(s): results[arm][s] for s in seeds} for arm in chosen},
    }
    os.makedirs(os.path.dirname(args.result), exist_ok=True)
    with open(args.result, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
