"""Benchmark 5: where an RL step's time goes on the tiny recipe (``examples/configs/tiny_gspo.yaml``).

    python -m tools.bench.rl_step [--steps 4]

Runs ``gspo-train`` (``gspo_megatron.cli``: ``build(cfg, prepare(cfg)).fit()``, in this process) on the tiny recipe for a few
steps with a checkpoint after every step, and reads the trainer's own ``perf/*`` timers from
``metrics.jsonl``: rollout, reward, old log-probs (advantages and batch packing included),
the wait for the previous step's background checkpoint (``checkpoint.async_save``), updates
(``num_minibatches`` optimiser steps), checkpoint save (the stall in the saving step). The first step (warm-up: allocator,
KV cache, first checkpoint's directory layout) is reported apart; the table shows the median over
the other steps. Held-out evaluation is cut to 16 prompts (it is not part of a step).
"""

from __future__ import annotations

PARTS = ("perf/rollout_s", "perf/reward_s", "perf/old_logprobs_s", "perf/checkpoint_wait_s",
         "perf/update_s", "perf/checkpoint_s")


def run(smoke: bool = False, steps: int = 4, threads: int = 1) -> dict:
    import os

    import torch

    from gspo_megatron.metrics import read_metrics
    from tools.bench.common import make_result, median, quiet_megatron, row, tiny_trainer

    quiet_megatron()
    torch.set_num_threads(threads)
    overrides = ["checkpoint.save_interval=1", "checkpoint.keep_last=1",
                 "data.num_eval_examples=16", "trainer.eval_interval=0"]
    if smoke:
        steps = 2
        overrides += ["rollout.group_size=2", "rollout.prompts_per_step=2",
                      "rollout.max_new_tokens=2", "trainer.num_minibatches=1",
                      "trainer.micro_batch_size=4", "data.num_train_examples=64",
                      "data.num_eval_examples=2", "sft.steps=2"]
    overrides.append(f"trainer.steps={steps}")
    with tiny_trainer(overrides) as (trainer, run_dir):
        summary = trainer.fit()
        records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    records = [r for r in records if "perf/step_s" in r]
    if not records:
        raise RuntimeError("gspo-train wrote no perf/* metrics")

    def get(r, k):
        return float(r.get(k, r.get("metrics", {}).get(k, 0.0)))

    steady = records[1:] or records
    rows = []
    med = {k: median(get(r, k) for r in steady) for k in PARTS + ("perf/step_s",)}
    total = med["perf/step_s"] + med["perf/checkpoint_s"]
    for k in PARTS:
        rows.append(row(f"{k[5:-2]}", med[k], "s"))
        rows.append(row(f"{k[5:-2]} share", med[k] / total, "fraction"))
    other = median(get(r, "perf/step_s") - sum(get(r, k) for k in PARTS[:-1]) for r in steady)
    rows.append(row("other (advantages, packing, logging)", other, "s"))
    rows.append(row("step incl. checkpoint", total, "s"))
    rows.append(row("rollout tokens/s", median(get(r, "perf/rollout_tokens_per_s")
                                               for r in steady), "tok/s"))
    first = {k[5:]: round(get(records[0], k), 4) for k in PARTS + ("perf/step_s",)}
    return make_result(
        "rl_step", "RL step breakdown, tiny recipe (examples/configs/tiny_gspo.yaml)",
        "breakdown only (no target)", None, rows,
        {"rollout_share": med["perf/rollout_s"] / total,
         "update_share": med["perf/update_s"] / total},
        config={"steps": steps, "threads": threads, "overrides": overrides,
                "first_step": first, "summary": {k: v for k, v in summary.items()
                                                 if isinstance(v, (int, float))}},
        notes=[f"median over steps 2..{len(records)} (step 1 apart: {first}); "
               f"torch threads {threads}"])


def _args(ap) -> None:
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
