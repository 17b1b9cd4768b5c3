"""GMPO (``geo_mean``): the geometric mean of the clipped token ratios (Geometric-Mean Policy
Optimization, Zhao et al., arXiv 2507.20673; verl ``loss_mode=geo_mean``).

Per sequence ``J_i = A_i exp((1/|y_i|) sum_t sgn(A_i) min(sgn(A_i) d_it, sgn(A_i) clip(d_it,
-eps_low, eps_high)))`` with ``d_it = log r_it``: each token's log-ratio is clipped in log space,
the pessimistic side chosen by the advantage's sign (as PPO's min does), and the product of the
clipped ratios replaces GRPO's arithmetic mean, so one outlier token cannot dominate a sequence.
Mean over sequences. The paper's range (e^-0.4, e^0.4): ``clip_low = clip_high = 0.4`` (log space;
verl suggests smaller for MoE). One advantage per sequence, as the paper (and verl) take it.

Rollout correction with token weights ``w_it``: the sequence is weighted by their geometric mean
``exp(mean_t log w_it)`` (verl's choice, consistent with the geometric-mean ratio; a token with
``w = 0``, masked, zeroes its sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.sections import Problem

from ..reductions import all_reduce_no_grad, all_reduce_sum
from .aggregations import Aggregation
from .base import (LOG_RATIO_CLAMP, LossInputs, LossParams, LossSpec, Surrogate,
                   check_constant_advantages, clip_range_problems, small_eps_warning)

__all__ = ["GMPOParams", "LOSS"]


@dataclass(frozen=True)
class GMPOParams(LossParams):
    """GMPO's log-space clip range."""

    clip_low: float = 0.4
    """``eps_low`` of GMPO (arXiv 2507.20673): each token's log-ratio is clipped below at
    ``-clip_low`` (ratio ``e^-clip_low``) on the pessimistic side. Paper: 0.4 (verl's example).
    >= 0 (log space: not the ``1 - eps`` of the other losses)."""

    clip_high: float = 0.4
    """``eps_high`` of GMPO (arXiv 2507.20673): log-ratio clipped above at ``clip_high`` (ratio
    ``e^clip_high``). Paper: 0.4. >= 0."""

    def problems(self) -> Iterator[Problem]:
        yield from clip_range_problems(self, low_below_one=False)

    def warnings(self, variant: str) -> Iterator[str]:
        yield from small_eps_warning(variant, self, ("clip_low", "clip_high"),
                                     "GMPO clips each token's log-ratio: paper 0.4 / 0.4")


def _sequence_weights(x: LossInputs, weights: torch.Tensor) -> torch.Tensor:
    """``[B]`` weights: ``w_i`` as given, or the geometric mean of ``w_it`` over each sequence's
    response tokens (over ``cp_group``; 0 if any of them is 0)."""
    if weights.dim() == 1:
        return weights
    positive = x.mask & (weights > 0)
    log_w = torch.where(positive, torch.log(torch.where(positive, weights, x.zero + 1.0)), x.zero)
    sums = all_reduce_no_grad(torch.stack([log_w.sum(-1), (x.mask & ~positive).to(
        x.zero.dtype).sum(-1)]), x.cp_group)
    return torch.where(sums[1] > 0, x.zero, torch.exp(sums[0] * x.inv_len))


def _surrogate(x: LossInputs, p: GMPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    check_constant_advantages(x, "geo_mean", "GMPO takes one advantage per sequence")
    d = x.logp - x.old  # log r_it (padding 0)
    sign = torch.sign(x.adv_tok)
    clipped = d.clamp(-p.clip_low, p.clip_high)
    d_min = sign * torch.minimum(sign * d, sign * clipped)  # pessimistic side by sgn(A)
    log_ratio = all_reduce_sum(torch.where(x.mask, d_min, x.zero).sum(-1), x.cp_group) * x.inv_len
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # geometric mean
    seq_obj = torch.where(x.seq_len > 0, x.adv_seq * ratio, x.zero)
    if weights is not None:
        seq_obj = seq_obj * _sequence_weights(x, weights)
    low = ((x.adv_tok < 0) & (d < -p.clip_low)).detach()
    high = ((x.adv_tok > 0) & (d > p.clip_high)).detach()
    return Surrogate(seq_obj, low & x.mask, high & x.mask)


LOSS = LossSpec(
    name="geo_mean",
    summary="GMPO (arXiv 2507.20673): geometric mean of the token ratios, each clipped in log "
            "space at (e^-0.4, e^0.4); one advantage per sequence",
    params=GMPOParams,
    surrogate=_surrogate,
    aggregations=("seq_mean_token_mean",),
    level="sequence",
    clips=True,
)
