"""trainer.offload: the training state really leaves (its storage freed, the bytes in a separate
host buffer) and comes back bitwise into the same tensors; the weights never move; training
after a round trip is bitwise training without one."""

import pytest
import torch

from gspo_megatron.backends.megatron.offload import (grad_buffer_tensors, main_param_tensors,
                                                     optimizer_state_tensors)
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.config import OptimConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from tests.unit.test_update_path import _steps, groups  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)


def _policy(groups, offload):
    return build_policy(model_config_from_preset("tiny"), ParallelConfig(), PrecisionConfig(),
                        OptimConfig(lr=3e-3), groups, total_steps=6, offload=offload)


def _snapshot(tensors):
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("setting", ["optimizer", "optimizer+grads", "all"])
def test_round_trip_frees_the_storage_and_restores_it_bitwise(groups, setting):  # noqa: F811
    policy = _policy(groups, setting)
    _steps(policy, groups, n=2)  # Adam's state exists after a step; the grads are filled
    state, grads = optimizer_state_tensors(policy.optimizer), grad_buffer_tensors(policy.model)
    weights = [p for chunk in policy.model for p in chunk.parameters()]
    main_grads = [p.main_grad for p in weights]
    assert state and grads and not main_param_tensors(policy.optimizer)  # fp32: no main copy
    before = _snapshot(state + grads + weights)
    moved = state + (grads if setting != "optimizer" else [])
    with policy.training_state_offloaded() as nbytes:
        assert all(t.untyped_storage().nbytes() == 0 for t in moved)  # freed, as on a GPU
        assert all(t.data_ptr() == 0 for t in moved)
        assert all(p.untyped_storage().nbytes() > 0 for p in weights)  # the rollout reads them
        if setting == "optimizer":
            assert all(g.untyped_storage().nbytes() > 0 for g in grads)
        expected = sum(t.numel() * t.element_size() for t in moved)
        assert nbytes == expected
    after = state + grads + weights
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    # The views are the same objects over the restored storage: main_grad still lies in the buffer.
    assert all(p.main_grad is g for p, g in zip(weights, main_grads))
    assert policy._grad_buffers is not None


def test_training_after_round_trips_is_training_without(groups):  # noqa: F811
    """Three steps, each after a round trip of everything ``all`` moves, against the same three
    steps without: gradient norms, weights and Adam state bitwise equal."""
    plain, moved = _policy(groups, "none"), _policy(groups, "all")
    plain.copy_weights_to(moved)
    norms = {"plain": [], "moved": []}
    for _ in range(3):
        with plain.training_state_offloaded() as nbytes:
            assert nbytes == 0
        norms["plain"] += _steps(plain, groups, n=1)
        with moved.training_state_offloaded() as nbytes:
            assert nbytes > 0 or not optimizer_state_tensors(moved.optimizer)  # (before step 1)
        norms["moved"] += _steps(moved, groups, n=1)
    assert norms["plain"] == norms["moved"]
    for a, b in zip(optimizer_state_tensors(moved.optimizer) + list(moved.model[0].parameters()),
                    optimizer_state_tensors(plain.optimizer) + list(plain.model[0].parameters())):
        assert torch.equal(a, b)
