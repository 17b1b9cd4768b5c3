"""Pure-torch GSPO / GSPO-token / GRPO algorithms (no Megatron imports).

Parallel reductions take explicit ``torch.distributed`` process groups.
"""

from .advantages import GroupAdvantageResult, group_advantages
from .policy_loss import LOG_RATIO_CLAMP, PolicyLossConfig, policy_loss, sequence_log_ratio
from .reductions import all_reduce_no_grad, all_reduce_sum, masked_mean, masked_sum

__all__ = [
    "LOG_RATIO_CLAMP",
    "GroupAdvantageResult",
    "PolicyLossConfig",
    "all_reduce_no_grad",
    "all_reduce_sum",
    "group_advantages",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "sequence_log_ratio",
]
