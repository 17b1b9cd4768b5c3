"""Rollout/training mismatch on CPU, side by side: bf16 rollouts, fp32 trainer; no correction, R3,
and each mismatch correction (docs/routing.md, "R3 and mismatch correction").

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/rollout_mismatch.py \
        --out runs/rollout_mismatch [--steps 6]

Every arm is the demo recipe with a finer MoE (4 layers, 32 experts, top-4: the demo's 4 experts
never flip in bf16), the same seed, warm-up and rollout budget, ``rollout.precision: bf16`` and
``routing.diagnostics: true`` (which records the engine's routes in every arm, so the
rollout-vs-trainer numbers are measured the same way with and without R3). Prints a Markdown table
of the per-step means and writes it, with each arm's metrics.jsonl, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BASE = ["--model.num_layers=4", "--model.num_moe_experts=32", "--model.moe_router_topk=4",
        "--rollout.precision=bf16", "--routing.diagnostics=true", "--routing.replay_gap=false",
        "--sft.steps=60", "--trainer.eval_interval=0", "--logging.progress=false"]

ARMS = {
    "bf16 rollout, no correction": [],
    "R3": ["--routing.replay=r3"],
    "token TIS (C=2)": ["--rollout_correction.mode=truncate"],
    "token mask [0.5, 2] (ICE-POP)": ["--rollout_correction.mode=mask"],
    "sequence TIS, geometric (C=2)": ["--rollout_correction.mode=truncate",
                                      "--rollout_correction.level=sequence"],
    "sequence mask, geometric [0.999, 1.001]": [
        "--rollout_correction.mode=mask", "--rollout_correction.level=sequence",
        "--rollout_correction.band_low=0.999", "--rollout_correction.band_high=1.001"],
    "R3 + token TIS": ["--routing.replay=r3", "--rollout_correction.mode=truncate"],
}

COLUMNS = [
    ("kl/rollout_vs_train", "k3 rollout vs train", "{:.2e}"),
    ("routing/rollout/change_rate", "routes differing", "{:.2%}"),
    ("routing/rollout/token_change_rate", "tokens with a differing route", "{:.2%}"),
    ("routing/rollout/abs_log_ratio_changed", "abs dlogp, route differs", "{:.4f}"),
    ("routing/rollout/abs_log_ratio_unchanged", "abs dlogp, same route", "{:.4f}"),
    ("correction/weight_max", "max weight", "{:.3f}"),
    ("correction/truncated_fraction", "truncated", "{:.2%}"),
    ("correction/masked_fraction", "masked", "{:.2%}"),
    ("reward/mean", "reward", "{:.3f}"),
]


def run_arm(out_dir: str, name: str, extra: list[str], steps: int,
            base: list[str] = BASE) -> list[dict]:
    """One ``gspo-train`` run of ``steps`` RL steps (``base`` + ``extra`` overrides) under
    ``out_dir``; its metrics.jsonl records."""
    run_dir = os.path.join(out_dir, name.replace(" ", "_").replace(",", "").replace("/", "_")
                           .replace("(", "").replace(")", "").replace("[", "").replace("]", ""))
    cmd = [sys.executable, "-m", "gspo_megatron.cli", f"--logging.run_dir={run_dir}",
           f"--trainer.steps={steps}", *base, *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def per_layer(records: list[dict]) -> str:
    layers = sorted({k for r in records for k in r if k.startswith("routing/rollout/change_rate/")})
    return " / ".join(f"{mean(records, k):.2%}" for k in layers)


def write_table(args, lines: list[str], record: dict) -> None:
    """The table (``lines``) to ``args.out``/table.md and stdout, and with ``args.json`` the
    committed record docs/routing.md quotes: the command, commit, date, machine and ``record``."""
    table = "\n".join(lines)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(f"{' '.join(sys.argv)}\n\nMeans over {args.steps} RL steps.\n\n{table}\n")
    if args.json:
        from gspo_megatron.tools.provenance import git_commit, utc_now

        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(),
                       "date": utc_now(), "machine": f"{os.cpu_count()} CPU cores",
                       "steps": args.steps, **record},
                      f, indent=1)
    print(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/rollout_mismatch")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None, help="also write the record (commit, date, means) here")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lines = ["| arm | " + " | ".join(c[1] for c in COLUMNS) + " | routes differing per layer |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    means: dict[str, dict] = {}
    for name, extra in ARMS.items():
        records = run_arm(args.out, name, extra, args.steps)
        cells = []
        means[name] = {key: mean(records, key) for key, _, _ in COLUMNS}
        means[name]["routes differing per layer"] = per_layer(records)
        for key, _, fmt in COLUMNS:
            value = mean(records, key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {per_layer(records)} |")
        print(lines[-1], flush=True)
    write_table(args, lines, {"base": BASE, "arms": ARMS, "columns": [c[1] for c in COLUMNS],
                              "means": means})
    return 0


if __name__ == "__main__":
    sys.exit(main())
