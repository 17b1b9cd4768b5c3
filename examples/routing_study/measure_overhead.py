#!/usr/bin/env python
"""Step-time overhead of R2 routing replay and of the routing diagnostics on the tiny recipe.

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/measure_overhead.py \
        --init-weights runs/routing_study/sft/sft_weights

Runs ``tiny_grpo.yaml`` four ways from the same weights and seed (replay none/r2 x diagnostics
off/on), ``--steps`` RL steps each, repeated ``--repeats`` times in interleaved order, and prints
the median over steps 1.. (step 0 warms up) of ``perf/step_s``, ``perf/old_logprobs_s`` (the pass
that records routes), ``perf/update_s`` and ``perf/routing_diagnostics_s``, plus the size of the
stored routes. Writes the table as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "baseline": ["--routing.replay=none", "--routing.diagnostics=false"],
    "r2": ["--routing.replay=r2", "--routing.diagnostics=false"],
    "diagnostics": ["--routing.replay=none", "--routing.diagnostics=true"],
    "r2+diagnostics": ["--routing.replay=r2", "--routing.diagnostics=true"],
    "diagnostics_no_gap": ["--routing.replay=none", "--routing.diagnostics=true",
                           "--routing.replay_gap=false"],
}
KEYS = ("perf/step_s", "perf/old_logprobs_s", "perf/update_s", "perf/routing_diagnostics_s")


def run(name, out, args, rep):
    run_dir = os.path.join(out, f"{name}_{rep}")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "gspo_megatron.train", "--config",
           os.path.join(ROOT, "examples", "configs", "tiny_grpo.yaml"),
           f"--logging.run_dir={run_dir}", "--logging.progress=false", "--sft.steps=0",
           "--data.num_train_examples=500", "--data.num_eval_examples=0",
           f"--trainer.steps={args.steps}", f"--optim.lr={args.lr}",
           *([f"--checkpoint.init_weights={args.init_weights}"] if args.init_weights else []),
           *VARIANTS[name]]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    return rows[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-weights", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "routing_overhead"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    for rep in range(args.repeats):
        for name in VARIANTS:
            rows[name] += run(name, args.out, args, rep)
    table = {}
    for name, rs in rows.items():
        table[name] = {k: statistics.median([r[k] for r in rs if k in r]) if any(k in r for r in rs)
                       else 0.0 for k in KEYS}
    base = table["baseline"]["perf/step_s"]
    print(f"{'variant':<20}" + "".join(f"{k.split('/')[1]:>24}" for k in KEYS) + f"{'vs baseline':>14}")
    for name, t in table.items():
        t["overhead_vs_baseline"] = t["perf/step_s"] / base - 1
        print(f"{name:<20}" + "".join(f"{t[k]:>24.4f}" for k in KEYS)
              + f"{100 * t['overhead_vs_baseline']:>13.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "median_s": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
