"""Reward functions: registry, robust batch scoring, and built-in verifiable rewards."""

from gspo_megatron.rewards.registry import (
    CORRECT_THRESHOLD,
    RewardFn,
    compute_rewards,
    get_reward_fn,
    is_correct,
    list_rewards,
    register_reward,
)
from gspo_megatron.rewards.math import (  # noqa: E402  (registers the built-ins)
    arithmetic_exact,
    extract_boxed,
    extract_final_answer,
    extract_hash_answer,
    format_boxed,
    math_exact,
    math_verify_reward,
    normalize_answer,
)

__all__ = [
    "CORRECT_THRESHOLD",
    "RewardFn",
    "arithmetic_exact",
    "compute_rewards",
    "extract_boxed",
    "extract_final_answer",
    "extract_hash_answer",
    "format_boxed",
    "get_reward_fn",
    "is_correct",
    "list_rewards",
    "math_exact",
    "math_verify_reward",
    "normalize_answer",
    "register_reward",
]
