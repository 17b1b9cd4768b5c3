"""The run's configuration, validated before any compute.

- :mod:`.schema`: the sections of :class:`TrainConfig` (run, data, rollout, ...), one typed
  dataclass each, a docstring under every field; production defaults.
- :mod:`.model`: the model, its parallel layout and numerics; ``MODEL_PRESETS``.
- :mod:`gspo_megatron.sections`: the `Section` base; each section checks its own fields on
  construction (its `_problems`), the loss, DAPO and rollout-correction sections included.
- :mod:`.loader`: YAML recipes + ``--section.field=value`` overrides (types in :mod:`.coerce`),
  ``--help`` text, saving; ``DEMO_RECIPE``, the CPU demo shipped in ``recipes/``.
- :mod:`.validation`: the checks across sections and against the world size.
"""

from gspo_megatron.sections import FieldError
from gspo_megatron.config.loader import DEMO_RECIPE, load_config, save_config
from gspo_megatron.config.model import MODEL_PRESETS, ModelConfig, ParallelConfig, PrecisionConfig
from gspo_megatron.config.schema import (CheckpointConfig, DataConfig, EvaluationConfig,
                                         LoggingConfig, MultiTurnConfig, OptimConfig,
                                         RewardConfig, RewardModelConfig, RolloutConfig, RoutingConfig, SFTConfig,
                                         TokenizerConfig, TrainConfig, TrainerConfig)
from gspo_megatron.config.validation import (ConfigError, ConfigWarning, logprob_token_budget,
                                             token_budget, validate_config)

__all__ = [
    "DEMO_RECIPE", "MODEL_PRESETS", "CheckpointConfig", "ConfigError", "ConfigWarning",
    "DataConfig", "EvaluationConfig", "FieldError", "LoggingConfig", "ModelConfig", "MultiTurnConfig", "OptimConfig", "ParallelConfig",
    "PrecisionConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "RoutingConfig", "SFTConfig",
    "TokenizerConfig", "TrainConfig", "TrainerConfig", "load_config", "save_config",
    "logprob_token_budget", "token_budget", "validate_config",
]
