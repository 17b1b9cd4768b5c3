"""SAPO: a smooth gate on the token ratio instead of the hard clip (Soft Adaptive Policy
Optimization, Qwen team, arXiv 2511.20347; used for Qwen3-VL).

Per token ``f(r_it) A_it`` with the gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau =
tau_pos`` where ``A_it > 0`` and ``tau_neg`` elsewhere, averaged per sequence then over sequences.
Its gradient is ``f'(r) r A grad log pi`` with ``f'(r) = 4 s (1 - s) = sech^2(tau (r - 1) / 2)``,
``s = sigmoid(tau (r - 1))``: 1 on-policy (the plain policy gradient there), decaying smoothly as
the ratio leaves 1 (faster for the negative side, ``tau_neg > tau_pos``). The value at ``r = 1``
is ``(2 / tau) A``, as in verl's and TRL's code. No hard clip: ``gate/weight_mean`` (the mean of
``f'(r_it)`` over response tokens) says how much of the gradient the gate lets through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.sections import Problem

from .aggregations import Aggregation, every_aggregation
from .base import LossInputs, LossParams, LossSpec, Surrogate, token_aggregate, token_ratio

__all__ = ["LOSS", "SAPOParams"]


@dataclass(frozen=True)
class SAPOParams(LossParams):
    """SAPO's gate temperatures."""

    tau_pos: float = 1.0
    """``tau`` of the gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` (SAPO, arXiv 2511.20347) for
    tokens with ``A > 0``. Paper: 1.0 (verl ``tau_pos``, TRL ``sapo_temperature_pos``). > 0."""

    tau_neg: float = 1.05
    """The gate's ``tau`` (SAPO, arXiv 2511.20347) for tokens with ``A <= 0``; larger decays
    faster (the paper's reason: negative updates spread over many unsampled tokens). Paper: 1.05 (verl ``tau_neg``, TRL
    ``sapo_temperature_neg``). > 0."""

    def problems(self) -> Iterator[Problem]:
        for name in ("tau_pos", "tau_neg"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v)
                                                                            and v > 0):
                yield (name,), f"must be a finite float > 0, got {v!r}"


def _surrogate(x: LossInputs, p: SAPOParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    ratio = token_ratio(x)
    tau = torch.where(x.adv_tok > 0, x.zero + p.tau_pos, x.zero + p.tau_neg)
    sig = torch.sigmoid(tau * (ratio - 1.0))
    obj_tok = sig * (4.0 / tau) * x.adv_tok  # f(r_it) A_it
    none = torch.zeros_like(x.mask)
    weight = (4.0 * sig * (1.0 - sig)).detach()  # f'(r) = sech^2(tau (r - 1) / 2)
    return Surrogate(token_aggregate(x, obj_tok, weights, aggregation), none, none,
                     {"gate/weight_mean": weight})


LOSS = LossSpec(
    name="sapo",
    summary="SAPO (arXiv 2511.20347): per-token soft gate (4/tau) sigmoid(tau (r - 1)) instead of "
            "the clip, tau_pos / tau_neg by the advantage's sign",
    params=SAPOParams,
    surrogate=_surrogate,
    aggregations=every_aggregation("seq_mean_token_mean"),
    level="token",
    clips=False,
)
