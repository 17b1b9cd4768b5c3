"""GRPO: per-token ratios clipped per token (DeepSeekMath, arXiv 2402.03300; as written in GSPO,
arXiv 2507.18071 Eq. 2), with the optional dual clip for negative advantages.

``r_it = pi(y_it) / pi_old(y_it)``, per-token objective ``min(r_it A_it, clip(r_it, 1 - eps_low,
1 + eps_high) A_it)``; with ``clip_ratio_c = c`` the tokens with ``A_it < 0`` take
``max(that, c A_it)`` (dual-clip PPO, Ye et al., arXiv 1912.09729): a negative-advantage
token whose ratio has grown past ``c`` stops pushing (its gradient is 0) instead of growing
without bound. verl's ``vanilla`` loss applies it always (``clip_ratio_c`` default 3.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.sections import Problem

from .aggregations import Aggregation, every_aggregation
from .base import (LossInputs, LossParams, LossSpec, Surrogate, clip_objective,
                   clip_range_problems, small_eps_warning, token_aggregate, token_ratio)

__all__ = ["GRPOParams", "LOSS"]


@dataclass(frozen=True)
class GRPOParams(LossParams):
    """GRPO's token clip range and dual clip."""

    clip_low: float = 0.2
    """``eps_low`` of GRPO (DeepSeekMath arXiv 2402.03300; GSPO paper Eq. 2): the token ratio's
    lower clip bound is ``1 - clip_low``. GSPO paper (arXiv 2507.18071) Sec. 5.1: 0.2. In [0, 1)."""

    clip_high: float = 0.27
    """``eps_high`` of GRPO (GSPO paper Eq. 2): upper bound ``1 + clip_high``. GSPO paper (arXiv
    2507.18071) Sec. 5.1: 0.27 (DAPO's clip-higher, arXiv 2503.14476: 0.28)."""

    clip_ratio_c: float | None = None
    """Dual clip (dual-clip PPO, Ye et al., arXiv 1912.09729): for ``A_it < 0`` the objective is
    ``max(min(r A, clip(r) A), c A)``, so tokens with ``r_it > c`` get no gradient. Must be > 1;
    verl's ``clip_ratio_c`` is 3.0 and always on (10.0 in its Qwen3-MoE recipes). null: off, as
    in DeepSeekMath's GRPO. Those tokens count in ``clip/fraction_low`` and
    ``clip/fraction_dual``."""

    def problems(self) -> Iterator[Problem]:
        yield from clip_range_problems(self)
        c = self.clip_ratio_c
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not math.isfinite(c) or c <= 1):
            yield ("clip_ratio_c",), f"must be a finite float > 1 or None, got {c!r}"

    def warnings(self, variant: str) -> Iterator[str]:
        yield from small_eps_warning(variant, self, ("clip_low", "clip_high"),
                                     "GSPO paper Sec. 5.1: GRPO 0.2 / 0.27")


def _surrogate(x: LossInputs, p: GRPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    ratio = token_ratio(x)  # r_it, GSPO paper Eq. 2
    obj_tok, low, high = clip_objective(ratio, x.adv_tok, p.clip_low, p.clip_high)
    means = {}
    if p.clip_ratio_c is not None:
        # Dual clip: for A < 0, max(min(r A, clip(r) A), c A); the c A branch is taken exactly
        # where r > c (for r < 1 - eps_low the min is (1 - eps_low) A > c A).
        neg = x.adv_tok < 0
        obj_tok = torch.where(neg, torch.maximum(obj_tok, p.clip_ratio_c * x.adv_tok), obj_tok)
        dual = (neg & (ratio > p.clip_ratio_c)).detach()
        low = low | dual
        means["clip/fraction_dual"] = dual.to(x.zero.dtype)
    return Surrogate(token_aggregate(x, obj_tok, weights, aggregation), low & x.mask,
                     high & x.mask, means)


LOSS = LossSpec(
    name="grpo",
    summary="GRPO (DeepSeekMath arXiv 2402.03300; GSPO paper Eq. 2): per-token ratios clipped "
            "per token; optional dual clip (clip_ratio_c) for negative advantages",
    params=GRPOParams,
    surrogate=_surrogate,
    aggregations=every_aggregation("seq_mean_token_mean"),
    level="token",
    clips=True,
)
