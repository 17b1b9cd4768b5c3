"""CISPO: the clipped importance weight as a constant factor of the policy gradient (MiniMax-M1,
arXiv 2506.13585).

Per token ``sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it log pi(y_it)``, token mean over the
minibatch: every token keeps its gradient ``w A grad log pi``; only the weight ``w`` is capped
(PPO/GRPO's clip instead drops the gradient of the tokens outside the range). The paper leaves the
lower bound off and tunes the upper one.

How the peers spell the bound (all mean the same ``w = clip(r, lo, hi)``):

* verl (``loss_mode=cispo``): ``clip_ratio_low`` / ``clip_ratio_high`` relative, as ours:
  ``lo = 1 - clip_ratio_low``, ``hi = 1 + clip_ratio_high``; its example uses ``clip_ratio_low=10``
  (no lower bound) and ``clip_ratio_high=0.2``. Ours: ``clip_low=10`` (or any value >= 1),
  ``clip_high=0.2``.
* TRL (``loss_type="cispo"``): one absolute cap ``epsilon_high`` (``w = min(r, epsilon_high)``,
  no lower bound; 5.0 recommended, after ScaleRL arXiv 2510.13786). Ours: ``clip_high =
  epsilon_high - 1``, ``clip_low >= 1``.
* NeMo-RL: ``ratio_clip_min`` / ``ratio_clip_max`` relative (1.0 / 5.0 in its recipe).

Our default: no lower bound (``clip_low = 1``: ``lo = 0``, below every ratio) and the cap 5.0 of
TRL's recommendation (``clip_high = 4``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.sections import Problem

from .aggregations import Aggregation, every_aggregation
from .base import (LossInputs, LossParams, LossSpec, Surrogate, clip_range_problems,
                   small_eps_warning, token_aggregate, token_ratio)

__all__ = ["CISPOParams", "LOSS"]


@dataclass(frozen=True)
class CISPOParams(LossParams):
    """CISPO's importance-weight bounds (relative, as verl's)."""

    clip_low: float = 1.0
    """``eps_low`` of CISPO's weight ``sg(clip(r, 1 - eps_low, 1 + eps_high))`` (MiniMax-M1,
    arXiv 2506.13585): lower bound ``1 - clip_low``; any value >= 1 means no lower bound (the
    paper's choice; verl's example 10). >= 0."""

    clip_high: float = 4.0
    """``eps_high`` of CISPO's weight: cap ``1 + clip_high``. Default 4 (cap 5: TRL's
    ``epsilon_high=5.0``, from ScaleRL arXiv 2510.13786); verl's example 0.2. >= 0."""

    def problems(self) -> Iterator[Problem]:
        yield from clip_range_problems(self, low_below_one=False)

    def warnings(self, variant: str) -> Iterator[str]:
        if self.clip_low < 1:
            yield (f"PolicyLossConfig(variant={variant!r}) got clip_low={self.clip_low}: a lower "
                   f"bound {1 - self.clip_low:g} on CISPO's importance weight. MiniMax-M1 leaves "
                   "it off (verl clip_ratio_low=10, TRL none): clip_low >= 1, e.g. the default 1.0. "
                   "A GRPO-scale 0.2 here is probably carried over from another variant.")
        yield from small_eps_warning(variant, self, ("clip_high",),
                                     "CISPO caps the weight at 1 + clip_high: TRL 5.0, verl 1.2")


def _surrogate(x: LossInputs, p: CISPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    ratio = token_ratio(x)
    w = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high).detach()  # sg(clip(r))
    obj_tok = w * x.adv_tok * x.logp  # sg(w) A log pi: gradient w A grad log pi
    # The weight is capped whatever the advantage's sign (verl counts the same tokens).
    low = (ratio < 1.0 - p.clip_low).detach()
    high = (ratio > 1.0 + p.clip_high).detach()
    return Surrogate(token_aggregate(x, obj_tok, weights, aggregation), low & x.mask,
                     high & x.mask)


LOSS = LossSpec(
    name="cispo",
    summary="CISPO (MiniMax-M1 arXiv 2506.13585): sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi, "
            "every token keeps its gradient, token mean",
    params=CISPOParams,
    surrogate=_surrogate,
    aggregations=every_aggregation("token_mean"),
    level="token",
    clips=True,
)
