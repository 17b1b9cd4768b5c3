"""GPG / REINFORCE: ``-A log pi`` with no ratio and no clip (GPG, Chu et al., arXiv 2504.02546;
verl ``loss_mode=gpg``).

Per token ``A_it log pi(y_it)``, token mean over the minibatch (verl's default aggregation):
the plain policy gradient ``A grad log pi``. Nothing corrects for the policy having moved since
the rollout, so updates after the first minibatch of a step are off-policy and uncorrected (use
one minibatch per step, ``trainer.num_minibatches: 1``, for REINFORCE proper). The ``ratio/*``
metrics still say how far it moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregations import Aggregation, every_aggregation
from .base import LossInputs, LossParams, LossSpec, Surrogate, token_aggregate

__all__ = ["GPGParams", "LOSS"]


@dataclass(frozen=True)
class GPGParams(LossParams):
    """GPG reads no knob."""


def _surrogate(x: LossInputs, p: GPGParams, weights: torch.Tensor | None,
               aggregation: Aggregation) -> Surrogate:
    none = torch.zeros_like(x.mask)
    return Surrogate(token_aggregate(x, x.adv_tok * x.logp, weights, aggregation), none, none)


LOSS = LossSpec(
    name="gpg",
    summary="GPG / REINFORCE (arXiv 2504.02546): A log pi per token, no ratio, no clip",
    params=GPGParams,
    surrogate=_surrogate,
    aggregations=every_aggregation("token_mean"),
    level="token",
    clips=False,
)
