"""The policy model: Qwen3-MoE on Megatron-Core."""

from gspo_megatron.model.config import (
    MODEL_PRESETS,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    model_config_from_preset,
)

__all__ = ["MODEL_PRESETS", "ModelConfig", "ParallelConfig", "PrecisionConfig", "model_config_from_preset"]
