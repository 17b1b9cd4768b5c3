"""Every step metric's name and meaning: the one registry ``docs/reference/metrics.md`` is written from.

Metrics are computed where their numbers are (the loss, the reward pool, the routing session, the
stopwatch, ...) and logged by :class:`gspo_megatron.metrics.MetricsLogger`; this module says what
each name means and what it is an average or a total *of*. A name with ``{placeholders}`` stands for
a family (``routing/change_rate/layer_{i}``: one per MoE layer). ``tests/unit/test_docs_reference.py``
fails when a metric name written in the package's source has no entry here, and when the committed
reference differs from what ``python -m gspo_megatron.tools.docs_ref`` writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The namespaces of step metrics (the part before the first ``/``), in the reference's order.
NAMESPACES: tuple[str, ...] = (
    "reward", "response", "loss", "clip", "gate", "ratio", "kl", "mismatch", "entropy", "correction",
    "optim", "moe", "sampling", "rollout", "env", "eval", "routing", "perf", "faults",
)


@dataclass(frozen=True)
class MetricDoc:
    """One metric (or a family of them, with ``{placeholders}``) and what it measures."""

    name: str
    """The key in ``metrics.jsonl``, wandb and TensorBoard."""
    description: str
    """What the number is, and what it is an average or a total of."""
    when: str = "every step"
    """When it is logged (an option that turns it on, a device it needs)."""


_STEP_BATCH = "the step's first rollout batch, the logging rank's groups"

METRICS: tuple[MetricDoc, ...] = (
    # reward/*: advantages.py (group statistics) and rewards/registry.py (the reward pool).
    MetricDoc("reward/mean", f"Mean reward of {_STEP_BATCH}."),
    MetricDoc("reward/std", f"Standard deviation of the rewards of {_STEP_BATCH}."),
    MetricDoc("reward/min", f"Smallest reward of {_STEP_BATCH}."),
    MetricDoc("reward/max", f"Largest reward of {_STEP_BATCH}."),
    MetricDoc("reward/accuracy", f"Share of responses scored correct (at or above the reward's "
              f"correct threshold), {_STEP_BATCH}."),
    MetricDoc("reward/group_std_mean", "Mean over groups of each group's reward standard deviation "
              "(the denominator of the group advantage, paper Eq. 6)."),
    MetricDoc("reward/zero_variance_group_fraction", "Share of groups whose rewards all tie: "
              "their advantages are zero and they add no policy gradient."),
    MetricDoc("reward/zero_variance_groups", "Number of such tied groups."),
    MetricDoc("reward/errors", "Reward calls that raised (each scores 0)."),
    MetricDoc("reward/timeouts", "Reward calls stopped at `reward.timeout_s` (each scores 0; the "
              "worker process is killed and replaced)."),
    MetricDoc("reward/invalid", "Reward calls that returned a non-numeric or non-finite value "
              "(each scores 0)."),
    MetricDoc("reward/hung_threads", "Timed-out reward threads still alive (a thread cannot be "
              "killed; the worker-process pool, `reward.num_workers`, stops a hung call)."),
    MetricDoc("reward/component/{name}", "Mean of one component of a `reward.fns` mix (before "
              "its weight), the step's first rollout batch.", "reward.fns"),
    # response/*: stages.py and the loss.
    MetricDoc("response/num_tokens", "**Total** response tokens the step sampled, over every "
              "data-parallel rank."),
    MetricDoc("response/mean_length", "Mean response length (tokens) of the step's responses, over "
              "every data-parallel rank."),
    MetricDoc("response/max_length", "Longest response of the step, over every data-parallel rank."),
    MetricDoc("response/eos_fraction", "Share of the step's responses that ended with EOS."),
    MetricDoc("response/clip_rate", "Share of the step's responses cut at `rollout.max_new_tokens`."),
    MetricDoc("response/empty_fraction", "Share of sequences with no scored token, mean over the "
              "update microbatches."),
    # loss/*: policy_loss.py, objectives.py.
    MetricDoc("loss/policy", "The policy term of the minibatch loss (sum over its microbatches and "
              "ranks), mean over the step's minibatches."),
    MetricDoc("loss/total", "The minibatch loss with every term (policy + KL), mean over the step's "
              "minibatches."),
    MetricDoc("loss/kl", "The KL-penalty term `kl_coef * k3` of the loss.",
              "with `loss.kl_coef` > 0 and `trainer.reference_model: true`"),
    MetricDoc("loss/sft_nll", "Token-mean negative log-likelihood of the supervised warm-up.",
              "SFT warm-up steps"),
    # clip/*, gate/*: the loss's clip rule (losses/base.py clip_flags, each loss's own metrics).
    MetricDoc("clip/fraction", "Share of the loss's terms whose clipped branch is active (zero "
              "gradient): sequences for GSPO, tokens for GSPO-token / GRPO; mean over microbatches "
              "and minibatches."),
    MetricDoc("clip/fraction_low", "The part of `clip/fraction` clipped below `1 - eps_low`."),
    MetricDoc("clip/fraction_high", "The part of `clip/fraction` clipped above `1 + eps_high`."),
    MetricDoc("clip/token_fraction", "`clip/fraction` weighted by tokens (a clipped sequence counts "
              "each of its tokens)."),
    MetricDoc("clip/fraction_dual", "Share of tokens where GRPO's dual clip (`loss.clip_ratio_c`) "
              "is active.", "`loss.variant: grpo` with the dual clip"),
    MetricDoc("clip/first_minibatch_fraction", "`clip/fraction` of the step's first minibatch, "
              "before any update: nonzero only where the update's forward computes differently "
              "from the old-log-prob pass (0 on CPU; batch-shape-dependent bf16 kernels on GPU)."),
    MetricDoc("gate/weight_mean", "SAPO's soft gate weight, token mean (1 = no down-weighting).",
              "`loss.variant: sapo`"),
    # ratio/*, kl/*, entropy/*: per microbatch, averaged.
    MetricDoc("ratio/mean", "Mean importance ratio (the loss's own: sequence ratio for GSPO), per "
              "microbatch, averaged."),
    MetricDoc("ratio/min", "Smallest importance ratio of the step (min over microbatches)."),
    MetricDoc("ratio/max", "Largest importance ratio of the step (max over microbatches)."),
    MetricDoc("ratio/seq_log_ratio_p05", "5th percentile of GSPO's sequence log-ratio "
              "`(1/|y|) sum_t log pi/pi_old` (paper Eq. 7)."),
    MetricDoc("ratio/seq_log_ratio_p50", "Median of the sequence log-ratio."),
    MetricDoc("ratio/seq_log_ratio_p95", "95th percentile of the sequence log-ratio."),
    MetricDoc("ratio/first_minibatch_max_abs_log", "Largest |log ratio| in the step's first "
              "minibatch, before any update (0 = ratios exactly 1; see "
              "`clip/first_minibatch_fraction`)."),
    MetricDoc("kl/old_k3", "k3 KL `exp(d) - d - 1` between the updated policy and the old policy, "
              "token mean, per microbatch, averaged."),
    MetricDoc("kl/ref_k3", "k3 KL to the reference model, token mean.",
              "`trainer.reference_model: true`"),
    MetricDoc("kl/rollout_vs_train", "k3 KL between the rollout engine's log-probs and the trainer's "
              "old-policy pass on the step's batch: the rollout/training mismatch (below 2e-12 on "
              "CPU in fp32)."),
    MetricDoc("mismatch/tokens_differ", "Response tokens of the step whose rollout and training "
              "(old-policy pass) log-probs differ at all, bitwise: 0 on every step under "
              "`precision.batch_invariant` (zero mismatch); with partial rollouts, over the tokens "
              "the step's own weights sampled."),
    MetricDoc("mismatch/tokens_differ_stale", "The same count over the tokens a partial rollout "
              "sampled by older weights (off-policy by design: counted apart).",
              "`rollout.partial_rollouts`"),
    MetricDoc("entropy/mean", "Token-mean entropy of the policy over the scored tokens."),
    # correction/*: algorithms/rollout_correction.py.
    MetricDoc("correction/weight_mean", "Mean mismatch-correction weight `w = pi_old / pi_rollout` "
              "after truncation / masking.", "with a `rollout_correction:` mode"),
    MetricDoc("correction/weight_min", "Smallest correction weight.", "with a `rollout_correction:` mode"),
    MetricDoc("correction/weight_max", "Largest correction weight.", "with a `rollout_correction:` mode"),
    MetricDoc("correction/truncated_fraction", "Share of tokens whose weight was truncated (TIS).",
              "with a `rollout_correction:` mode"),
    MetricDoc("correction/masked_fraction", "Share of tokens masked out (masked IS / ICE-POP, "
              "rejection).", "with a `rollout_correction:` mode"),
    MetricDoc("correction/seq_truncated_fraction", "Share of sequences with a truncated weight.",
              "sequence-level correction"),
    MetricDoc("correction/seq_masked_fraction", "Share of sequences masked out.",
              "sequence-level correction"),
    # optim/*, moe/*: stages.py, the policy.
    MetricDoc("optim/grad_norm", "Global gradient norm before clipping, mean over the step's "
              "optimiser steps."),
    MetricDoc("optim/grad_norm_max", "Largest gradient norm applied in the step (a one-minibatch "
              "spike the mean hides; NaN: none applied)."),
    MetricDoc("optim/lr", "Learning rate after the step's last optimiser step."),
    MetricDoc("optim/skipped", "Share of the step's optimiser steps skipped (non-finite loss or "
              "gradients)."),
    MetricDoc("moe/aux_loss", "Megatron's MoE load-balancing auxiliary loss, mean over the step's "
              "optimiser steps."),
    # sampling/*: rollouts/sampling.py (dynamic sampling), rollouts/remote.py (staleness).
    MetricDoc("sampling/kept_groups", "Groups with varied rewards kept for the step.",
              "`dynamic_sampling.enabled`"),
    MetricDoc("sampling/filled_groups", "Tied groups used to fill the step at the "
              "`max_extra_batches` bound (zero advantage).", "`dynamic_sampling.enabled`"),
    MetricDoc("sampling/dropped_groups", "Tied groups dropped.", "`dynamic_sampling.enabled`"),
    MetricDoc("sampling/surplus_groups", "Varied groups rolled out beyond `prompts_per_step` and "
              "not used.", "`dynamic_sampling.enabled`"),
    MetricDoc("sampling/extra_rollouts", "Rollout batches beyond the first.",
              "`dynamic_sampling.enabled`"),
    MetricDoc("sampling/rollout_batches", "Rollout batches the step took.",
              "`dynamic_sampling.enabled`"),
    MetricDoc("sampling/staleness", "Steps between the weights that sampled the step's batch and "
              "the weights being trained (`rollout.max_staleness`).",
              "`rollout.placement: separate`"),
    # rollout/*: rollouts/partial.py.
    MetricDoc("rollout/decode_path", "1: decoding ran the multi-step step function "
              "(`rollout.decode_steps_per_sync`); 0: Megatron's forward at every step "
              "(`decode_steps_per_sync: 0`, or a layout / build it does not cover: one WARNING "
              "line at start-up says why).", "the Megatron rollout engine"),
    MetricDoc("rollout/partial_carried_share", "Share of the step's response tokens written by "
              "earlier steps' rollouts.", "`rollout.partial_rollouts`"),
    MetricDoc("rollout/partial_max_age", "Steps since the oldest trained group was drawn.",
              "`rollout.partial_rollouts`"),
    MetricDoc("rollout/partial_max_span", "Most steps' policies that wrote one trained response.",
              "`rollout.partial_rollouts`"),
    MetricDoc("rollout/partial_in_flight", "Groups still in flight after the rollout.",
              "`rollout.partial_rollouts`"),
    MetricDoc("rollout/partial_generated_tokens", "Tokens the rollout decoded (carried and fresh).",
              "`rollout.partial_rollouts`"),
    # rollout/fp8_*: backends/megatron/rollout_numerics.py.
    MetricDoc("rollout/fp8_weight_rel_err", "Relative error of the rollout's FP8 weights, "
              "`||W - Q s|| / ||W||` (Frobenius, over every quantized weight of the rank, against "
              "the live weights), at the step's weight refresh.", "`rollout.precision: fp8`"),
    MetricDoc("rollout/fp8_weight_rel_err/layer_{i}", "The same over decoder layer i's weights.",
              "`rollout.precision: fp8`"),
    MetricDoc("rollout/fp8_expert_requant_rel_err", "Relative error of the experts requantized "
              "with one scale per row for Hopper's FP8 grouped GEMM, against the experts they "
              "requantize (the block-wise FP8 ones), every MoE layer, at the step's first rollout "
              "call.", "`rollout.precision: fp8` where `torch._scaled_grouped_mm` runs (Hopper)"),
    # rollout/kv_fp8_rel_err: backends/megatron/engine/rounds.py (FastDecoder.kv_metrics).
    MetricDoc("rollout/kv_fp8_rel_err", "Relative error of the FP8 KV cache, `||K - Q s|| / ||K||` "
              "(Frobenius, over the keys and values the step's first rollout call prefilled, every "
              "layer, against the compute dtype's values).", "`rollout.kv_cache_dtype: fp8`"),
    # rollout/decode_*: backends/megatron/engine/rounds.py, kernels/graphs.py (the fast decoder).
    MetricDoc("rollout/decode_graphs", "1 while the decoding step replays from CUDA graphs, 0 when "
              "it runs eagerly (graphs off, or a capture raised: one WARNING says why).",
              "`RolloutEngine.decode_metrics()`"),
    MetricDoc("rollout/decode_graph_captures", "CUDA graphs of the decoding step captured so far.",
              "`rollout.decode_cuda_graphs`"),
    # eval/*: trainer.py.
    MetricDoc("eval/accuracy", "Greedy accuracy on the whole held-out set.",
              "every `trainer.eval_interval` steps"),
    MetricDoc("eval/mean@{n}", "Mean accuracy of `n` samples per held-out prompt.",
              "`evaluation.num_samples: n`"),
    MetricDoc("eval/pass@{k}", "Unbiased pass@k over those samples (k = 1, 2, 4, ..., n).",
              "`evaluation.num_samples: n`"),
    # routing/*: routing/stats.py, backends/megatron/routing/ (docs/routing.md).
    MetricDoc("routing/change_rate", "Share of (position, MoE layer) pairs whose top-k expert set "
              "differs between the current policy (free routing) and the old policy.",
              "`routing.diagnostics`, every `routing.diagnostics_interval` steps"),
    MetricDoc("routing/change_rate/layer_{i}", "The same for MoE layer i.", "`routing.diagnostics`"),
    MetricDoc("routing/change_rate/after_update_{j}", "`routing/change_rate` after the j-th "
              "optimiser step of the RL step.", "`routing.diagnostics`"),
    MetricDoc("routing/jaccard", "Mean top-k overlap |old ∩ new| / |old ∪ new|.",
              "`routing.diagnostics`"),
    MetricDoc("routing/jaccard/layer_{i}", "The same for MoE layer i.", "`routing.diagnostics`"),
    MetricDoc("routing/entropy", "Router entropy (nats) under the current policy.",
              "`routing.diagnostics`"),
    MetricDoc("routing/entropy/layer_{i}", "The same for MoE layer i.", "`routing.diagnostics`"),
    MetricDoc("routing/load_imbalance", "Max / mean expert load per layer, mean over layers.",
              "`routing.diagnostics`"),
    MetricDoc("routing/load_imbalance/layer_{i}", "The same for MoE layer i.", "`routing.diagnostics`"),
    MetricDoc("routing/load/layer_{i}/expert_{e}", "Share of layer i's routed slots on expert e "
              "(logged while layers x experts <= 1024).", "`routing.diagnostics`"),
    MetricDoc("routing/token_change_rate", "Share of positions whose route changed in at least one "
              "MoE layer.", "`routing.diagnostics`"),
    MetricDoc("routing/abs_log_ratio_{side}", "Mean |log pi_theta - log pi_old| (free routing) of "
              "positions whose route changed (`changed`) or not (`unchanged`).",
              "`routing.diagnostics`"),
    MetricDoc("routing/clipfrac_{side}", "Share of those positions where the loss's clipped branch "
              "is active.", "`routing.diagnostics`"),
    MetricDoc("routing/replay_gap_abs_logprob", "Mean |diff| of the batch's log-probs with replayed "
              "vs free routing.", "`routing.diagnostics` with replay"),
    MetricDoc("routing/replay_gap_k3", "k3 `E[exp(d) - d - 1]`, d = logp_replayed - logp_free.",
              "`routing.diagnostics` with replay"),
    MetricDoc("routing/drift/after_{i}_updates", "Share of minibatch i's (position, MoE layer) "
              "routes that differ from the old policy's (i = 0 trains on-policy: 0 up to near-ties)."),
    MetricDoc("routing/drift/change_rate", "Mean of `routing/drift/after_{i}_updates` over i >= 1."),
    MetricDoc("routing/drift/change_rate/layer_{i}", "The same for MoE layer i."),
    MetricDoc("routing/rollout/{stat}", "The `routing/*` statistics between the rollout engine's "
              "routes and the trainer's old-policy pass (change rate, Jaccard, load, alignment with "
              "clipping), per step and per layer.", "`routing.replay: r3` or rollout-route recording"),
    # perf/*: the stopwatch (metrics.Stopwatch) and memory peaks (metrics.MemoryPeaks).
    MetricDoc("perf/step_s", "Seconds of the whole RL step."),
    MetricDoc("perf/gc_s", "Seconds Python's garbage collector ran during the step (every "
              "generation; trainer.gc_freeze keeps set-up's objects out of its scans)."),
    MetricDoc("perf/rollout_s", "Seconds of the rollout (accumulated over dynamic sampling's "
              "batches)."),
    MetricDoc("perf/reward_s", "Seconds of reward scoring."),
    MetricDoc("perf/rollout_wait_s", "Seconds the trainer waited for the rollout ranks' samples.",
              "`rollout.placement: separate`"),
    MetricDoc("perf/balance_s", "Seconds trading samples between data-parallel ranks.",
              "`trainer.balance_data_parallel` with DP > 1"),
    MetricDoc("perf/old_logprobs_s", "Seconds of the old-policy (and reference) log-prob passes."),
    MetricDoc("perf/checkpoint_wait_s", "Seconds waiting for the background checkpoint write to "
              "commit before the first update."),
    MetricDoc("perf/update_s", "Seconds of the minibatch updates."),
    MetricDoc("perf/offloaded_gib", "GiB of training state this rank kept in host memory during "
              "its rollout (`trainer.offload`; absent with `none`)."),
    MetricDoc("perf/checkpoint_s", "Seconds the step spent saving a checkpoint (its state dict and "
              "the writer's fork when asynchronous).", "steps that save"),
    MetricDoc("perf/publish_weights_s", "Seconds publishing the new weights to the rollout ranks.",
              "`rollout.placement: separate`"),
    MetricDoc("perf/routing_diagnostics_s", "Seconds of the routing diagnostics.",
              "diagnosed steps"),
    MetricDoc("perf/rollout_tokens_per_s", "Response tokens decoded per second of rollout."),
    MetricDoc("perf/dp_token_imbalance", "Busiest data-parallel rank's tokens / the mean, after "
              "balancing.", "DP > 1"),
    MetricDoc("perf/dp_token_imbalance_before", "The same before balancing.", "DP > 1"),
    MetricDoc("perf/peak_mem_gib", "This rank's peak CUDA memory allocated in the step (GiB).",
              "CUDA"),
    MetricDoc("perf/rollout_peak_mem_gib", "Its peak in the rollout with reward (`gspo-plan`'s "
              "rollout peak).", "CUDA"),
    MetricDoc("perf/train_peak_mem_gib", "Its peak in the old-log-prob pass and the updates "
              "(`gspo-plan`'s training peak).", "CUDA"),
    # env/*: envs/turns.py (multi-turn episodes, the step's first rollout batch).
    MetricDoc("env/turns", "Mean assistant turns per episode.", "multi_turn.env"),
    MetricDoc("env/tool_calls", "Mean valid tool calls (Qwen3 `<tool_call>` JSON) per episode.",
              "multi_turn.env"),
    MetricDoc("env/policy_tokens", "Mean tokens per episode the policy wrote (those in the loss).",
              "multi_turn.env"),
    MetricDoc("env/env_tokens", "Mean tokens per episode the environment's messages took "
              "(context: no loss).", "multi_turn.env"),
    MetricDoc("env/errors", "Episodes ended by an exception in the environment's `reset` or "
              "`step` (reward 0).", "multi_turn.env"),
    MetricDoc("env/timeouts", "Episodes ended by an environment call past "
              "`multi_turn.timeout_s`, or lost with the worker it stopped (reward 0).",
              "multi_turn.env"),
    MetricDoc("env/bad_answers", "Episodes ended by an unusable answer: not a list of "
              "`{role, content}` messages, content not UTF-8, a non-finite reward (reward 0).",
              "multi_turn.env"),
    MetricDoc("env/reset_failures", "Episodes whose `reset` failed (counted in `env/errors`, "
              "`env/timeouts` or `env/bad_answers` too).", "multi_turn.env"),
    MetricDoc("env/max_turns_cut", "Episodes the environment had not ended after "
              "`multi_turn.max_turns` turns (reward 0).", "multi_turn.env"),
    MetricDoc("env/turn_budget_cut", "Episodes cut at a turn of `multi_turn.max_turn_tokens` "
              "policy tokens (reward 0).", "multi_turn.env"),
    MetricDoc("env/budget_cut", "Episodes cut because the environment's answer would not fit in "
              "`rollout.max_new_tokens` (reward 0).", "multi_turn.env"),
    MetricDoc("env/length", "Episodes cut at `rollout.max_new_tokens` inside a policy turn "
              "(reward 0).", "multi_turn.env"),
    MetricDoc("env/truncated_messages", "Environment messages cut to "
              "`multi_turn.max_message_chars`.", "multi_turn.env"),
    MetricDoc("env/invalid_tool_calls", "Assistant turns with a `<tool_call>` block that is not "
              "valid JSON (the environment answers them; the episode goes on).", "multi_turn.env"),
    # faults/*: stages.py, trainer.py (a step or update skipped for a non-finite value).
    MetricDoc("faults/nonfinite_rewards", "1 when the step was skipped for a non-finite reward.",
              "skipped steps"),
    MetricDoc("faults/nonfinite_advantages", "1 when the step was skipped for non-finite advantages.",
              "skipped steps"),
    MetricDoc("faults/nonfinite_logprobs", "1 when the step was skipped for non-finite old "
              "log-probs.", "skipped steps"),
    MetricDoc("faults/nonfinite_loss", "Minibatches whose loss was non-finite (their optimiser step "
              "is skipped)."),
    MetricDoc("faults/skipped_updates", "Optimiser steps skipped in the step."),
)

_PLACEHOLDER = re.compile(r"\{[^}]*\}")


def _pattern(name: str) -> re.Pattern[str]:
    """A registry name as a regex: each ``{placeholder}`` matches within one path segment, but
    ``{stat}`` any rest of the name (a statistic with its layer suffix)."""
    parts = _PLACEHOLDER.split(name)
    holes = [".+" if h == "{stat}" else "[^/]+" for h in _PLACEHOLDER.findall(name)]
    out = re.escape(parts[0])
    for hole, part in zip(holes, parts[1:]):
        out += hole + re.escape(part)
    return re.compile(out + r"\Z")


def lookup(name: str) -> MetricDoc | None:
    """The entry documenting ``name`` (a logged key, or a source f-string with ``{...}`` fields)."""
    concrete = _PLACEHOLDER.sub("0", name)
    exact = [m for m in METRICS if m.name == name]
    if exact:
        return exact[0]
    return next((m for m in METRICS if _pattern(m.name).match(concrete)), None)
