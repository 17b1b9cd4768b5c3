"""Random Hugging Face Qwen3-MoE models for conversion tests."""

from __future__ import annotations

import torch


HF_LOGIT_TOL = 3e-6
"""Max |logit difference| allowed between Hugging Face and Megatron (fp32, CPU): about 10x the
worst measured at 3b7e318: 1.8e-7 at TP=1 (test_hf_conversion), 2.4e-7 at TP=2 with sequence
parallel (test_hf_parity_distributed; docs/hf_conversion.md). The tests print what they measure."""


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
