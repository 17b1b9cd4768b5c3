"""What a minibatch update minimises, given the policy's log-probs of a batch's labels.

A backend runs the forward (and backward) passes and hands each microbatch's log-probs to an
:class:`Objective`; the objective owns everything algorithmic about the loss: which tokens count,
the normaliser, the non-finite guard. Two are needed: the RL policy-gradient loss
(:class:`PolicyGradientObjective`, any registered loss through :func:`policy_loss`) and the
supervised warm-up's token NLL (:class:`NLLObjective`). Pure torch: the batch is anything with
``response_mask`` / ``old_logprobs`` / ``advantages`` / ``ref_logprobs`` ``[b, T]`` fields, plus
``rollout_logprobs`` under a rollout correction (:class:`gspo_megatron.policy.PolicyBatch`).

Normalisation contract: the backend sums :meth:`Objective.local_count` over data-parallel ranks
and passes the total to every microbatch as ``normalizer``; each microbatch returns its share
``sum over its rows / normalizer``, so the summed gradient equals the whole minibatch's however it
is split into microbatches and ranks.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .losses import AGGREGATIONS, PolicyLossConfig, k3
from .policy_loss import clipped_positions, policy_loss
from .reductions import all_reduce_no_grad
from .rollout_correction import RolloutCorrectionConfig, correction_weights

Corrupt = Callable[[str, torch.Tensor], torch.Tensor]
"""Fault-injection hook ``(point, tensor) -> tensor`` (identity unless a test asks for NaNs)."""


class Objective(Protocol):
    temperature: float
    """Logits are divided by it before the softmax (the rollout's sampling temperature)."""
    needs_entropy: bool
    """Whether ``__call__`` wants the token entropies (an extra pass over the vocabulary)."""

    def local_count(self, batch) -> torch.Tensor:
        """This rank's share of the normaliser (float64 scalar), summed over DP by the caller."""

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, mb, normalizer: float,
                 cp_group=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)`` of one microbatch: ``logprobs`` ``[b, T]`` (grad), metrics 0-dim.
        ``cp_group``: under context parallelism each rank holds a share of every row's positions
        (``mb``'s ``[b, T / cp]`` fields); per-sequence sums reduce over this group."""


class PolicyGradientObjective:
    """The policy-gradient loss of ``loss`` (its variant: :mod:`.losses.registry`).

    Normaliser, by the loss's aggregation (:mod:`.losses.aggregations`): sequences, response
    tokens (``token_mean``), or sequences x ``response_budget`` (``seq_mean_token_sum_norm``,
    Dr. GRPO's constant: the rollout's ``max_new_tokens``). Non-finite
    log-probs (diverged weights, a bad kernel) would make the loss NaN: the loss is computed on
    sanitised values (ratio 1) so metrics keep their keys, multiplied by 0 (no gradient), and the
    minibatch is flagged ``faults/nonfinite_loss`` so the caller skips its optimiser step.

    Rollout correction (``correction`` with ``mode != "none"``): the weights ``pi_old /
    pi_rollout`` of :func:`correction_weights` from the microbatch's ``old_logprobs`` and
    ``rollout_logprobs`` multiply the policy term (``[B]`` at ``level: sequence``, ``[B, T]`` at
    ``level: token``; see :func:`policy_loss`), and the ``correction/*`` metrics join the others.
    Where every weight is exactly 1 (``trainer.old_logprobs: rollout``, old == rollout) the loss
    is computed without them: bitwise the uncorrected loss. Two host syncs per microbatch (the
    NaN check of :func:`correction_weights` and this all-ones check)."""

    needs_entropy = True

    def __init__(self, loss: PolicyLossConfig, temperature: float = 1.0,
                 corrupt: Corrupt | None = None, correction: RolloutCorrectionConfig | None = None,
                 response_budget: int | None = None):
        self.loss, self.temperature = loss, temperature
        self.corrupt = corrupt or (lambda point, t: t)
        self.correction = correction if correction is not None and correction.enabled else None
        self.aggregation = AGGREGATIONS[loss.resolved_aggregation]
        if self.aggregation.normalizer == "sequences_x_budget" and not (
                isinstance(response_budget, int) and response_budget > 0):
            raise ValueError(f"loss.aggregation={self.aggregation.name!r} divides by B x the "
                             "response budget: PolicyGradientObjective needs response_budget (the "
                             f"rollout's max_new_tokens), got {response_budget!r}")
        self.response_budget = response_budget

    def _weights(self, mb, cp_group=None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(weights for policy_loss or None, correction/* metrics)`` of one microbatch."""
        if self.correction is None:
            return None, {}
        if mb.rollout_logprobs is None:
            raise ValueError(f"rollout_correction.mode={self.correction.mode!r} needs the rollout "
                             "engine's log-probs (batch.rollout_logprobs), but the batch has none")
        res = correction_weights(mb.old_logprobs, mb.rollout_logprobs, mb.response_mask,
                                 self.correction, cp_group=cp_group)
        weights = res.seq_weights if res.seq_weights is not None else res.weights
        no_op = torch.where(mb.response_mask.bool(), res.weights == 1, True).all()
        if not bool(all_reduce_no_grad(no_op.logical_not().float(), cp_group) > 0):
            weights = None  # a no-op correction (old == rollout): keep the loss bitwise
        return weights, res.metrics

    def clipped_positions(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: where this objective's clipped branch is active (its clip rule:
        :func:`~.policy_loss.clipped_positions` of ``loss``); the routing diagnostics count with
        it."""
        return clipped_positions(logprobs, old_logprobs, advantages, mask, self.loss)

    def local_count(self, batch) -> torch.Tensor:
        if self.aggregation.normalizer == "tokens":
            return batch.response_mask.sum().double()
        rows = float(batch.response_mask.shape[0])
        if self.aggregation.normalizer == "sequences_x_budget":
            rows *= self.response_budget
        return torch.tensor(rows, dtype=torch.float64)

    def __call__(self, logprobs, entropy, mb, normalizer, cp_group=None):
        lp = self.corrupt("nan_loss", logprobs)
        nonfinite = not bool(torch.isfinite(lp[mb.response_mask]).all())
        if nonfinite:
            lp = torch.where(torch.isfinite(lp), lp, mb.old_logprobs.to(lp.dtype))
        weights, correction_metrics = self._weights(mb, cp_group)
        loss, metrics = policy_loss(
            lp, mb.old_logprobs, mb.advantages, mb.response_mask, self.loss,
            ref_logprobs=mb.ref_logprobs,
            entropy=entropy.detach() if entropy is not None else None,
            loss_normalizer=normalizer, cp_group=cp_group, correction_weights=weights)
        metrics.update(correction_metrics)
        if nonfinite:
            loss = loss * 0.0
        # Every metric on the loss's device: the schedule stacks them into one tensor (a CPU
        # scalar beside CUDA ones fails there).
        metrics = {k: (v.detach() if torch.is_tensor(v) else torch.tensor(float(v),
                                                                          device=loss.device))
                   for k, v in metrics.items()}
        metrics["loss/total"] = loss.detach()
        metrics["faults/nonfinite_loss"] = torch.tensor(float(nonfinite), device=loss.device)
        return loss, metrics


class NLLObjective:
    """Supervised warm-up: token-mean negative log-likelihood of the ``response_mask`` tokens
    (prompt tokens are not trained), at temperature 1 whatever the rollout's."""

    needs_entropy = False
    temperature = 1.0

    def local_count(self, batch) -> torch.Tensor:
        return batch.response_mask.sum().double()

    def __call__(self, logprobs, entropy, mb, normalizer, cp_group=None):
        normalizer = max(normalizer, 1.0)  # a token sum: each CP rank adds its own tokens
        loss = -(logprobs * mb.response_mask.to(logprobs.dtype)).sum() / normalizer
        return loss, {"loss/sft_nll": loss.detach()}


def tokens_differ(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor,
                  stale: torch.Tensor | None = None) -> dict[str, float]:
    """``mismatch/tokens_differ``: the response tokens (``mask [B, T]`` bool) whose rollout and
    training log-probs (``[B, T]``) differ at all (bitwise), and ``mismatch/tokens_differ_stale``
    the same count over the tokens of ``stale [B, T]`` (sampled by older weights: a partial
    rollout's carried prefix), which the first excludes."""
    differ = (train_lp != rollout_lp) & mask
    if stale is None:
        return {"mismatch/tokens_differ": float(differ.sum())}
    return {"mismatch/tokens_differ": float((differ & ~stale).sum()),
            "mismatch/tokens_differ_stale": float((differ & stale).sum())}


def stale_mask(samples, response_mask: torch.Tensor) -> torch.Tensor | None:
    """``[B, T]`` bool: the first ``extra["stale_tokens"]`` response tokens of each sample
    (row ``i`` of ``response_mask`` is ``samples[i]``'s), the ones a partial rollout sampled by
    older weights; None when no sample carries the count (no partial rollouts)."""
    counts = [s.extra.get("stale_tokens") for s in samples]
    if all(c is None for c in counts):
        return None
    counts = torch.tensor([c or 0 for c in counts], device=response_mask.device)
    return response_mask & (response_mask.long().cumsum(1) <= counts[:, None])


def rollout_mismatch(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 KL estimate between the rollout engine's and the trainer's log-probs on response tokens,
    ``E[exp(d) - d - 1]`` with ``d = log p_train - log p_rollout`` (0 when they agree), in
    float64. ``[B, T]`` inputs, ``mask`` bool."""
    d = (train_lp.double() - rollout_lp.double())[mask]
    return float(k3(d).mean()) if d.numel() else 0.0
