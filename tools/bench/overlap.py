"""Benchmark: rollouts on their own rank, one step ahead (``rollout.placement: separate``,
``max_staleness: 1``), against the colocated loop, wall time per RL step.

    python -m tools.bench.overlap [--steps 16] [--rounds 3] [--workloads balanced64,trl64]

Runs ``gspo-train`` on ``examples/configs/tiny_gspo.yaml`` twice per workload, side by side at
the same settings (lr, eps, lengths, stopping rule): colocated on one process (one thread), and
separate on two (one trainer rank, one rollout rank, one thread each). Each rank is bound to a
core of its own (``taskset``, rank r on core r, both sides alike): unbound, the scheduler at
times put both busy processes on one core or moved them, and the separate run's rollouts took
0-26% longer than the colocated run's (three runs of ``balanced64``). Each run's trainer logs
``perf/step_s``; the table shows the median over the steady steps (the first two are warm-up:
the rollout rank's first weights, the first stale step). Overlap cannot beat
``max(rollout, training) / (rollout + training)`` of the colocated step (its ``perf/rollout_s +
perf/reward_s`` against the rest), reported as the bound beside the measured ratio.

Workloads: ``demo``: the end-to-end tests' tiny run (4 new tokens: training dominates);
``tokens16``: 16 new tokens per response, EOS ignored (rollout near 60% of the colocated step);
``balanced64``: TRL's 64 new tokens with 6 prompts x 4 and 2 minibatches, so that training is as
long as the rollout (rollout near 45%: the workload of the <= 0.6x target, its share checked to
be within 40-60%; multi-step decoding made rollouts cheaper, and the 16 prompts x 4 this workload
had before put the rollout at 25 %, the bound at 0.75); ``trl64``: 64 new tokens on the tiny
recipe's batch of 4 prompts x 4 (rollout about half). Steps are timed wall clock, between consecutive metrics records.
"""

from __future__ import annotations

import os
import sys
import tempfile

TARGET_RATIO, TARGET_OF_BOUND = 0.6, 1.15
TARGET_WORKLOAD = "balanced64"
"""The workload of the <= 0.6x target: TRL's 64 new tokens with a training side as long as the
rollout (each 40-60 % of the colocated step, checked)."""
BASE = ["--data.num_train_examples=200", "--data.num_eval_examples=4", "--model.seq_length=80",
        "--data.max_prompt_length=8", "--rollout.group_size=4", "--rollout.prompts_per_step=4",
        "--trainer.num_minibatches=2", "--trainer.micro_batch_size=4", "--sft.steps=20",
        "--sft.batch_size=32", "--trainer.eval_interval=0", "--logging.progress=false",
        "--reward.num_workers=0"]
WORKLOADS = {
    "demo": ["--rollout.max_new_tokens=4"],
    "tokens16": ["--rollout.max_new_tokens=16", "--rollout.ignore_eos=true"],
    # Rollout share of the colocated step, one 6-step run each (2-core EPYC, loaded): 16 prompts
    # x 4 with 4 minibatches 0.25, 8 x 4 0.38, 6 x 4 0.43, 4 x 4 (trl64) 0.53.
    "balanced64": ["--rollout.max_new_tokens=64", "--rollout.ignore_eos=true",
                   "--rollout.prompts_per_step=6", "--trainer.num_minibatches=2"],
    "trl64": ["--rollout.max_new_tokens=64", "--rollout.ignore_eos=true"],
}
SEPARATE = ["--rollout.placement=separate", "--rollout.ranks=1", "--rollout.max_staleness=1"]


def _train(args: list[str], nproc: int, run_dir: str) -> list[dict]:
    """One ``gspo-train`` on the tiny recipe on ``nproc`` ranks (:func:`~tools.bench.common.
    run_cli`: ``torch.distributed.run``, one thread each, rank r bound to core r); its metrics
    records."""
    from gspo_megatron.metrics import read_metrics
    from tools.bench import common

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    common.run_cli(["--config", os.path.join(root, "examples", "configs", "tiny_gspo.yaml"),
                    f"--logging.run_dir={run_dir}", *args], nproc, bind_cores=True)
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def _one_round(args: list[str]) -> dict:
    """One colocated and one separate run of ``args``: wall time per step (between consecutive
    metrics records: the step, the weights sent, logging), rollout and training times, medians
    over the steady steps (the first two are warm-up)."""
    from tools.bench.common import median

    with tempfile.TemporaryDirectory() as tmp:
        runs = {"colocated": _train(args, 1, os.path.join(tmp, "colocated")),
                "separate": _train([*args, *SEPARATE], 2, os.path.join(tmp, "separate"))}
    out = {}
    for side, recs in runs.items():
        steady = recs[2:]
        out[side] = {
            "step": median(b["time"] - a["time"] for a, b in zip(recs[:-1], recs[1:])
                           if a["step"] >= 1),
            "rollout": median(m["perf/rollout_s"] + m["perf/reward_s"] for m in steady),
            "training": median(m["perf/old_logprobs_s"] + m["perf/update_s"] for m in steady),
            "wait": median(m.get("perf/rollout_wait_s", 0.0) for m in steady),
            "publish": median(m.get("perf/publish_weights_s", 0.0) for m in steady),
            "kl": median(m["kl/rollout_vs_train"] for m in steady),
        }
    return out


def run(smoke: bool = False, steps: int = 16, rounds: int = 3, workloads: str | None = None
        ) -> dict:
    """``workloads``: comma-separated names of :data:`WORKLOADS` (default all of them)."""
    from tools.bench.common import make_result, median, row

    steps, rounds = (3, 1) if smoke else (steps, rounds)
    names = workloads.split(",") if workloads else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"overlap: --workloads: unknown {unknown}; one of {','.join(WORKLOADS)}",
              file=sys.stderr)
        raise SystemExit(2)
    workloads = ({"demo": [*WORKLOADS["demo"], "--sft.steps=2"]} if smoke
                 else {n: WORKLOADS[n] for n in names})
    # Rounds interleave the workloads and, within each, both sides: a change of machine load
    # shifts a round's colocated and separate runs alike; ratios are medians of per-round ratios.
    measured = {name: [] for name in workloads}
    for _ in range(rounds):
        for name, extra in workloads.items():
            measured[name].append(_one_round([*BASE, *extra, f"--trainer.steps={steps}"]))
    rows, ratios, met = [], {}, True
    for name, rs in measured.items():
        col = {k: median(r["colocated"][k] for r in rs) for k in rs[0]["colocated"]}
        sep = {k: median(r["separate"][k] for r in rs) for k in rs[0]["separate"]}
        share = median(r["colocated"]["rollout"] / r["colocated"]["step"] for r in rs)
        ratio = median(r["separate"]["step"] / r["colocated"]["step"] for r in rs)
        bound = max(share, 1.0 - share)
        ratios[name], ratios[f"{name}_bound"] = ratio, bound
        rows += [
            row(f"{name}: colocated step (1 process)", col["step"], "s"),
            row(f"{name}: colocated rollout + reward share", share, "fraction"),
            row(f"{name}: separate step, staleness 1 (1 trainer + 1 rollout process)",
                sep["step"], "s"),
            row(f"{name}: separate / colocated", ratio, "x"),
            row(f"{name}: bound max(rollout, training) / (rollout + training)", bound, "x"),
            row(f"{name}: separate / bound", ratio / bound, "x"),
            row(f"{name}: trainer idle waiting for rollouts (median)", sep["wait"], "s"),
            row(f"{name}: weights to the rollout rank (median)", sep["publish"], "s"),
            row(f"{name}: rollout + reward, colocated / separate (the other process busy)",
                f"{col['rollout']:.4g} / {sep['rollout']:.4g}", "s"),
            row(f"{name}: old log-probs + updates, colocated / separate (the other process "
                f"busy)", f"{col['training']:.4g} / {sep['training']:.4g}", "s"),
            row(f"{name}: kl/rollout_vs_train colocated / separate (median)",
                f"{col['kl']:.2e} / {sep['kl']:.2e}", ""),
        ]
        if name == TARGET_WORKLOAD:  # the issue's "a workload where rollout and training each
            # take 40-60 %, e.g. TRL's 64 new tokens": <= 0.6x there (a bound near 0.5 gives the
            # overlap 1.2x of slack; at tokens16's 58 % share the bound is 0.58, and <= 0.6x
            # would ask for 1.03x of it: that workload is held to the bound rule below)
            met = met and 0.4 <= share <= 0.6 and ratio <= TARGET_RATIO
        met = met and ratio <= TARGET_OF_BOUND * bound
    return make_result(
        "overlap", "Overlapped RL: rollouts on their own rank one step ahead vs colocated",
        f"separate <= {TARGET_RATIO}x colocated per step on {TARGET_WORKLOAD} (rollout 40-60% of "
        f"the colocated step), within {TARGET_OF_BOUND}x of the overlap bound on every workload",
        None if smoke else met, rows, ratios=ratios,
        config={"steps": steps, "rounds": rounds, "base": BASE, "workloads": workloads,
                "separate": SEPARATE},
        notes=["Per run, medians over the steps after the first two; ratios: medians over "
               "rounds of the round's separate / colocated (each round runs every workload, "
               "colocated then separate); one thread per process, rank r bound to core r."])


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=lambda ap: (
        ap.add_argument("--steps", type=int), ap.add_argument("--rounds", type=int),
        ap.add_argument("--workloads", help=f"comma-separated of {','.join(WORKLOADS)}")))
