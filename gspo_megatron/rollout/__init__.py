"""Rollouts through Megatron-Core's inference engine (static engine on CPU, dynamic on GPU)."""

from gspo_megatron.rollout.engine import RolloutEngine, RolloutSample

__all__ = ["RolloutEngine", "RolloutSample"]
