"""The Megatron-Core backend: parallel setup, model build and HF mapping, :class:`MegatronPolicy`,
the rollout engine, routing replay and checkpoints. Nothing outside ``backends/`` imports megatron."""
