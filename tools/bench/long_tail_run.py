"""Benchmark: the long tail as a training run pays it, heavy-tailed vs uniform responses.

    python -m tools.bench.long_tail_run [--rounds 3] [--steps 9]

:mod:`tools.bench.long_tail` times the engine's call on geometric lengths written with
per-request budgets. This one runs ``gspo-train`` as a recipe does: the tiny model from random
weights (no warm-up), responses that end at the model's own EOS (temperature 1, a 128-token cap:
most end early, a few run long), every phase of the trainer timed by its own ``perf/*`` metrics.

* **heavy-tailed**: the run as configured (:data:`BASE`);
* **partial**: the heavy-tailed run with partial rollouts keeping the cut responses' KV cache
  (``rollout.partial_rollouts``, ``partial_keep_kv``): a rollout stops once ``prompts_per_step``
  groups are complete and the tail goes on in the next step;
* **uniform**: the same run with ``rollout.ignore_eos`` and ``max_new_tokens`` = the heavy-tailed
  run's mean response length: the same real tokens per step, no tail.

The runs rotate (U H P, H P U, P U H, ...), one of each per round; per run, each phase's seconds summed over
the steps after the first (warm-up) over the real response tokens of those steps; the ratio per
round, medians (and range) over rounds.

**The bound** the step costs set: a heavy-tailed batch of ``N`` responses decodes ``L_max`` steps,
the ``t``-th at the batch of the ``n_t`` responses still running; with a step cost linear in the
batch between ``c(1)`` and ``c(N)``, ``sum_t c(n_t) >= L_max c(1) + (c(N) - c(1)) (N L_mean -
L_max) / (N - 1)`` (``sum_t n_t`` is the real tokens), against ``L_mean c(N)`` for the uniform
batch. Step costs: ``--step-cost-1`` / ``--step-cost-full`` (ms; default the tiny model's measured
0.38 / 1.65 ms at batch 1 / 128, ``tools.bench.long_tail`` at ``79c50a6``, 2-core EPYC). On a GPU
the batch-1 step costs about what a full one does, so on-policy the tail costs whole steps there;
partial rollouts (``rollout.partial_rollouts``) and overlap (``rollout.placement: separate``) are
what remove it.
"""

from __future__ import annotations

import math
import os
import tempfile

BASE = ["--model.seq_length=144", "--data.max_prompt_length=8", "--rollout.max_new_tokens=128",
        "--rollout.group_size=8", "--rollout.prompts_per_step=16", "--sft.steps=0",
        "--data.num_train_examples=200", "--data.num_eval_examples=4",
        "--trainer.num_minibatches=4", "--trainer.micro_batch_size=8",
        "--trainer.eval_interval=0", "--logging.progress=false", "--reward.num_workers=0"]
"""The tiny recipe from random weights: 16 prompts x 8 responses, the model's own EOS, a 128-token
cap, the recipe's trainer defaults (packed microbatches, 4 minibatches)."""
PARTIAL = ["--rollout.partial_rollouts=true", "--rollout.partial_keep_kv=true"]
"""The partial-rollout case's overrides on :data:`BASE` (the other partial settings: defaults)."""
PHASES = {"rollout": ("perf/rollout_s",), "training": ("perf/old_logprobs_s", "perf/update_s"),
          "step": ("perf/step_s",)}
"""Each phase's ``perf/*`` seconds."""
STEP_COST_1_MS, STEP_COST_FULL_MS = 0.38, 1.65


def bound(mean_length: float, max_length: float, batch: int, cost_1: float,
          cost_full: float) -> float:
    """Lowest heavy-tailed / uniform rollout cost per real token that a batch of ``batch``
    responses of mean ``mean_length`` and longest ``max_length`` can reach, with a step cost
    linear in the batch from ``cost_1`` (1 request) to ``cost_full`` (``batch``)."""
    real = batch * mean_length
    tail = max_length * cost_1 + (cost_full - cost_1) * (real - max_length) / max(batch - 1, 1)
    return tail / (mean_length * cost_full)


def _run(args: list[str]) -> list[dict]:
    from gspo_megatron.metrics import read_metrics
    from tools.bench import common

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        common.run_cli(["--config", os.path.join(root, "examples", "configs", "tiny_gspo.yaml"),
                        f"--logging.run_dir={tmp}", *args], 1, bind_cores=True)
        return read_metrics(os.path.join(tmp, "metrics.jsonl"))


def _per_token(records: list[dict]) -> dict:
    """Each phase's seconds per real response token over the steps after the first, and the
    lengths of those steps."""
    steady = records[1:] or records
    tokens = sum(m["response/num_tokens"] for m in steady)
    out = {phase: sum(m[k] for m in steady for k in keys) / tokens
           for phase, keys in PHASES.items()}
    # Tokens decoded (perf/rollout_tokens_per_s x perf/rollout_s): under partial rollouts the
    # groups in flight when the run ends are decoded and never trained; per decoded token is the
    # steady state's cost, which a long run pays.
    decoded = sum(m["perf/rollout_tokens_per_s"] * m["perf/rollout_s"] for m in steady)
    out["rollout_per_decoded"] = (sum(m["perf/rollout_s"] for m in steady) / decoded
                                  if decoded else math.nan)  # (a smoke run's one step may not decode)
    out["decoded_vs_trained"] = decoded / tokens if tokens else math.nan
    out.update(mean_length=sum(m["response/mean_length"] for m in steady) / len(steady),
               max_length=max(m["response/max_length"] for m in steady),
               tokens=tokens, eos=sum(m["response/eos_fraction"] for m in steady) / len(steady))
    return out


def run(smoke: bool = False, rounds: int = 3, steps: int = 9,
        step_cost_1: float = STEP_COST_1_MS, step_cost_full: float = STEP_COST_FULL_MS) -> dict:
    from tools.bench.common import make_result, median, row

    steps, rounds = (2, 1) if smoke else (steps, rounds)
    base = [*BASE, f"--trainer.steps={steps}"]
    if smoke:
        base += ["--rollout.max_new_tokens=16", "--model.seq_length=32",
                 "--rollout.prompts_per_step=2", "--trainer.num_minibatches=2"]
    heavy = _per_token(_run(base))  # (also fixes the uniform length: the run is seeded)
    uniform_len = max(1, round(heavy["mean_length"]))
    args = {"heavy": base, "partial": [*base, *PARTIAL],
            "uniform": [*base, "--rollout.ignore_eos=true",
                        f"--rollout.max_new_tokens={uniform_len}"]}
    names = ("uniform", "heavy", "partial")
    per_round = []
    for r in range(rounds):
        got = {"heavy": heavy} if r == 0 else {}
        for name in names[r % 3:] + names[:r % 3]:  # U H P, H P U, P U H, ...
            if name not in got:
                got[name] = _per_token(_run(args[name]))
        per_round.append(got)
    ratios = {f"{case}_{phase}": [g[case][phase] / g["uniform"][phase] for g in per_round]
              for case in ("heavy", "partial") for phase in PHASES}
    ratios["partial_rollout_per_decoded"] = [
        g["partial"]["rollout_per_decoded"] / g["uniform"]["rollout"] for g in per_round]
    decoded = [g["partial"]["decoded_vs_trained"] for g in per_round]
    batch = 2 * 8 if smoke else 16 * 8
    lower = bound(heavy["mean_length"], heavy["max_length"], batch, step_cost_1, step_cost_full)
    rows = [row("heavy-tailed: mean / longest response (tokens), EOS share",
                f"{heavy['mean_length']:.1f} / {heavy['max_length']:.0f}, {heavy['eos']:.2f}"),
            row("uniform: response length (ignore_eos)", uniform_len, "tokens")]
    for key, rs in ratios.items():
        case, phase = key.split("_", 1)
        what = (f"{phase} per real token" if phase in PHASES else
                "rollout per decoded token (the steady state: every decoded token is trained "
                "in a long run)")
        rows.append(row(f"{'heavy-tailed on-policy' if case == 'heavy' else 'partial, kept KV'} "
                        f"/ uniform, {what}, median (min-max) over {rounds} runs",
                        f"{median(rs):.3g} ({min(rs):.3g}-{max(rs):.3g})", "x"))
    rows.append(row("partial, kept KV: tokens decoded / trained over the steps timed (the "
                    "groups still in flight at the end are decoded, never trained)",
                    f"{median(decoded):.3g} ({min(decoded):.3g}-{max(decoded):.3g})", "x"))
    rows.append(row(f"bound from the step costs ({step_cost_1} / {step_cost_full} ms at batch "
                    f"1 / {batch})", lower, "x"))
    rows.append(row("on-policy rollout: measured / bound", median(ratios["heavy_rollout"]) / lower,
                    "x"))
    return make_result(
        "long_tail_run", "The long tail in a training run: heavy-tailed vs uniform responses",
        "on-policy rollout within 1.1x of the step-cost bound; partial rollouts with kept KV "
        "<= 1.3x (per decoded token: the steady state); training passes <= 1.3x",
        None if smoke else (median(ratios["heavy_rollout"]) <= 1.1 * lower
                            and median(ratios["partial_rollout_per_decoded"]) <= 1.3
                            and median(ratios["heavy_training"]) <= 1.3),
        rows, ratios={**{f"{k}_vs_uniform": median(rs) for k, rs in ratios.items()},
                      "rollout_bound": lower},
        config={"base": base, "steps": steps, "rounds": rounds, "uniform_length": uniform_len,
                "step_cost_ms": [step_cost_1, step_cost_full],
                "per_run": {k: [round(v, 4) for v in rs] for k, rs in ratios.items()}},
        notes=["Per run: each phase's perf/* seconds summed over the steps after the first, over "
               "the real response tokens of those steps; ratios per round (the three cases "
               "rotate: U H P, H P U, P U H, ...), medians over rounds. Partial rollouts train "
               "on the groups complete at each step (carried responses included), so their real "
               "tokens per step vary; the sums over steps compare."])


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=lambda ap: (
        ap.add_argument("--steps", type=int), ap.add_argument("--rounds", type=int),
        ap.add_argument("--step-cost-1", dest="step_cost_1", type=float),
        ap.add_argument("--step-cost-full", dest="step_cost_full", type=float)))
