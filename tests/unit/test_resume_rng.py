"""Resume restores every random generator a training step could draw from.

Nothing in training draws from the global generators today (no dropout; sampling, minibatch order
and prompts have seeded generators of their own), so the exact-resume tests, which compare losses,
cannot see whether the checkpoint's RNG states are put back. This test draws from each one (Python's
``random``, numpy, torch, Megatron's model-parallel RNG tracker, which dropout inside tensor-parallel
regions forks) after a save, advances them, loads the checkpoint and draws again."""

import random

import numpy as np
import pytest
import torch

from gspo_megatron.backends.megatron import checkpoint as ckpt
from gspo_megatron.config import OptimConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset


@pytest.fixture(scope="module")
def policy():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy

    model = model_config_from_preset("tiny", num_layers=1, hidden_size=16, num_attention_heads=2,
                                     num_query_groups=1, ffn_hidden_size=32, moe_ffn_hidden_size=16)
    groups = initialize_distributed(ParallelConfig(), model, seed=5)
    yield build_policy(model, ParallelConfig(), PrecisionConfig(), OptimConfig(lr=1e-3), groups,
                       total_steps=1)
    destroy_distributed()


def draws() -> dict:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(3).tolist()
    return {"python": random.random(), "numpy": float(np.random.rand()),
            "torch": torch.rand(3).tolist(), "tracker": tracker}


def test_load_restores_python_numpy_torch_and_megatron_rng(policy, tmp_path):
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(1, {}))
    expected = draws()
    advanced = draws()
    assert all(advanced[k] != expected[k] for k in expected)  # every generator moved on
    ckpt.load_checkpoint(policy, str(tmp_path))
    assert draws() == expected
