"""Pure-torch RL algorithms (no Megatron imports): the policy losses of the registry
(:mod:`.losses`: GSPO, GSPO-token, GRPO, SAPO, CISPO, GMPO, GPG) and what they share.

Each rule is stated once here and used by the loss, the trainer and the routing diagnostics alike:
the sequence ratio (Eq. 7), the clip rule, the k3 estimator, group advantages (Eq. 6), the
rollout/training mismatch weights and the objectives a policy update minimises. Parallel reductions take explicit process groups.
"""

from .advantages import GroupAdvantageResult, group_advantages
from .objectives import NLLObjective, Objective, PolicyGradientObjective, rollout_mismatch
from .losses import (AGGREGATIONS, LOG_RATIO_CLAMP, LOSSES, PolicyLossConfig, clip_flags, k3,
                     sequence_log_ratio)
from .policy_loss import clipped_positions, policy_loss
from .rollout_correction import CorrectionResult, RolloutCorrectionConfig, correction_weights
from .reductions import all_reduce_no_grad, all_reduce_sum, masked_mean, masked_sum

__all__ = [
    "AGGREGATIONS",
    "LOG_RATIO_CLAMP",
    "LOSSES",
    "CorrectionResult",
    "GroupAdvantageResult",
    "NLLObjective",
    "Objective",
    "PolicyGradientObjective",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
    "all_reduce_no_grad",
    "all_reduce_sum",
    "clip_flags",
    "clipped_positions",
    "correction_weights",
    "group_advantages",
    "k3",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "rollout_mismatch",
    "sequence_log_ratio",
]
