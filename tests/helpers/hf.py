"""Random Hugging Face Qwen3-MoE models for conversion tests."""

from __future__ import annotations

import torch


@torch.no_grad()
def sharpen_random_init(model) -> None:
    """Make a freshly initialised ``Qwen3MoeForCausalLM`` exercise what conversion can get wrong:
    norms away from 1 and router weights large enough that routing (top-k, its order) matters.
    The default init leaves norms at exactly 1 and near-uniform router logits."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1 + 0.3 * torch.randn_like(param))
        elif name.endswith("gate.weight"):
            param.normal_(0, 0.5)
