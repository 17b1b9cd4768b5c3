"""Rollouts through Megatron-Core's inference engine."""
