"""Calibrate ``rollout.router_noise_std``: the noise scale against the rollout/training mismatch
it makes (route disagreement, ``kl/rollout_vs_train``), beside bf16 and FP8 rollouts, so a run can
be placed at a measured level (the R3 paper, arXiv 2510.11370, on Qwen3-30B-A3B: ~10 % of
router decisions differ, 94 % of tokens differ in at least one layer, KL 1.5e-3).

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/router_noise.py \\
        --out runs/router_noise [--steps 3] [--stds 0,0.01,0.03,0.1,0.3,1] [--json FILE]

Every row is :mod:`rollout_mismatch`'s model and warm-up (the demo recipe, 4 layers of 32
experts top-4, 60 SFT steps, same seed) with ``routing.diagnostics`` on (the engine's routes are
recorded and compared with the trainer's old-policy pass) and a few GSPO steps. Noise rows sample
in fp32 (the trainer's precision), so the noise is the only mismatch; the bf16 and FP8 rows have
no noise. Columns are means over the steps: ``routing/rollout/change_rate`` (share of (token, MoE
layer) pairs whose top-k sets differ), ``routing/rollout/token_change_rate`` (tokens with a
differing route in >= 1 layer) and ``kl/rollout_vs_train`` (k3).
"""

from __future__ import annotations

import argparse
import os
import sys

from rollout_mismatch import BASE, mean, run_arm, write_table

PRECISION = "--rollout.precision=bf16"
NOISE_BASE = [a for a in BASE if a != PRECISION]  # fp32 rollouts: the noise alone
COLUMNS = [
    ("routing/rollout/change_rate", "routes differing", "{:.2%}"),
    ("routing/rollout/token_change_rate", "tokens with a differing route", "{:.2%}"),
    ("kl/rollout_vs_train", "k3 rollout vs train", "{:.2e}"),
    ("rollout/fp8_weight_rel_err", "FP8 weight rel. error", "{:.2%}"),
    ("reward/mean", "reward", "{:.3f}"),
]
PAPER = "| R3 paper, Qwen3-30B-A3B (bf16 vLLM vs Megatron) | ~10 % | 94 % | 1.5e-03 | - | - |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/router_noise")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stds", default="0,0.01,0.03,0.1,0.3,1",
                    help="comma-separated rollout.router_noise_std values (fp32 rollouts)")
    ap.add_argument("--json", default=None, help="also write the record (commit, date, means) here")
    ap.add_argument("--noise-only", action="store_true",
                    help="only the noise rows (no bf16 / FP8 rows): to refine the scale grid")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = {f"fp32 rollout, noise {s}": (NOISE_BASE, [f"--rollout.router_noise_std={s}"])
            for s in args.stds.split(",")}
    if not args.noise_only:
        rows["bf16 rollout"] = (BASE, [])
        rows["FP8 rollout (128 x 128 blocks)"] = (NOISE_BASE, ["--rollout.precision=fp8"])
    lines = ["| rollout | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    means: dict[str, dict] = {}
    for name, (base, extra) in rows.items():
        records = run_arm(args.out, name, extra, args.steps, base=base)
        means[name] = {key: mean(records, key) for key, _, _ in COLUMNS}
        cells = ["-" if means[name][key] is None else fmt.format(means[name][key])
                 for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines.append(PAPER)
    write_table(args, lines, {"base": BASE, "rows": {k: v[1] for k, v in rows.items()},
                              "columns": [c[1] for c in COLUMNS], "means": means})
    return 0


if __name__ == "__main__":
    sys.exit(main())
