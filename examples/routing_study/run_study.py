#!/usr/bin/env python
"""GSPO vs GRPO vs GRPO + Routing Replay (R2) on the tiny MoE, same seed and data, one command.

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/run_study.py

1. one supervised warm-up (``gspo-train ... --trainer.steps=0``; it saves ``<run>/sft_weights``);
2. three RL runs from those weights with the routing diagnostics on: GSPO (no replay), GRPO (no
   replay), GRPO with R2 (``examples/configs/tiny_grpo_r2.yaml``); same seed, data, rollout
   settings and learning rate;
3. ``gspo-routing-report`` over the three runs -> ``--report`` (Markdown + PNGs).

Runs go to ``--out`` (default runs/routing_study); the report defaults to
examples/routing_study/results. On 2 CPU cores the defaults take about 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "examples", "configs")

RUNS = {  # name: (recipe, extra overrides)
    "gspo": ("tiny_gspo.yaml", ["--routing.replay=none"]),
    "grpo": ("tiny_grpo.yaml", ["--routing.replay=none"]),
    "grpo_r2": ("tiny_grpo_r2.yaml", ["--routing.replay=r2"]),
}


def gspo_train(recipe: str, run_dir: str, overrides: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               WANDB_MODE="disabled", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "--config", os.path.join(CONFIGS, recipe),
           f"--logging.run_dir={run_dir}", "--logging.progress=false", *overrides]
    print("$", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({run_dir}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    for line in proc.stdout.splitlines():
        if "accuracy" in line or line.startswith("sft step"):
            print("   ", line, flush=True)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "routing_study"))
    ap.add_argument("--report", default=os.path.join(ROOT, "examples", "routing_study", "results"))
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=100, help="RL steps per run")
    ap.add_argument("--lr", type=float, default=1e-4, help="RL learning rate (all runs)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--runs", default=",".join(RUNS), help="subset of " + ",".join(RUNS))
    args = ap.parse_args(argv)

    common = [f"--trainer.seed={args.seed}", "--data.num_train_examples=500",
              "--data.num_eval_examples=60"]
    sft_dir = os.path.join(args.out, "sft")
    times = {}
    if not os.path.exists(os.path.join(sft_dir, "sft_weights")):
        times["sft"] = gspo_train("tiny_gspo.yaml", sft_dir, [
            *common, f"--sft.steps={args.sft_steps}", "--trainer.steps=0",
            ])
    for name in args.runs.split(","):
        recipe, extra = RUNS[name]
        times[name] = gspo_train(recipe, os.path.join(args.out, name), [
            *common, *extra, f"--checkpoint.init_weights={os.path.join(sft_dir, 'sft_weights')}",
            "--sft.steps=0", f"--trainer.steps={args.steps}", f"--optim.lr={args.lr}",
            "--routing.diagnostics=true"])
    names = args.runs.split(",")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "routing_report.py"),
                    *[os.path.join(args.out, n) for n in names], "--names", ",".join(names),
                    "--out", args.report,
                    "--title", f"Routing study: {' vs '.join(names)} (tiny MoE, {args.steps} RL steps)"],
                   check=True)
    with open(os.path.join(args.report, "study_settings.json"), "w") as f:
        json.dump({**vars(args), "out": os.path.relpath(args.out, ROOT),
                   "report": os.path.relpath(args.report, ROOT),
                   "wall_s": {k: round(v, 1) for k, v in times.items()}}, f, indent=2)
    print("wall time (s):", {k: round(v, 1) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
