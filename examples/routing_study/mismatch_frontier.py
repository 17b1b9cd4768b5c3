#!/usr/bin/env python
"""The mismatch frontier, one command: which method survives which rollout/training mismatch.
The grid is mismatch sources x arms x seeds at one learning rate and update schedule, run with
:mod:`frontier`'s watcher and collapse rule (``frontier_rules.StabilityRule``).

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/mismatch_frontier.py --smoke
    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/mismatch_frontier.py --jobs 2

Sources (the rollout engine's numerics; the trainer is fp32 throughout): ``fp32`` rollouts (no
mismatch but kernel order), ``bf16``, ``fp8`` (128 x 128 block-scaled e4m3 weights), ``fp8`` plus
router-logit noise at the R3 paper's ~10 % route disagreement (``fp8_noise``) and at 3x that
noise scale (``fp8_noise_x3``); the scales come from ``router_noise.py``'s calibration
(``--noise-std``). Arms: GRPO, GRPO + token TIS, GRPO + sequence-level masked IS, GRPO + R2,
GRPO + R3, GSPO, SAPO, CISPO (``ARMS``). Every run starts from one shared warm-up (the routing
study's recipe and model, or ``--device cuda``'s finer one) and is stopped by the watcher once
collapsed; ``--report`` tabulates the verdicts (source x arm: stable seeds / seeds) from each
run's ``verdict.json``.

A skeleton: the full grid (5 sources x 8 arms x 3 seeds = 120 runs) has not been run; ``--smoke``
runs the path at its smallest. The noise scale was calibrated on ``router_noise.py``'s 4-layer
model, not on this one (8 layers, deeper SFT): route gaps differ between models, so measure the
scale on the frontier's warm-up before the full runs (``--noise-std``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frontier import (SIZES, SMOKE, Point, common_overrides, fail, measure_start,  # noqa: E402
                      run_point)
from run_study import ROOT, gspo_train  # noqa: E402

NOISE_STD = 0.0175
"""``rollout.router_noise_std`` that puts fp32 rollouts at ~10 % of (token, layer) routes
differing on the calibration model (docs/routing.md: 0.015 -> 8.8 %, 0.02 -> 11.4 %)."""

SOURCES = {
    "fp32": ["--rollout.precision=fp32"],
    "bf16": ["--rollout.precision=bf16"],
    "fp8": ["--rollout.precision=fp8"],
    "fp8_noise": ["--rollout.precision=fp8", "--rollout.router_noise_std={std}"],
    "fp8_noise_x3": ["--rollout.precision=fp8", "--rollout.router_noise_std={std3}"],
}
"""Mismatch source -> rollout overrides (``{std}`` / ``{std3}``: the calibrated noise, 3x it)."""

ARMS = {
    "grpo": ("grpo", []),
    "grpo_tis": ("grpo", ["--rollout_correction.mode=truncate"]),
    "grpo_mis_seq": ("grpo", ["--rollout_correction.mode=mask",
                              "--rollout_correction.level=sequence"]),
    "grpo_r2": ("grpo_r2", []),
    "grpo_r3": ("grpo_r3", []),
    "gspo": ("gspo", []),
    "sapo": ("sapo", []),
    "cispo": ("cispo", []),
}
"""Arm -> (the stability frontier's arm it extends, extra overrides: the mismatch corrections)."""

SMOKE_GRID = dict(sources=("bf16", "fp8_noise"), arms=("grpo_tis", "gspo"))


def source_overrides(source: str, std: float) -> list[str]:
    return [a.format(std=std, std3=3 * std) for a in SOURCES[source]]


def run_cell(source: str, arm: str, point: Point, size, root: str, common: list[str],
             std: float, start_reward: float, log) -> dict:
    """One (source, arm, seed) run through :func:`frontier.run_point`, in
    ``root/<source>/<arm>/...``; the shared warm-up is linked in as its ``sft``."""
    out = os.path.join(root, source, arm)
    os.makedirs(out, exist_ok=True)
    link = os.path.join(out, "sft")
    if not os.path.exists(link):
        os.symlink(os.path.join(root, "sft"), link)
    base_arm, extra = ARMS[arm]
    cell_common = [*common, *source_overrides(source, std), *extra]
    record = run_point(dataclasses.replace(point, arm=base_arm), size, out, cell_common,
                       start_reward, log)
    return {**record, "source": source, "arm": arm}


def table(records: list[dict], sources, arms) -> str:
    """Markdown: per source and arm, the seeds that did not collapse / the seeds run."""
    lines = ["| source | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for s in sources:
        cells = []
        for a in arms:
            runs = [r for r in records if r["source"] == s and r["arm"] == a]
            ok = sum(1 for r in runs if not r.get("stopped") and not r.get("failed"))
            cells.append(f"{ok}/{len(runs)}" if runs else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--smoke", action="store_true", help="2 sources x 2 arms, a few steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sources", default=None, help=f"comma-separated of {','.join(SOURCES)}")
    ap.add_argument("--arms", default=None, help=f"comma-separated of {','.join(ARMS)}")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--lr-factor", type=float, default=1.0,
                    help="multiple of the study's lr 5e-5 (the frontier's stable x1 by default)")
    ap.add_argument("--updates", type=int, default=4, help="minibatch updates per rollout batch")
    ap.add_argument("--noise-std", type=float, default=NOISE_STD)
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    size = SIZES[args.device]
    grid = SMOKE_GRID if args.smoke else dict(sources=tuple(SOURCES), arms=tuple(ARMS))
    sources = tuple(args.sources.split(",")) if args.sources else grid["sources"]
    arms = tuple(args.arms.split(",")) if args.arms else grid["arms"]
    for what, names, known in (("--sources", sources, SOURCES), ("--arms", arms, ARMS)):
        bad = [n for n in names if n not in known]
        if bad:
            fail(f"{what}: unknown {bad}; one of {','.join(known)}")
    if not args.noise_std > 0:
        fail(f"--noise-std: must be > 0, got {args.noise_std}")
    seeds = (1,) if args.smoke else tuple(int(s) for s in args.seeds.split(","))
    if args.smoke:
        size = dataclasses.replace(size, **{k: v for k, v in SMOKE.items()
                                            if k in ("steps", "sft_steps", "diagnostics_interval")})
    if args.jobs:
        size = dataclasses.replace(size, jobs=args.jobs)
    if size.batch % args.updates:
        fail(f"--updates: {args.updates} does not divide the rollout batch of {size.batch}")
    root = args.out or os.path.join(ROOT, "runs", "mismatch_frontier" + (
        "_smoke" if args.smoke else "") + ("_cuda" if args.device == "cuda" else ""))
    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)  # noqa: E731
    common = [a for a in common_overrides(size, "fp32")
              if not a.startswith("--rollout.precision=")]  # each source sets its own
    if not os.path.exists(os.path.join(root, "sft", "sft_weights")):
        log(f"SFT warm-up, {size.sft_steps} steps")
        os.makedirs(os.path.join(root, "sft"), exist_ok=True)
        gspo_train(os.path.join(root, "sft"), [*common, f"--sft.steps={size.sft_steps}",
                                               "--trainer.steps=0", "--trainer.seed=1234"],
                   log, threads=size.threads)
    start_reward = measure_start(root, common, size, log)
    cells = [(s, a, Point(a, args.lr_factor, args.updates, seed))
             for seed in seeds for s in sources for a in arms]
    log(f"{len(cells)} runs ({len(sources)} sources x {len(arms)} arms x {len(seeds)} seeds), "
        f"{size.jobs} at a time; start reward {start_reward:.3f}")
    with concurrent.futures.ThreadPoolExecutor(size.jobs) as pool:
        records = list(pool.map(lambda c: run_cell(*c, size, root, common, args.noise_std,
                                                   start_reward, log), cells))
    text = table(records, sources, arms)
    wall = time.perf_counter() - started
    with open(os.path.join(root, "mismatch_frontier.json"), "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "wall_s": round(wall, 1),
                   "noise_std": args.noise_std, "records": records, "table": text}, f, indent=1)
    print(text)
    print(json.dumps({"wall_s": round(wall, 1), "runs": len(records)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
