"""What every registered policy loss is built from: the shared rules (sequence ratio, clip rule,
k3), the prepared inputs a loss reads, what it returns, and the declaration of a loss.

A loss is one module of this package holding a :class:`LossSpec`: its name, its knobs (a frozen
:class:`LossParams` dataclass whose defaults are the paper's, one docstring per field naming the
paper and equation, and its own validation), the aggregations it accepts, the level its ratio and
clip metrics are reported at, and its surrogate: ``(LossInputs, params, weights, aggregation) ->
Surrogate``. :mod:`.registry` lists the modules; :func:`gspo_megatron.algorithms.policy_loss`
does everything else (input checks, normaliser, KL term, metrics) the same way for every loss.

Shapes: ``B`` sequences, ``T`` token positions (this rank's shard under context parallelism);
per-sequence sums are all-reduced over ``cp_group`` (:mod:`..reductions`), so every CP rank
computes the same loss and gradients flow to its own shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, NamedTuple

import torch

from gspo_megatron.sections import Problem

from ..reductions import all_reduce_no_grad, all_reduce_sum
from .aggregations import Aggregation

__all__ = ["LOG_RATIO_CLAMP", "LossInputs", "LossParams", "LossSpec", "Surrogate",
           "check_constant_advantages", "clip_flags", "clip_objective", "clip_range_problems",
           "k3", "sequence_log_ratio", "small_eps_warning", "token_aggregate",
           "token_ratio"]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios (``log s_i``, ``log r_it``) and the k3 log-differences are clamped
to ``[-20, 20]`` before ``exp``. Beyond that the ratio is ~5e8 (or ~2e-9), far
outside any clip range; the clamp keeps values finite and makes the gradient 0
there (instead of ``0 * inf = NaN`` through an overflowed ``exp``)."""


def k3(log_diff: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator ``exp(d) - d - 1`` with ``d = log q - log p`` clamped to
    ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``: >= 0, 0 iff d = 0, in the input's dtype.
    The one definition (KL penalty, ``kl/*`` metrics, rollout mismatch, replay gap)."""
    d = log_diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def sequence_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cp_group: Any | None = None,
) -> torch.Tensor:
    """GSPO Eq. 7 in log space: ``log s_i = (1/|y_i|) sum_t (logp_it - old_logp_it)``.

    Inputs ``[B, T]``; returns ``[B]`` (0 for zero-length responses), differentiable
    w.r.t. ``logprobs``, sums all-reduced over ``cp_group``. Not clamped. The one
    definition of the sequence ratio: the losses, the metrics and the routing
    diagnostics (through :func:`~..policy_loss.clipped_positions`) all call it.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    diff = torch.where(mask, logprobs - old_logprobs.detach(), zero)
    sums = all_reduce_sum(torch.stack([diff.sum(-1), mask.to(diff.dtype).sum(-1)]), cp_group)
    return sums[0] * (1.0 / sums[1].clamp(min=1.0))


def clip_flags(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` takes the clipped
    branch (zero gradient): ``low = A < 0 and ratio < 1 - eps_low``, ``high = A > 0 and
    ratio > 1 + eps_high``. Any matching shapes; detached bool tensors."""
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    return low.detach(), high.detach()


def clip_objective(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` (GRPO Eq. 2, GSPO Eq. 5 /
    13), and where the clipped branch is active (:func:`clip_flags`)."""
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    obj = torch.minimum(ratio * adv, clipped * adv)
    return (obj, *clip_flags(ratio, adv, eps_low, eps_high))


class LossInputs(NamedTuple):
    """A microbatch in the compute dtype (>= fp32), padding zeroed, with the per-sequence
    quantities (summed over ``cp_group``) every loss may need."""

    logp: torch.Tensor           # [B, T] differentiable
    old: torch.Tensor            # [B, T]
    adv: torch.Tensor            # [B] or [B, T] as given
    adv_tok: torch.Tensor        # [B, T] advantage of each response token
    ref: torch.Tensor | None     # [B, T]
    mask: torch.Tensor           # [B, T] bool
    zero: torch.Tensor           # 0-dim
    seq_len: torch.Tensor        # [B] |y_i| (over cp_group)
    inv_len: torch.Tensor        # [B] 1 / max(|y_i|, 1)
    seq_log_ratio: torch.Tensor  # [B] log s_i (GSPO Eq. 7), differentiable
    adv_seq: torch.Tensor        # [B] A_i (the mean over response tokens for [B, T] input)
    cp_group: Any                # context-parallel group (None: no communication)


class Surrogate(NamedTuple):
    """What a loss returns for one microbatch."""

    seq_obj: torch.Tensor
    """``[B]`` each sequence's objective *after* its aggregation, before the normaliser: the loss
    is ``-seq_obj.sum() / normaliser``."""
    low: torch.Tensor
    """``[B, T]`` bool, detached: response tokens whose low-side (``A < 0``) clipped branch is
    active (the ``clip/fraction_low`` metric; all False for a loss without a hard clip)."""
    high: torch.Tensor
    """``[B, T]`` bool: the high side (``A > 0``, or the capped weights of CISPO)."""
    token_means: dict[str, torch.Tensor] = {}
    """Loss-specific metrics: ``{name: [B, T] detached values}``, each reported as its mean over
    the response tokens (over ``cp_group``), e.g. SAPO's ``gate/weight_mean``."""


@dataclass(frozen=True)
class LossParams:
    """Base of a loss's knobs: a frozen dataclass, every field with the paper's default and a
    docstring naming the paper and equation. In the ``loss`` section each knob is a field whose
    ``null`` means this default (:mod:`.config`)."""

    def problems(self) -> Iterator[Problem]:
        """Invalid values, by field (``(("clip_low",), "must be >= 0, got -1")``)."""
        return iter(())

    def warnings(self, variant: str) -> Iterator[str]:
        """Legal but probably mis-scaled values for ``variant`` (one message each)."""
        return iter(())


SurrogateFn = Callable[[LossInputs, Any, "torch.Tensor | None", Aggregation], Surrogate]
"""``(inputs, params, weights, aggregation) -> Surrogate``. ``weights``: the detached rollout
correction (``[B]`` or ``[B, T]``, padding zeroed, compute dtype) or None; the loss multiplies
each sequence's or token's term by it and leaves the normaliser alone."""


@dataclass(frozen=True)
class LossSpec:
    """One registered policy loss."""

    name: str
    """``loss.variant`` value."""
    summary: str
    """One line: what it is and its paper (shown by ``gspo-train --help``)."""
    params: type
    """Its :class:`LossParams` subclass (the knobs; defaults = the paper's)."""
    surrogate: SurrogateFn
    aggregations: tuple[str, ...]
    """The aggregations (:mod:`.aggregations`) it accepts; the first is its paper's default."""
    level: Literal["token", "sequence"]
    """``ratio/*`` over token ratios ``r_it`` or sequence ratios ``s_i``; ``clip/fraction`` as
    the token share (token) or the mean over sequences of each one's clipped token share."""
    clips: bool
    """Whether it has a hard clip (reports ``clip/*``)."""


def clip_range_problems(params: Any, low_below_one: bool = True) -> Iterator[Problem]:
    """``clip_low`` / ``clip_high`` finite and >= 0; ``clip_low < 1`` unless ``low_below_one`` is
    False (a lower bound ``1 - clip_low <= 0`` is then "no lower bound")."""
    for name in ("clip_low", "clip_high"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            yield (name,), f"must be a finite float or None, got {value!r}"
        elif value < 0:
            yield (name,), f"must be >= 0, got {value}"
        elif name == "clip_low" and low_below_one and value >= 1:
            yield (name,), f"must be < 1 (lower bound 1 - clip_low > 0), got {value}"


TOKEN_CLIP_WARN_BELOW = 1e-2
"""A token-level eps below this is sequence-scale (GSPO's 3e-4): it warns."""


def small_eps_warning(variant: str, params: Any, names: tuple[str, ...], paper: str
                      ) -> Iterator[str]:
    """The warning for token-level clip bounds ``names`` below :data:`TOKEN_CLIP_WARN_BELOW`
    (GSPO's sequence-scale eps given to a token-ratio loss), or nothing."""
    small = [f"{n}={getattr(params, n)}" for n in names
             if getattr(params, n) < TOKEN_CLIP_WARN_BELOW]
    if small:
        yield (f"PolicyLossConfig(variant={variant!r}) got {', '.join(small)}. Token ratios "
               "r_it spread by ~1e-1 after one update, so a ~1e-4-scale eps (GSPO's, for its "
               f"sequence ratio) clips nearly every token ({paper}).")


def token_ratio(x: LossInputs) -> torch.Tensor:
    """``r_it = pi_theta(y_it) / pi_old(y_it)`` (GRPO Eq. 2), ``[B, T]``, log clamped to
    ``LOG_RATIO_CLAMP``; differentiable."""
    return torch.exp((x.logp - x.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def token_aggregate(x: LossInputs, obj_tok: torch.Tensor, weights: torch.Tensor | None,
                    aggregation: Aggregation) -> torch.Tensor:
    """``[B]`` sequence objectives from per-token terms ``obj_tok`` ``[B, T]``: each token's term
    times its correction weight (``w_i`` or ``w_it``), summed over the sequence's response tokens
    (over ``cp_group``), then divided by ``|y_i|`` for a per-sequence token mean."""
    if weights is not None:  # rollout correction: w_it (or w_i) times each token's term
        obj_tok = obj_tok * (weights[:, None] if weights.dim() == 1 else weights)
    obj_sum = all_reduce_sum(torch.where(x.mask, obj_tok, x.zero).sum(-1), x.cp_group)  # [B]
    if aggregation.per_sequence == "sum":
        return obj_sum
    return obj_sum * x.inv_len  # (1/|y_i|) sum_t ...


def check_constant_advantages(x: LossInputs, variant: str, hint: str) -> None:
    """A sequence-level loss needs one advantage per sequence: ``[B, T]`` advantages must be
    constant over each sequence's response tokens (reduced over ``cp_group``, so every CP rank
    raises together instead of one deadlocking the others)."""
    if x.adv.dim() != 2:
        return
    off = x.mask & ~torch.isclose(x.adv_tok, x.adv_seq[:, None].expand_as(x.adv_tok),
                                  rtol=1e-5, atol=1e-6)
    if bool(all_reduce_no_grad(off.sum().to(x.zero.dtype), x.cp_group) > 0):
        raise ValueError("advantages [B, T] must be constant over each sequence's response "
                         f"tokens for variant={variant!r} ({hint})")
