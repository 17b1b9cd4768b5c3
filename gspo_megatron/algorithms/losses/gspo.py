"""GSPO: the sequence ratio clipped per sequence (Zheng et al., arXiv 2507.18071).

``s_i = exp((1/|y_i|) sum_t log(pi(y_it) / pi_old(y_it)))`` (Eq. 7), objective
``J_i = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)`` (Eq. 5), whose gradient (Eq. 10)
weights every token of a response equally. Also the GSPO-token form (Eqs. 13-14) that
:mod:`.gspo_token` registers and GSPO uses under token-level correction weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.sections import Problem

from .aggregations import Aggregation
from .base import (LOG_RATIO_CLAMP, LossInputs, LossParams, LossSpec, Surrogate,
                   check_constant_advantages, clip_objective, clip_range_problems,
                   token_aggregate)

__all__ = ["GSPOParams", "LOSS", "SEQUENCE_CLIP_WARN_ABOVE", "token_form"]

SEQUENCE_CLIP_WARN_ABOVE = 1e-2
"""A sequence-ratio eps above this is token-scale (GRPO's 0.2): it warns."""


@dataclass(frozen=True)
class GSPOParams(LossParams):
    """Clip range of the sequence ratio (GSPO and GSPO-token)."""

    clip_low: float = 3e-4
    """``eps_low`` of GSPO (arXiv 2507.18071) Eq. 5 (Eq. 13 for GSPO-token): the sequence ratio's
    lower clip bound is ``1 - clip_low``. Paper Sec. 5.1: 3e-4. In [0, 1)."""

    clip_high: float = 4e-4
    """``eps_high`` of GSPO (arXiv 2507.18071) Eq. 5 / 13: upper bound ``1 + clip_high``. Paper
    Sec. 5.1: 4e-4."""

    def problems(self) -> Iterator[Problem]:
        yield from clip_range_problems(self)

    def warnings(self, variant: str) -> Iterator[str]:
        big = [f"{n}={v}" for n, v in (("clip_low", self.clip_low), ("clip_high", self.clip_high))
               if v > SEQUENCE_CLIP_WARN_ABOVE]
        if big:
            yield (f"PolicyLossConfig(variant={variant!r}) got {', '.join(big)}. The GSPO "
                   "sequence ratio s_i is a length-normalised geometric mean and stays within "
                   "~1e-3 of 1, so its clip range needs ~1e-4-scale eps (paper: 3e-4 / 4e-4). "
                   "Token-level GRPO values like 0.2 effectively disable clipping; several "
                   "GSPO implementations ship 0.2 by mistake.")


def token_form(x: LossInputs, adv_tok: torch.Tensor, p: GSPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    """GSPO-token (Eqs. 13-14) with token advantages ``adv_tok`` ``[B, T]``:
    ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]`` (value ``s_i``, gradient ``s_i grad log pi``),
    per-token ``min(s_it A_it, clip(s_it) A_it)``, then the aggregation."""
    log_s = x.seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_tok = torch.exp(log_s.detach())[:, None] * torch.exp(x.logp - x.logp.detach())
    obj_tok, low, high = clip_objective(ratio_tok, adv_tok, p.clip_low, p.clip_high)  # Eq. 14
    return Surrogate(token_aggregate(x, obj_tok, weights, aggregation), low & x.mask,
                     high & x.mask)


def _surrogate(x: LossInputs, p: GSPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    check_constant_advantages(x, "gspo", "use 'gspo_token' for per-token advantages")
    if weights is not None and weights.dim() == 2:
        # Token weights: the GSPO-token form (Eq. 13) with A_it = A_i, whose value, clip decision
        # and unweighted gradient equal GSPO's (Eq. 5 / 10), so w_it acts per token inside the
        # sequence mean: (1/|y_i|) sum_t w_it min(s_it A_i, clip(s_it) A_i).
        adv_tok = torch.where(x.mask, x.adv_seq[:, None].expand_as(x.adv_tok), x.zero)
        return token_form(x, adv_tok, p, weights, aggregation)
    nonempty = x.seq_len > 0
    s = torch.exp(x.seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # s_i, Eq. 7
    # Eq. 5: J_i = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); its gradient (Eq. 10)
    # is A_i s_i / |y_i| * grad log pi(y_it) for every token: equal weights.
    obj_seq, low_seq, high_seq = clip_objective(s, x.adv_seq, p.clip_low, p.clip_high)
    seq_obj = torch.where(nonempty, obj_seq, x.zero)
    if weights is not None:
        seq_obj = seq_obj * weights  # rollout correction: w_i J_i
    if aggregation.per_sequence == "sum":
        seq_obj = seq_obj * x.seq_len  # LUSPO: |y_i| J_i (each sequence weighted by its length)
    return Surrogate(seq_obj, (low_seq & nonempty)[:, None] & x.mask,
                     (high_seq & nonempty)[:, None] & x.mask)


LOSS = LossSpec(
    name="gspo",
    summary="GSPO (arXiv 2507.18071): the sequence ratio s_i (Eq. 7) clipped per sequence (Eq. 5); "
            "one advantage per sequence",
    params=GSPOParams,
    surrogate=_surrogate,
    aggregations=("seq_mean_token_mean", "seq_mean_token_sum"),
    level="sequence",
    clips=True,
)
