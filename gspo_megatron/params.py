"""Parameter counts of a Qwen3-MoE ``ModelConfig``, computed from the architecture.

Used by the layout planner and checked against the built Megatron model in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.config.model import ModelConfig


@dataclass
class ParameterCount:
    """Parameters of the whole model (``total``) and those one token uses (``active``)."""

    embedding: int
    """Input embedding (padded vocabulary x hidden)."""
    output_layer: int
    """LM head (0 when tied to the embedding)."""
    attention: int
    """All layers' QKV, output projection and QK-norm."""
    norms: int
    """Input / pre-MLP / final RMSNorm weights."""
    dense_mlp: int
    """SwiGLU MLPs of the dense layers."""
    experts: int
    """All routed experts of all MoE layers."""
    routers: int
    """Router weights."""
    active_experts: int
    """Experts one token passes through (top-k per MoE layer)."""

    @property
    def total(self) -> int:
        return (self.embedding + self.output_layer + self.attention + self.norms + self.dense_mlp
                + self.experts + self.routers)

    @property
    def active(self) -> int:
        return self.total - self.experts + self.active_experts


def count_parameters(model: ModelConfig) -> ParameterCount:
    h, d = model.hidden_size, model.head_dim()
    q, kv = model.num_attention_heads, model.num_query_groups
    attention_per_layer = h * (q + 2 * kv) * d + q * d * h + 2 * d  # qkv, proj, q/k norm
    moe_layers = sum(model.layer_is_moe())
    dense_layers = model.num_layers - moe_layers
    expert = 3 * h * model.moe_ffn_hidden_size  # SwiGLU: fc1 (gate + up) and fc2, no bias
    vocab = model.padded_vocab_size()
    return ParameterCount(
        embedding=vocab * h,
        output_layer=vocab * h if model.untie_embeddings_and_output_weights else 0,
        attention=model.num_layers * attention_per_layer,
        norms=(2 * model.num_layers + 1) * h,
        dense_mlp=dense_layers * 3 * h * model.ffn_hidden_size,
        experts=moe_layers * model.num_moe_experts * expert,
        routers=moe_layers * model.num_moe_experts * h,
        active_experts=moe_layers * model.moe_router_topk * expert,
    )
