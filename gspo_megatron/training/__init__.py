"""The RL training machinery on Megatron-Core."""
