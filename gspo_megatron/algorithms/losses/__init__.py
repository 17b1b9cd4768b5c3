"""The policy-loss registry: one module per loss (:mod:`.gspo`, :mod:`.gspo_token`, :mod:`.grpo`,
:mod:`.sapo`, :mod:`.cispo`, :mod:`.gmpo`, :mod:`.gpg`), the table that lists them
(:mod:`.registry`), the aggregations (:mod:`.aggregations`), the ``loss`` config section they
generate (:mod:`.config`) and what they share (:mod:`.base`). The loss function that runs any of
them is :func:`gspo_megatron.algorithms.policy_loss`.
"""

from .aggregations import AGGREGATIONS, Aggregation
from .base import (LOG_RATIO_CLAMP, LossInputs, LossParams, LossSpec, Surrogate, clip_flags, k3,
                   sequence_log_ratio)
from .config import PolicyLossConfig
from .registry import LOSSES, get_loss

__all__ = ["AGGREGATIONS", "Aggregation", "LOG_RATIO_CLAMP", "LOSSES", "LossInputs", "LossParams",
           "LossSpec", "PolicyLossConfig", "Surrogate", "clip_flags", "get_loss", "k3",
           "sequence_log_ratio"]
