#!/usr/bin/env python
"""The mismatch frontier, one command: which method survives which rollout/training mismatch.
The grid is mismatch sources x arms x seeds at one learning rate and update schedule, run with
:mod:`frontier`'s watcher and collapse rule (``frontier_rules.StabilityRule``).

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/mismatch_frontier.py --jobs 2
    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/mismatch_frontier.py --smoke
    python examples/routing_study/mismatch_report.py runs/mismatch_frontier   # report again

Sources (the rollout engine's numerics; the trainer is fp32 throughout): ``zero`` (fp32 rollouts
in the batch-invariant mode, ``precision.batch_invariant``: bitwise the trainer's log-probs and
routes), ``fp32`` rollouts (the kernels' order of reduction only), ``bf16``, ``fp8`` (128 x 128
block-scaled e4m3 weights), ``fp8`` plus router-logit noise at the R3 paper's ~10 % of router
decisions differing (``fp8_noise``) and at 3x that noise scale (``fp8_noise_x3``). Arms: GRPO, GRPO
+ token TIS, GRPO + sequence-level masked IS, GRPO + R2, GRPO + R3, GSPO, SAPO, CISPO (``ARMS``).

1. one shared warm-up (the routing study's recipe and model: 8 MoE layers of 32 experts top-4,
   400 SFT steps; ``--device cuda``'s is finer) and its sampled reward (the rule's start);
2. the noise calibrated **on that warm-up** (``calibrate_noise``): short fp32 runs at a few noise
   scales, the measured share of (token, layer) routes differing interpolated (log-log) to
   ``--target-disagreement`` (default the paper's 10 %); ``--noise-std`` skips it;
3. every (source, arm, seed) run, ``--jobs`` at a time, stopped by the watcher once collapsed;
4. ``mismatch_report.py``: the collapse map, the mismatch per source against the paper's, the
   reward curves per arm at the paper's level.

The point: lr x3 of the study's 5e-5 at 4 updates per rollout batch, the largest setting where
every arm of the stability frontier (bf16 rollouts, 3 seeds) was stable, one step below where
GSPO's broke: a mismatch that matters shows as a collapse there, one that does not leaves the arm
where bf16 left it. ``--lr-factor`` / ``--updates`` move it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frontier import (SIZES, SMOKE, MetricsTail, Point, common_overrides, fail,  # noqa: E402
                      measure_start, point_overrides, run_point)
from frontier_rules import mean  # noqa: E402
from run_study import ROOT, gspo_train  # noqa: E402

from gspo_megatron.tools.provenance import git_commit, utc_now  # noqa: E402

SOURCES = {
    "zero": ["--rollout.precision=fp32", "--precision.batch_invariant=true"],
    "fp32": ["--rollout.precision=fp32"],
    "bf16": ["--rollout.precision=bf16"],
    "fp8": ["--rollout.precision=fp8"],
    "fp8_noise": ["--rollout.precision=fp8", "--rollout.router_noise_std={std}"],
    "fp8_noise_x3": ["--rollout.precision=fp8", "--rollout.router_noise_std={std3}"],
}
"""Mismatch source -> rollout overrides (``{std}`` / ``{std3}``: the calibrated noise, 3x it)."""
RUN_ORDER = ("zero", "fp8_noise_x3", "fp8_noise", "fp8", "bf16", "fp32")
"""The order the sources run in within a seed (the report keeps :data:`SOURCES`' order)."""

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

SMOKE_GRID = dict(sources=("zero", "fp8_noise"), arms=("grpo_tis", "gspo"))
CALIBRATION_STDS = (0.002, 0.004, 0.008, 0.016)
"""Router-noise scales of the calibration runs (fp32 rollouts): on the 8-layer study model 0.0175
gave ~30 % of routes differing, so 10 % lies inside this range."""
CALIBRATION_STEPS = 2
DISAGREEMENT = "routing/rollout/change_rate"
"""Share of (token, MoE layer) pairs whose rollout and trainer top-k sets differ."""


def source_overrides(source: str, std: float) -> list[str]:
    return [a.format(std=std, std3=3 * std) for a in SOURCES[source]]


def interpolate_std(points: list[tuple[float, float]], target: float) -> float:
    """The noise scale whose route disagreement is ``target``, by log-log interpolation between
    the two calibration points around it (extrapolation from the nearest two outside them):
    disagreement grows about as a power of the scale while it is small.
    ``points``: ``[(std, disagreement)]`` with std > 0."""
    pts = sorted((s, d) for s, d in points if s > 0 and d > 0)
    if len(pts) < 2:
        raise ValueError(f"calibration: need two scales with routes differing, got {points}")
    pairs = list(zip(pts, pts[1:]))
    (s0, d0), (s1, d1) = next(((a, b) for a, b in pairs if a[1] <= target <= b[1]),
                              pairs[0] if target < pts[0][1] else pairs[-1])
    if d1 == d0:
        return s0
    slope = (math.log(d1) - math.log(d0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(s0) + (math.log(target) - math.log(d0)) / slope)


def calibrate_noise(root: str, common: list[str], size, target: float, jobs: int, log) -> dict:
    """Short GSPO runs from the warm-up with fp32 rollouts and router noise at each of
    :data:`CALIBRATION_STDS` (``root/calibration``); their mean route disagreement and
    ``kl/rollout_vs_train``, and the scale interpolated to ``target``. Cached in
    ``calibration.json``."""
    path = os.path.join(root, "calibration", "calibration.json")
    if os.path.exists(path):
        record = json.load(open(path))
        if record["target"] == target and tuple(record["stds"]) == CALIBRATION_STDS:
            return record
    cal_size = dataclasses.replace(size, steps=CALIBRATION_STEPS)
    sft = os.path.join(root, "sft", "sft_weights")

    def one(std: float) -> dict:
        run_dir = os.path.join(root, "calibration", f"std_{std:g}")
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut off before: start it afresh
        os.makedirs(run_dir, exist_ok=True)
        gspo_train(run_dir, [*common, "--rollout.precision=fp32",
                             f"--rollout.router_noise_std={std}",
                             *point_overrides(Point("gspo", 1.0, 4, 1), cal_size, sft)],
                   log, threads=size.threads)
        rows = MetricsTail(os.path.join(run_dir, "metrics.jsonl")).read()
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
        return {"std": std, "disagreement": mean(r.get(DISAGREEMENT) for r in rows),
                "token_disagreement": mean(r.get("routing/rollout/token_change_rate") for r in rows),
                "kl_rollout_vs_train": mean(r.get("kl/rollout_vs_train") for r in rows)}

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        rows = list(pool.map(one, CALIBRATION_STDS))
    std = interpolate_std([(r["std"], r["disagreement"]) for r in rows], target)
    record = {"target": target, "stds": list(CALIBRATION_STDS), "steps": CALIBRATION_STEPS,
              "rows": rows, "noise_std": std}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return record


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
    point = dataclasses.replace(point, arm=base_arm)
    record = run_point(point, size, out, [*common, *source_overrides(source, std), *extra],
                       start_reward, log)
    return {**record, "source": source, "arm": arm,
            "run_dir": os.path.relpath(point.run_dir(out), root)}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--smoke", action="store_true", help="2 sources x 2 arms, a few steps")
    ap.add_argument("--out", default=None, help="run directories (default runs/mismatch_frontier"
                                                "[_smoke][_cuda])")
    ap.add_argument("--report", default=None, help="report directory (default examples/"
                    "routing_study/results_mismatch for the full CPU size, else OUT/report)")
    ap.add_argument("--sources", default=None, help=f"comma-separated of {','.join(SOURCES)}")
    ap.add_argument("--arms", default=None, help=f"comma-separated of {','.join(ARMS)}")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--lr-factor", type=float, default=3.0,
                    help="multiple of the study's lr 5e-5 (default x3: see the module docstring)")
    ap.add_argument("--updates", type=int, default=4, help="minibatch updates per rollout batch")
    ap.add_argument("--noise-std", type=float, default=None,
                    help="router noise of fp8_noise (3x for fp8_noise_x3); default: calibrated")
    ap.add_argument("--target-disagreement", type=float, default=0.10,
                    help="share of routes differing that the calibrated noise aims at")
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    grid = SMOKE_GRID if args.smoke else dict(sources=tuple(SOURCES), arms=tuple(ARMS))
    args.sources = tuple(args.sources.split(",")) if args.sources else grid["sources"]
    args.arms = tuple(args.arms.split(",")) if args.arms else grid["arms"]
    for what, names, known in (("--sources", args.sources, SOURCES), ("--arms", args.arms, ARMS)):
        bad = [n for n in names if n not in known]
        if bad:
            fail(f"{what}: unknown {bad}; one of {','.join(known)}")
    if args.noise_std is not None and not args.noise_std > 0:
        fail(f"--noise-std: must be > 0, got {args.noise_std}")
    if not 0 < args.target_disagreement < 1:
        fail(f"--target-disagreement: a share in (0, 1), got {args.target_disagreement}")
    if not args.lr_factor > 0:
        fail(f"--lr-factor: must be > 0, got {args.lr_factor}")
    try:
        args.seeds = (1,) if args.smoke else tuple(int(s) for s in args.seeds.split(","))
    except ValueError:
        fail(f"--seeds: comma-separated integers, got {args.seeds!r}")
    size = SIZES[args.device]
    if args.smoke:
        size = dataclasses.replace(size, **{k: v for k, v in SMOKE.items()
                                            if k in ("steps", "sft_steps", "diagnostics_interval")})
    if args.jobs:
        size = dataclasses.replace(size, jobs=args.jobs)
    if args.updates < 1 or size.batch % args.updates:
        fail(f"--updates: {args.updates} does not divide the rollout batch of {size.batch}")
    args.out = args.out or os.path.join(ROOT, "runs", "mismatch_frontier" + (
        "_smoke" if args.smoke else "") + ("_cuda" if args.device == "cuda" else ""))
    if args.report is None:
        full_cpu = not args.smoke and args.device == "cpu"
        args.report = (os.path.join(HERE, "results_mismatch") if full_cpu
                       else os.path.join(args.out, "report"))
    return args, size


def main(argv=None) -> int:
    args, size = parse(argv)
    root = args.out
    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)  # noqa: E731
    common = [a for a in common_overrides(size, "fp32")
              if not a.startswith("--rollout.precision=")]  # each source sets its own
    wall: dict[str, float] = {}
    if not os.path.exists(os.path.join(root, "sft", "sft_weights")):
        log(f"SFT warm-up, {size.sft_steps} steps")
        os.makedirs(os.path.join(root, "sft"), exist_ok=True)
        wall["sft"] = gspo_train(os.path.join(root, "sft"), [
            *common, f"--sft.steps={size.sft_steps}", "--trainer.steps=0",
            "--trainer.seed=1234"], log, threads=size.threads)
    start_reward = measure_start(root, common, size, log)
    calibration = None
    std = args.noise_std
    if std is None and any("{std" in a for s in args.sources for a in SOURCES[s]):
        t0 = time.perf_counter()
        calibration = calibrate_noise(root, common, size, args.target_disagreement, size.jobs, log)
        wall["calibration"] = time.perf_counter() - t0
        std = calibration["noise_std"]
        scales = ", ".join(f"{r['std']:g}: {r['disagreement']:.2%}" for r in calibration["rows"])
        log(f"noise calibrated: std {std:.4g} for {args.target_disagreement:.0%} of routes "
            f"differing ({scales})")
    std = std if std is not None else 0.0
    # Seeds outermost, and within a seed the zero-mismatch reference, then the sources from the
    # largest mismatch down: a study cut short has the extremes of its first seeds.
    order = [s for s in RUN_ORDER if s in args.sources]
    cells = [(s, a, Point(a, args.lr_factor, args.updates, seed))
             for seed in args.seeds for s in order for a in args.arms]
    log(f"{len(cells)} runs ({len(args.sources)} sources x {len(args.arms)} arms x "
        f"{len(args.seeds)} seeds), {size.jobs} at a time; start reward {start_reward:.3f}")

    def write_settings() -> None:
        """The record (also before the runs: a report on a study still running reads it)."""
        with open(os.path.join(root, "mismatch_settings.json"), "w") as f:
            json.dump(settings, f, indent=1)

    settings = {
        "command": " ".join(["PYTHONPATH=. OMP_NUM_THREADS=1 python",
                             os.path.relpath(os.path.abspath(__file__), ROOT),
                             *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device, "smoke": args.smoke, "sources": list(args.sources),
        "arms": list(args.arms), "seeds": list(args.seeds), "lr_factor": args.lr_factor,
        "lr": size.base_lr * args.lr_factor, "updates": args.updates, "steps": size.steps,
        "sft_steps": size.sft_steps, "jobs": size.jobs, "noise_std": std,
        "noise_std_x3": 3 * std, "calibration": calibration,
        "source_overrides": {s: source_overrides(s, std) for s in args.sources},
        "arm_overrides": {a: ARMS[a][1] for a in args.arms},
        "base_arms": {a: ARMS[a][0] for a in args.arms}, "common": common,
        "start_reward": start_reward, "wall_s": wall,
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})",
        "date": utc_now(), "commit": git_commit(("gspo_megatron", "examples")),
    }
    write_settings()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(size.jobs) as pool:
        records = list(pool.map(lambda c: run_cell(*c, size, root, common, std, start_reward,
                                                   log), cells))
    wall["runs"] = round(time.perf_counter() - t0, 1)
    wall["total"] = round(time.perf_counter() - started, 1)
    wall["runs_own_s"] = round(sum(r.get("wall_s", 0) for r in records), 1)
    write_settings()
    from mismatch_report import write_report

    log(f"report: {write_report(root, args.report)}")
    print(json.dumps({"wall_s": round(wall["total"], 1), "runs": len(records),
                      "noise_std": std}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
