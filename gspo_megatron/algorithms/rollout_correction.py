"""Rollout/training mismatch correction: importance weights ``w = pi_old / pi_rollout``.

The rollout engine samples with its own kernels, precision and MoE routing, so the log-probs it
reports (``pi_rollout``) differ from the trainer's recomputed old-policy log-probs (``pi_old``):
the clipped surrogate's samples come from ``pi_rollout`` while its ratio is taken against
``pi_old``, an off-policy gap nobody chose. The correction reweights each token's (or
sequence's) contribution by ``w = pi_old / pi_rollout``, bounded so one outlier cannot dominate
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training":
truncated IS, C = 2; Liu, Li et al. 2025, "When Speed Kills Stability", verl's
``algorithm.rollout_correction``; slime's ``--use-tis`` with ``examples/train_infer_mismatch_helper``;
IcePop, Ling team 2025):

* ``truncate`` (TIS):      ``w' = min(w, C)``.
* ``mask`` (MIS / IcePop): ``w' = w`` if ``low <= w <= high`` else 0.
* ``reject`` (verl ``rollout_rs``): ``w' = 1`` if ``low <= w <= high`` else 0 (rejection only).

Levels: ``token`` uses each token's ``w_it = exp(log pi_old(y_it) - log pi_rollout(y_it))``;
``sequence`` uses the length-normalised geometric mean ``w_i = exp((1/|y_i|) sum_t log w_it)``
for every token of sequence ``i`` (verl's and slime's ``geometric`` level, the GSPO Eq. 7 form of
the ratio; their ``sequence`` level, the plain product over tokens, is not offered: its spread
grows with length). Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before
``exp``.

How :func:`~gspo_megatron.algorithms.policy_loss.policy_loss` applies the weights (its
``correction_weights`` argument) is documented there; the KL term is never weighted. Pure torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal, NamedTuple

import torch
import torch.distributed as dist

from ..sections import Problem, Section
from .losses.base import LOG_RATIO_CLAMP, sequence_log_ratio
from .reductions import all_reduce_no_grad

__all__ = ["CorrectionResult", "RolloutCorrectionConfig", "correction_weights"]

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RolloutCorrectionConfig(Section, name="rollout_correction"):
    """Importance weights ``pi_old / pi_rollout`` in the policy loss (the ``rollout_correction:``
    recipe section). Off by default.

    With ``trainer.old_logprobs: rollout`` the old policy *is* the rollout policy: every weight is
    exactly 1 and the correction is a no-op (:class:`PolicyGradientObjective` then computes the
    uncorrected loss, bitwise); it only does something with the trainer's recomputed
    ``old_logprobs``."""

    mode: Literal["none", "truncate", "mask", "reject"] = "none"
    """Default ``"none"`` (no correction). ``"truncate"``: truncated IS, ``w' = min(w, cap)``
    (TIS, Yao et al. 2025; slime ``--use-tis`` ``tis_mode: truncate``; verl ``rollout_is``;
    Megatron-LM ``--rl-importance-sampling-truncation-coef``). ``"mask"``: masked IS, ``w' = w``
    inside the band ``[band_low, band_high]``, 0 outside (slime MIS ``tis_mode: mask``; IcePop;
    NeMo-RL's seq-mask-tis at ``level: sequence``). ``"reject"``: rejection only, ``w' = 1`` inside
    the band, 0 outside (verl ``rollout_rs``). Tokens (or sequences) with weight 0 give no gradient
    but stay in the loss normaliser (see :func:`policy_loss`)."""

    level: Literal["token", "sequence"] = "token"
    """Default ``"token"``: one weight per token, ``w_it = pi_old(y_it) / pi_rollout(y_it)``.
    ``"sequence"``: one weight per response, the length-normalised geometric mean
    ``w_i = exp((1/|y_i|) sum_t log w_it)`` (verl/slime ``geometric``; the same form as GSPO's
    sequence ratio, Eq. 7, which makes it the natural level for ``loss.variant: gspo``). A
    geometric mean stays within ~1e-3 of 1, so it needs a much narrower band than the token
    level (slime suggests ``[0.9999, 1.0001]``); ``cap: 2`` practically never truncates it."""

    cap: float = 2.0
    """Default 2.0: the truncation cap ``C`` of ``truncate`` (TIS paper and verl's
    ``rollout_is_threshold`` use 2), and the default band ``[1/C, C]`` of ``mask``/``reject``.
    Must be > 1 (a cap <= 1 would shrink on-policy tokens, whose weight is 1)."""

    band_low: float | None = None
    """Default None: lower edge of the kept band for ``mask``/``reject``; None = ``1 / band_high``
    (verl's ``rollout_rs_threshold_lower`` default), i.e. ``1 / cap`` when both are unset. Must be
    > 0 and <= 1. Setting it with ``mode: truncate`` is an error (truncation has no lower edge);
    with ``mode: none`` it is ignored."""

    band_high: float | None = None
    """Default None: upper edge of the kept band for ``mask``/``reject``; None = ``cap``. Must be
    >= 1 and > the lower edge. Same rules as ``band_low`` for the other modes."""

    @property
    def enabled(self) -> bool:
        """Whether the loss is corrected at all (``mode != "none"``)."""
        return self.mode != "none"

    def band(self) -> tuple[float, float]:
        """The resolved ``(low, high)`` band of ``mask``/``reject``."""
        high = float(self.cap if self.band_high is None else self.band_high)
        low = 1.0 / high if self.band_low is None else float(self.band_low)
        return low, high

    def _problems(self) -> Iterator[Problem]:
        if not _is_number(self.cap):
            yield self._problem("cap", f"must be a finite number > 1, got {self.cap!r}")
            return
        if not self.cap > 1:
            yield self._problem("cap", f"must be > 1 (the truncation cap C; TIS uses 2), got {self.cap}")
            return
        bad = False
        for name in ("band_low", "band_high"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                yield self._problem(name, f"must be a finite number > 0 or null, got {value!r}")
                bad = True
        if bad:
            return
        if self.mode == "truncate":
            for name in ("band_low", "band_high"):
                if getattr(self, name) is not None:
                    yield self._problem((name, "mode"), (
                        "only applies to rollout_correction.mode 'mask' or 'reject'; truncation "
                        "keeps every weight up to rollout_correction.cap"))
            return
        low, high = self.band()
        # A problem names every field its edges come from (band() fills an unset edge from the
        # other one or from cap) and the mode that selects these checks: the loader then drops it
        # when one of them did not parse and holds its default.
        high_from = ("band_high",) if self.band_high is not None else ("band_high", "cap")
        low_from = ("band_low",) if self.band_low is not None else ("band_low", *high_from)
        if low >= high:
            yield self._problem((*dict.fromkeys(low_from + high_from), "mode"), (
                f"must be < band_high: the band [{low}, {high}] is empty"))
        elif low > 1:
            yield self._problem((*low_from, "mode"),
                                f"must be <= 1 (an on-policy token has weight 1), got {low}")
        elif high < 1:
            yield self._problem((*high_from, "mode"),
                                f"must be >= 1 (an on-policy token has weight 1), got {high}")


class CorrectionResult(NamedTuple):
    """What :func:`correction_weights` returns."""

    weights: torch.Tensor
    """``[B, T]`` detached weights ``w'``; 0 at padding and at masked tokens."""
    seq_weights: torch.Tensor | None
    """``[B]`` detached ``w'_i`` for ``level: sequence`` (0 for empty rows), else None. Pass it
    (rather than ``weights``) to :func:`policy_loss` to weight GSPO's sequence objective directly."""
    metrics: dict[str, torch.Tensor]
    """Detached 0-dim ``correction/*`` statistics (see :func:`correction_weights`)."""


def _bound(w: torch.Tensor, config: RolloutCorrectionConfig
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w', truncated, masked)`` for raw weights ``w`` (any shape): TIS ``min(w, C)``, MIS
    ``w * 1[low <= w <= high]`` or rejection ``1[low <= w <= high]``."""
    none = torch.zeros_like(w, dtype=torch.bool)
    if config.mode == "truncate":
        truncated = w > config.cap
        return w.clamp(max=config.cap), truncated, none
    low, high = config.band()
    kept = (w >= low) & (w <= high)
    inside = w if config.mode == "mask" else torch.ones_like(w)
    return torch.where(kept, inside, torch.zeros_like(w)), none, ~kept


@torch.no_grad()
def correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    cp_group: Any | None = None,
) -> CorrectionResult:
    """Bounded importance weights ``w' `` of ``w = pi_old / pi_rollout`` for the policy loss.

    Args:
        old_logprobs: ``[B, T]`` log pi_old of the labels (the trainer's recompute).
        rollout_logprobs: ``[B, T]`` log pi_rollout the engine reported while sampling.
        response_mask: ``[B, T]`` bool or 0/1, the tokens that enter the loss.
        config: :class:`RolloutCorrectionConfig`; ``mode: none`` gives weight 1 on every response
            token.
        cp_group: context-parallel group (each rank passes its ``T`` shard): the sequence level's
            mean over tokens sums and counts over it (through :func:`sequence_log_ratio`), and so
            do the metrics.

    Returns:
        :class:`CorrectionResult`, computed in ``float32`` or the inputs' wider dtype. ``metrics``
        (0-dim, detached): ``correction/weight_mean`` (over response tokens), ``weight_min``,
        ``weight_max``, ``truncated_fraction`` and ``masked_fraction`` (shares of response tokens
        whose weight was truncated / set to 0), and for ``level: sequence`` also
        ``seq_truncated_fraction`` / ``seq_masked_fraction`` (shares of non-empty responses).
        They are plain statistics of this call's rows (sum / count, summed over ``cp_group`` so
        all CP ranks agree; 1 and 0 when there is no response token); nothing is reduced over
        microbatches or data-parallel ranks: the caller averages them, keeping the extreme of the
        ``*_min`` / ``*_max`` keys, as it does for :func:`policy_loss`'s metrics.

    Raises:
        ValueError: a NaN in either log-prob at a response position (on every CP rank).
    """
    for name, t in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if tuple(t.shape) != tuple(response_mask.shape) or t.dim() != 2:
            raise ValueError(f"{name} shape {tuple(t.shape)} must be [B, T] = response_mask's "
                             f"{tuple(response_mask.shape)}")
    mask = response_mask.bool()
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, rollout_logprobs.dtype),
                                torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    rollout = torch.where(mask, rollout_logprobs.detach().to(dtype), zero)
    # +-inf log-probs clamp to a finite log-ratio; NaN has no weight: raise on every CP rank.
    nan = torch.stack([torch.isnan(old).any(), torch.isnan(rollout).any()]).to(dtype)
    nan = all_reduce_no_grad(nan, cp_group).cpu() > 0
    if bool(nan.any()):
        name = "old_logprobs" if bool(nan[0]) else "rollout_logprobs"
        raise ValueError(f"{name} contains NaN at response (masked-in) positions")

    seq_weights = None
    if config.level == "sequence":
        # log w_i = (1/|y_i|) sum_t (log pi_old - log pi_rollout): the GSPO Eq. 7 form, over cp_group
        log_w = sequence_log_ratio(old, rollout, mask, cp_group=cp_group)  # [B]
        raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if config.enabled:
            w_seq, trunc_seq, masked_seq = _bound(raw, config)
        else:
            w_seq, trunc_seq, masked_seq = torch.ones_like(raw), raw < 0, raw < 0
        # [B] -> [B, T]: every response token of sequence i carries w'_i
        weights = torch.where(mask, w_seq[:, None].expand_as(old), zero)
        truncated = trunc_seq[:, None] & mask
        masked = masked_seq[:, None] & mask
        counts = all_reduce_no_grad(mask.to(dtype).sum(-1), cp_group)  # |y_i|
        seq_weights = torch.where(counts > 0, w_seq, zero)
    else:
        raw = torch.exp((old - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # w_it
        if config.enabled:
            w_tok, truncated, masked = _bound(raw, config)
        else:
            w_tok, truncated, masked = torch.ones_like(raw), raw < 0, raw < 0
        weights = torch.where(mask, w_tok, zero)
        truncated, masked = truncated & mask, masked & mask
    metrics = _metrics(weights, mask, truncated, masked, seq_weights is not None, cp_group)
    return CorrectionResult(weights, seq_weights, metrics)


def _metrics(weights: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor,
             masked: torch.Tensor, per_sequence: bool, cp_group: Any | None) -> dict[str, torch.Tensor]:
    """``correction/*`` statistics of one call (see :func:`correction_weights`)."""
    dtype = weights.dtype
    cols = [mask.to(dtype).sum(-1), weights.sum(-1), truncated.to(dtype).sum(-1),
            masked.to(dtype).sum(-1)]
    sums = all_reduce_no_grad(torch.stack(cols, dim=-1), cp_group)  # [B, 4] per-row over cp_group
    big = torch.finfo(dtype).max
    ext = all_reduce_no_grad(torch.stack([
        torch.where(mask, weights, -big).amax() if mask.numel() else weights.new_tensor(-big),
        torch.where(mask, -weights, -big).amax() if mask.numel() else weights.new_tensor(-big),
    ]), cp_group, op=dist.ReduceOp.MAX)
    lengths = sums[:, 0]
    tokens = lengths.sum()
    any_tokens = tokens > 0
    per_token = sums.sum(0) / tokens.clamp(min=1.0)
    one = torch.ones((), dtype=dtype, device=weights.device)
    m = {
        "correction/weight_mean": torch.where(any_tokens, per_token[1], one),
        "correction/weight_max": torch.where(any_tokens, ext[0], one),
        "correction/weight_min": torch.where(any_tokens, -ext[1], one),
        "correction/truncated_fraction": per_token[2],
        "correction/masked_fraction": per_token[3],
    }
    if per_sequence:
        nonempty = lengths > 0
        n_seq = nonempty.to(dtype).sum().clamp(min=1.0)
        # a sequence-level decision covers all of a row's tokens: row share = (flagged > 0)
        m["correction/seq_truncated_fraction"] = ((sums[:, 2] > 0) & nonempty).to(dtype).sum() / n_seq
        m["correction/seq_masked_fraction"] = ((sums[:, 3] > 0) & nonempty).to(dtype).sum() / n_seq
    return {k: v.detach() for k, v in m.items()}
