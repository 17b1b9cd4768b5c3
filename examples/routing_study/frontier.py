#!/usr/bin/env python
"""The stability frontier, one command: where GSPO, GRPO, GRPO + R2, GRPO + R3 and SAPO break as
the learning rate and the off-policy updates per rollout batch grow (issue 50).

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/frontier.py --jobs 2 # CPU, ~80 min
    PYTHONPATH=. python examples/routing_study/frontier.py --device cuda              # a lent GPU
    PYTHONPATH=. python examples/routing_study/frontier.py --smoke                    # ~2 min

1. one shared supervised warm-up (the routing study's recipe and warm-up, ``<out>/sft``; reused if
   it is there), and its sampled reward measured once (``<out>/start``), the stop rule's start;
2. every arm x learning-rate factor x updates per rollout batch x seed from those weights,
   ``--jobs`` at a time: the rollout batch is split into ``updates`` minibatches (one optimiser
   step each, one microbatch each), so more updates = more, smaller, more off-policy steps on the
   same samples. Rollouts sample in bf16 from the fp32 trainer at every point (what clusters run,
   and the mismatch R3 exists for; ``--rollout-precision fp32`` re-runs the grid without it). A
   watcher reads each run's ``metrics.jsonl`` as it grows and stops the run (SIGTERM: the trainer
   finishes the step and exits) as soon as :class:`frontier_rules.StabilityRule` calls it
   collapsed, so unstable points cost a few steps. A finished point leaves ``verdict.json`` and
   is skipped when the command runs again;
3. ``frontier_report.py`` -> ``--report``: the frontier per arm, the stability map, route change
   vs learning rate, per-layer route-change heatmaps, ``summary.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frontier_rules import StabilityRule  # noqa: E402
from run_study import ROOT, RunFailed, arm_base, gspo_train  # noqa: E402

from gspo_megatron.tools.provenance import git_commit, utc_now  # noqa: E402

ARMS = ("gspo", "grpo", "grpo_r2", "grpo_r3", "sapo")


@dataclass(frozen=True)
class FrontierSize:
    """One size of the study: the grid, the run length and the model (overrides on the routing
    study's recipe, ``examples/configs/routing_study.yaml``)."""

    arms: tuple[str, ...]
    lr_factors: tuple[float, ...]
    """Multiples of ``base_lr`` (the routing study's learning rate)."""
    updates: tuple[int, ...]
    """Minibatch updates (optimiser steps) per rollout batch."""
    seeds: tuple[int, ...]
    steps: int
    """RL steps of a run that does not collapse."""
    sft_steps: int
    jobs: int
    """Runs at a time."""
    threads: int
    """OMP threads per run."""
    batch: int
    """Responses per rollout batch (``prompts_per_step x group_size``): split into ``updates``."""
    diagnostics_interval: int
    """Steps between the diagnostics forwards (|log-ratio| on flipped routes); route drift and
    rollout/trainer disagreement are logged every step for free."""
    base_lr: float = 5e-5
    overrides: tuple[str, ...] = ()


GRID = dict(arms=ARMS, lr_factors=(1.0, 3.0, 5.0, 10.0, 30.0), updates=(4, 8, 16), seeds=(1, 2, 3))
"""x5 beside the issue's x1, x3, x10, x30: on the CPU size every arm is stable at x1 and collapsed
at x10 (first seed), so the frontier lies between x3 and x10."""
SIZES: dict[str, FrontierSize] = {
    # 2 CPU cores, <= 90 min: the routing study's 8 x 32-expert model and warm-up, 30 RL steps.
    "cpu": FrontierSize(**GRID, steps=30, sft_steps=400, jobs=2, threads=1, batch=64,
                        diagnostics_interval=5),
    # A lent GPU, <= 10 min (not run yet): 16 MoE layers of 64 experts top-8, hidden 256, a
    # 10-operand chain (answers ~60 tokens), 128 responses per batch; one seed, 4 and 16 updates,
    # 8 runs sharing the GPU.
    "cuda": FrontierSize(**{**GRID, "lr_factors": (1.0, 3.0, 10.0, 30.0), "updates": (4, 16),
                            "seeds": (1,)}, steps=30, sft_steps=1000,
                         jobs=8, threads=2, batch=128, diagnostics_interval=5, overrides=(
        "--model.num_layers=16", "--model.hidden_size=256", "--model.num_attention_heads=8",
        "--model.num_query_groups=4", "--model.kv_channels=32", "--model.ffn_hidden_size=512",
        "--model.num_moe_experts=64", "--model.moe_router_topk=8", "--model.moe_ffn_hidden_size=64",
        "--model.seq_length=128", "--data.chain_operands=10", "--data.max_prompt_length=24",
        "--rollout.max_new_tokens=80", "--rollout.prompts_per_step=16",
        "--rollout.dynamic_buffer_size_gb=2")),
}
SMOKE = dict(arms=("gspo", "grpo_r2"), lr_factors=(1.0, 30.0), updates=(4,), seeds=(1,), steps=3,
             sft_steps=5, diagnostics_interval=2)
"""``--smoke``: the path at its smallest (stop rule included), any size's model."""
RULE = StabilityRule()


@dataclass(frozen=True)
class Point:
    """One run of the grid."""

    arm: str
    lr_factor: float
    updates: int
    seed: int

    def run_dir(self, out: str) -> str:
        return os.path.join(out, self.arm, f"lr_x{self.lr_factor:g}", f"updates_{self.updates}",
                            f"seed_{self.seed}")


class MetricsTail:
    """The rows of a growing ``metrics.jsonl``, read incrementally (a partial last line waits)."""

    def __init__(self, path: str):
        self.path, self.offset, self.rows = path, 0, []

    def read(self) -> list[dict]:
        if os.path.exists(self.path):
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            self.offset += len(complete.encode())
            self.rows += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return self.rows


def common_overrides(size: FrontierSize, rollout_precision: str = "bf16") -> list[str]:
    """Every run's overrides on the recipe (the warm-up's too): the size's model, the problems
    (``data.seed``), the rollout precision, diagnostics every ``diagnostics_interval`` steps, no
    evaluation between the held-out one before and after, synchronous checkpoints (a stopped
    run writes one and exits at once)."""
    return [*size.overrides, "--data.seed=1234", f"--rollout.precision={rollout_precision}",
            f"--routing.diagnostics_interval={size.diagnostics_interval}",
            "--trainer.eval_interval=0", "--checkpoint.async_save=false"]


def point_overrides(point: Point, size: FrontierSize, sft_weights: str) -> list[str]:
    """The point's overrides on top of the common ones: loss / replay, lr, update schedule."""
    return [*arm_base(point.arm), f"--optim.lr={size.base_lr * point.lr_factor:g}",
            f"--trainer.num_minibatches={point.updates}",
            f"--trainer.micro_batch_size={size.batch // point.updates}",
            f"--trainer.seed={point.seed}", f"--trainer.steps={size.steps}", "--sft.steps=0",
            f"--checkpoint.init_weights={sft_weights}"]


START_SAMPLES = 16
"""Samples per held-out problem (T = 1) that measure the warm-up policy's reward, the rule's start."""


def measure_start(out: str, common: list[str], size: FrontierSize, log) -> float:
    """The warm-up policy's sampled reward (``<out>/start``: no RL step, ``START_SAMPLES`` samples
    of every held-out problem at temperature 1, as the rollouts sample): the stop rule's start."""
    run_dir = os.path.join(out, "start")
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        gspo_train(run_dir, [*common, "--sft.steps=0", "--trainer.steps=0",
                             f"--checkpoint.init_weights={os.path.join(out, 'sft', 'sft_weights')}",
                             f"--evaluation.num_samples={START_SAMPLES}",
                             "--evaluation.temperature=1.0", "--evaluation.top_p=1.0"], log,
                   threads=size.threads)
    return float(json.load(open(path))[f"eval/mean@{START_SAMPLES}_before"])


def run_point(point: Point, size: FrontierSize, out: str, common: list[str], start_reward: float,
              log) -> dict:
    """Run one point with the watcher; its ``verdict.json`` record (exit, online stop, wall).
    A point already run is not run again, unless the watcher stopped it on a rule the current
    one does not share (its metrics up to the stop no longer break it)."""
    run_dir = point.run_dir(out)
    record_path = os.path.join(run_dir, "verdict.json")
    if os.path.exists(record_path):
        record = json.load(open(record_path))
        rows = MetricsTail(os.path.join(run_dir, "metrics.jsonl")).read()
        if not record.get("stopped") or RULE.collapse(rows, start_reward) is not None:
            return record
        log(f"again: {os.path.relpath(run_dir, ROOT)} (stopped on {record['stopped']!r})")
        os.remove(record_path)
    os.makedirs(run_dir, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json"):  # a run cut off before: start it afresh
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    tail = MetricsTail(os.path.join(run_dir, "metrics.jsonl"))

    def stop() -> str | None:
        hit = RULE.collapse(tail.read(), start_reward)
        return None if hit is None else f"{hit[0]} at step {hit[1]}"

    record: dict = {**dataclasses.asdict(point), "stopped": None, "failed": None,
                    "start_reward": start_reward}
    overrides = [*common, *point_overrides(point, size, os.path.join(out, "sft", "sft_weights"))]
    start = time.perf_counter()
    try:
        gspo_train(run_dir, overrides, log, stop=stop, threads=size.threads)
        record["stopped"] = stop()
    except RunFailed as err:
        # The trainer ends a run after trainer.max_consecutive_faults non-finite steps: a collapse
        # by the rule; any other failure is a bug and stops the study.
        rows = MetricsTail(tail.path).read()
        if not any((r.get("faults/skipped_updates") or 0) > 0 for r in rows) \
                and "NonFiniteError" not in str(err):
            raise
        record["failed"] = f"exit {err.returncode}: non-finite"
    record["wall_s"] = round(time.perf_counter() - start, 1)
    # The final checkpoint (~25 MB at the CPU size) is not part of the record: free the disk.
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    return record


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"frontier: {message}", file=sys.stderr)
    raise SystemExit(2)


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        fail(f"{what}: expected comma-separated numbers, got {text!r}")
    if any(v <= 0 for v in values):
        fail(f"{what}: every value must be > 0, got {text!r}")
    return values


def parse(argv) -> tuple[argparse.Namespace, FrontierSize]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                    help="the size to run: cpu (2 cores, ~80 min), cuda (a lent GPU, <= 10 min); "
                         "auto: cuda when a GPU is there")
    ap.add_argument("--smoke", action="store_true", help="the path at its smallest (~2 min on CPU)")
    ap.add_argument("--out", default=None, help="run directories (default runs/routing_frontier[_cuda|_smoke])")
    ap.add_argument("--report", default=None,
                    help="report directory (default examples/routing_study/results_frontier for "
                         "the full CPU size, else OUT/report)")
    ap.add_argument("--arms", default=None, help=f"comma-separated (default {','.join(ARMS)})")
    ap.add_argument("--lr-factors", default=None, help="multiples of the study's lr 5e-5 (default 1,3,5,10,30)")
    ap.add_argument("--updates", default=None, help="minibatch updates per rollout batch (default 4,8,16)")
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--steps", type=int, default=None, help="RL steps of a run that does not collapse")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--rollout-precision", choices=("bf16", "fp32"), default="bf16",
                    help="the rollout engine's precision (the trainer is fp32)")
    args = ap.parse_args(argv)
    device = args.device
    if device != "cpu":
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            fail("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    size = SIZES[device]
    if args.smoke:
        size = dataclasses.replace(size, **SMOKE)
    changes: dict = {}
    if args.arms:
        changes["arms"] = tuple(args.arms.split(","))
        bad = [a for a in changes["arms"] if arm_base(a) is None]
        if bad:
            fail(f"--arms: unknown arm(s) {bad}; an arm is gspo, grpo[_r2|_r3] or a registered loss")
    if args.lr_factors:
        changes["lr_factors"] = tuple(sorted(_floats(args.lr_factors, "--lr-factors")))
    if args.updates:
        changes["updates"] = tuple(sorted(int(v) for v in _floats(args.updates, "--updates")))
    if args.seeds:
        changes["seeds"] = tuple(int(v) for v in _floats(args.seeds, "--seeds"))
    for key in ("steps", "jobs"):
        if getattr(args, key) is not None:
            if getattr(args, key) < 1:
                fail(f"--{key}: must be >= 1, got {getattr(args, key)}")
            changes[key] = getattr(args, key)
    size = dataclasses.replace(size, **changes)
    bad = [n for n in size.updates if size.batch % n]
    if bad:
        fail(f"--updates: {bad} do not divide the rollout batch of {size.batch} responses")
    name = "routing_frontier" + ("" if device == "cpu" else "_cuda") + ("_smoke" if args.smoke else "")
    if args.rollout_precision != "bf16":
        name += f"_{args.rollout_precision}_rollouts"
    args.out = args.out or os.path.join(ROOT, "runs", name)
    if args.report is None:
        args.report = (os.path.join(ROOT, "examples", "routing_study", "results_frontier")
                       if name == "routing_frontier" else os.path.join(args.out, "report"))
    args.device = device
    return args, size


def main(argv=None) -> int:
    args, size = parse(argv)
    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)  # noqa: E731
    common = common_overrides(size, args.rollout_precision)
    sft_dir = os.path.join(args.out, "sft")
    wall: dict[str, float] = {"sft": 0.0}
    if not os.path.exists(os.path.join(sft_dir, "sft_weights")):
        log(f"SFT warm-up, {size.sft_steps} steps")
        os.makedirs(sft_dir, exist_ok=True)
        wall["sft"] = gspo_train(sft_dir, [*common, f"--sft.steps={size.sft_steps}",
                                           "--trainer.steps=0", "--trainer.seed=1234"], log,
                                 threads=size.threads)
    start_reward = measure_start(args.out, common, size, log)
    log(f"start reward (the warm-up policy, {START_SAMPLES} samples a held-out problem): "
        f"{start_reward:.3f}")

    def write_settings() -> None:
        """The record (also before the runs: a report on a study still running reads it)."""
        settings = {
            "title": f"Stability frontier ({args.device}{', smoke' if args.smoke else ''}): "
                     f"{', '.join(size.arms)}; {len(size.seeds)} seeds, up to {size.steps} RL steps",
            "command": " ".join(["PYTHONPATH=. OMP_NUM_THREADS=1 python",
                                 os.path.relpath(os.path.abspath(__file__), ROOT),
                                 *(argv if argv is not None else sys.argv[1:])]),
            "device": args.device, "smoke": args.smoke, "rollout_precision": args.rollout_precision,
            "size": dataclasses.asdict(size), "rule": dataclasses.asdict(RULE), "common": common,
            "start_reward": start_reward,
            "wall_s": {k: round(v, 1) for k, v in wall.items()},
            "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})",
            "date": utc_now(), "commit": git_commit(("gspo_megatron", "examples")),
        }
        with open(os.path.join(args.out, "frontier_settings.json"), "w") as f:
            json.dump(settings, f, indent=1)

    write_settings()
    # Seeds outermost: a study cut short has whole grids for its first seeds. Within a seed the
    # slowest runs (many updates, replay, small lr: they run to the end) start first.
    points = sorted((Point(a, f, n, s) for s in size.seeds for a in size.arms
                     for f in size.lr_factors for n in size.updates),
                    key=lambda p: (size.seeds.index(p.seed), -p.updates, p.lr_factor,
                                   "_r" not in p.arm, p.arm))
    log(f"{len(points)} runs ({len(size.arms)} arms x {len(size.lr_factors)} lr x "
        f"{len(size.updates)} updates x {len(size.seeds)} seeds), {size.jobs} at a time")
    with concurrent.futures.ThreadPoolExecutor(size.jobs) as pool:
        futures = {pool.submit(run_point, p, size, args.out, common, start_reward, log): p
                   for p in points}
        for future in concurrent.futures.as_completed(futures):
            record = future.result()
            wall[os.path.relpath(futures[future].run_dir(args.out), args.out)] = record["wall_s"]
    wall["total"] = time.perf_counter() - started
    write_settings()
    log(f"{wall['total'] / 60:.1f} min; report ...")
    from frontier_report import write_report

    log(f"report: {write_report(args.out, args.report)}")
    with open(os.path.join(args.report, "summary.json")) as f:
        frontier = json.load(f)["frontier"]
    # Last line, one JSON object: what tools/gpu_check records of this stage.
    print(json.dumps({"wall_s": round(wall["total"], 1), "stable_points": {
        arm: fr.get("stable_points") for arm, fr in frontier.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
