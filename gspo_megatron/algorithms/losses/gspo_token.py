"""GSPO-token: the sequence ratio with per-token advantages (Zheng et al., arXiv 2507.18071,
Eqs. 13-14).

``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``: value ``s_i``, gradient ``s_i grad log pi(y_it)``;
the objective ``(1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it)`` clips per token. With
``A_it = A_i`` it equals GSPO in value, clipping and gradient.
"""

from __future__ import annotations

import torch

from .aggregations import Aggregation
from .base import LossInputs, LossSpec, Surrogate
from .gspo import GSPOParams, token_form

__all__ = ["LOSS"]


def _surrogate(x: LossInputs, p: GSPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    return token_form(x, x.adv_tok, p, weights, aggregation)


LOSS = LossSpec(
    name="gspo_token",
    summary="GSPO-token (arXiv 2507.18071 Eqs. 13-14): the sequence ratio's value with per-token "
            "gradients and advantages, clipped per token",
    params=GSPOParams,
    surrogate=_surrogate,
    aggregations=("seq_mean_token_mean", "seq_mean_token_sum"),
    level="sequence",
    clips=True,
)
