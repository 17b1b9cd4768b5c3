"""Benchmark: what a checkpoint costs the RL step, written inside the step vs in the background.

    python -m tools.bench.checkpoint [--steps 6] [--rounds 2]

Runs ``gspo-train`` in this process on the tiny recipe (``examples/configs/tiny_gspo.yaml``, no
supervised warm-up: the weights do not matter here) with a checkpoint after every step, once with
``checkpoint.async_save=false`` (Megatron's synchronous ``dist_checkpointing.save``: plan, write
the shards in forked writer processes, commit) and once with ``true`` (plan, fork one background
writer, commit before the next step's first update), alternating ``--rounds`` times. From the
trainer's own timers it reports, per save (median over the saves after the first of each run):

* stall: ``perf/checkpoint_s``, the time the step spends in ``save()``;
* wait: ``perf/checkpoint_wait_s``, the time the next step blocks for the commit (0 when sync);
* the RL step with both (``perf/step_s`` + stall), the number a user sees per step.
"""

from __future__ import annotations

MODES = {"sync": "false", "async": "true"}


def _one_run(steps: int, async_save: str, smoke: bool) -> list[dict]:
    import os

    from gspo_megatron.metrics import read_metrics
    from tools.bench.common import tiny_trainer

    overrides = ["sft.steps=0", "checkpoint.save_interval=1", "checkpoint.keep_last=1",
                 f"checkpoint.async_save={async_save}", "data.num_eval_examples=2",
                 "trainer.eval_interval=0", f"trainer.steps={steps}"]
    if smoke:
        overrides += ["rollout.group_size=2", "rollout.prompts_per_step=2",
                      "rollout.max_new_tokens=2", "trainer.num_minibatches=1",
                      "trainer.micro_batch_size=4", "data.num_train_examples=64"]
    with tiny_trainer(overrides) as (trainer, run_dir):
        trainer.fit()
        return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def run(smoke: bool = False, steps: int = 6, rounds: int = 2, threads: int = 1) -> dict:
    import torch

    from tools.bench.common import make_result, median, quiet_megatron, row

    quiet_megatron()
    torch.set_num_threads(threads)
    if smoke:
        steps, rounds = 3, 1
    per_save = {m: {"stall": [], "wait": [], "step": []} for m in MODES}
    for _ in range(rounds):
        for mode, flag in MODES.items():
            records = [r for r in _one_run(steps, flag, smoke) if "perf/step_s" in r]
            # A save's wait is paid by the next step; the first step pays no wait, the first
            # save builds the directory layout: both apart.
            for prev, cur in zip(records[1:], records[2:]):
                per_save[mode]["stall"].append(prev["perf/checkpoint_s"])
                per_save[mode]["wait"].append(cur.get("perf/checkpoint_wait_s", 0.0))
                per_save[mode]["step"].append(cur["perf/step_s"] + cur["perf/checkpoint_s"])
    med = {m: {k: median(v) for k, v in parts.items()} for m, parts in per_save.items()}
    rows = []
    for mode in MODES:
        rows.append(row(f"{mode}: stall in the saving step", med[mode]["stall"], "s"))
        rows.append(row(f"{mode}: wait before the next update", med[mode]["wait"], "s"))
        rows.append(row(f"{mode}: RL step incl. checkpoint", med[mode]["step"], "s"))
    sync_cost = med["sync"]["stall"] + med["sync"]["wait"]
    async_cost = med["async"]["stall"] + med["async"]["wait"]
    rows.append(row("checkpoint time on the critical path, async / sync", async_cost / sync_cost,
                    "ratio"))
    return make_result(
        "checkpoint", "Checkpoint stall per save, synchronous vs background (tiny recipe)",
        "breakdown only (no target)", None, rows,
        {"critical_path_async_over_sync": async_cost / sync_cost,
         "step_async_over_sync": med["async"]["step"] / med["sync"]["step"]},
        config={"steps": steps, "rounds": rounds, "threads": threads,
                "saves_per_mode": len(per_save["sync"]["stall"])},
        notes=[f"median over {len(per_save['sync']['stall'])} saves per mode ({rounds} runs "
               f"each, alternating; the first save of each run apart)"])


def _args(ap) -> None:
    ap.add_argument("--steps", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
