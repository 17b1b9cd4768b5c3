"""Model weights in and out of Megatron ``dist_checkpointing`` (torch_dist): any layout saves, any
layout loads (TP/EP/PP resharding is Megatron's)."""

from __future__ import annotations

import os

import torch


def save_model_weights(gpt_model, directory: str) -> None:
    """Save this rank's shard of ``gpt_model`` (a ``GPTModel``) into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(gpt_model.sharded_state_dict(), directory)


def load_model_weights(gpt_model, directory: str) -> None:
    """Load ``directory`` into ``gpt_model`` whatever layout saved it (collective); strict."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    state = dist_checkpointing.load(gpt_model.sharded_state_dict(), directory)
    gpt_model.load_state_dict(state, strict=True)


@torch.no_grad()
def grads_to_params(gpt_model) -> None:
    """Overwrite every parameter with its reduced gradient (``main_grad`` from Megatron DDP).

    Lets a test save gradients through ``dist_checkpointing`` and compare them across layouts.
    """
    for p in gpt_model.parameters():
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        p.copy_(grad if grad is not None else torch.zeros_like(p))
