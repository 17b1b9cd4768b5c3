"""Typed configs for the policy model and its parallel layout, with Qwen3-MoE presets.

Field names follow Megatron-Core's ``TransformerConfig`` where a field is a Megatron knob
(``num_moe_experts``, ``moe_router_topk``, ``tensor_model_parallel_size`` ...), so a Megatron user
reads them without a glossary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Literal

from gspo_megatron.config.checks import Problem, Section


def moe_layer_pattern(moe_layer_freq: int | list[int], num_layers: int) -> list[int]:
    """0/1 per transformer layer (1 = MoE), Megatron's reading of ``moe_layer_freq``: an int k
    makes every k-th layer MoE starting at layer 0, a list gives the pattern itself."""
    if isinstance(moe_layer_freq, int):
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    return [int(x) for x in moe_layer_freq]


@dataclass
class ModelConfig(Section, name="model"):
    """A Qwen3-MoE-style decoder: RMSNorm, QK-norm, SwiGLU, no bias, RoPE, GQA, top-k MoE.

    The defaults are the ``tiny`` preset (a CPU-sized model trained from scratch): there is no
    sensible default production model, so a real recipe names one (``preset: qwen3-30b-a3b``).
    """

    preset: str = "tiny"
    """Name of the preset these values came from (informational; see ``MODEL_PRESETS``)."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA); Qwen3-30B-A3B uses 4 for 32 query heads."""
    kv_channels: int | None = 16
    """Head dimension. Qwen3 sets it explicitly (128) rather than hidden/heads."""
    ffn_hidden_size: int = 128
    """Width of the SwiGLU MLP in dense (non-MoE) layers."""
    num_moe_experts: int = 4
    """Routed experts per MoE layer."""
    moe_router_topk: int = 2
    """Experts each token is sent to."""
    moe_ffn_hidden_size: int = 64
    """Width of one expert's SwiGLU MLP (HF ``moe_intermediate_size``)."""
    moe_layer_freq: list[int] | int = 1
    """Which layers are MoE: an int k (every k-th layer) or a 0/1 list per layer (0 = dense).
    HF ``decoder_sparse_step`` / ``mlp_only_layers`` map here."""
    moe_router_pre_softmax: bool = False
    """False = softmax over the top-k logits only, i.e. Qwen3's ``norm_topk_prob=True``."""
    moe_aux_loss_coeff: float = 1e-3
    """Load-balancing aux loss weight (Qwen3 ``router_aux_loss_coef``)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Load-balancing loss flavour."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach experts on other EP ranks."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = "fp32"
    """Precision of the router's softmax and top-k (fp32 avoids bf16 routing ties)."""
    vocab_size: int = 128
    """Real vocabulary size (the model pads it to ``padded_vocab_size()``)."""
    seq_length: int = 64
    """Maximum sequence length (prompt + response) the trainer feeds."""
    rotary_base: float = 1_000_000.0
    """RoPE theta (Qwen3: 1e6)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    untie_embeddings_and_output_weights: bool = True
    """Qwen3-MoE unties the input embedding and the LM head."""
    init_method_std: float = 0.02
    """Std of the normal weight init for models trained from scratch."""
    make_vocab_size_divisible_by: int = 128
    """Vocab padding granularity. Unlike Megatron-LM it is not multiplied by TP, so the padded
    vocabulary (and the checkpoint) is the same for every layout; TP must divide it."""

    def layer_is_moe(self) -> list[bool]:
        """Per-layer MoE flag, from ``moe_layer_freq``."""
        return [bool(x) for x in moe_layer_pattern(self.moe_layer_freq, self.num_layers)]

    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def validate(self) -> None:
        """Re-run the checks (after changing a field in place); raises ``FieldError``."""
        self.check()

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(1, "num_layers", "hidden_size", "num_attention_heads",
                                  "num_query_groups", "kv_channels", "ffn_hidden_size",
                                  "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                  "vocab_size", "seq_length", "make_vocab_size_divisible_by")
        yield from self._at_least(0, "moe_aux_loss_coeff", "init_method_std")
        yield from self._positive("rotary_base", "norm_epsilon")
        if self.num_query_groups >= 1 and self.num_attention_heads % self.num_query_groups:
            yield self._problem(("num_query_groups", "num_attention_heads"), (
                f"must divide model.num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_query_groups}"))
        if self.moe_router_topk > self.num_moe_experts:
            yield self._problem(("moe_router_topk", "num_moe_experts"), (
                f"must be <= model.num_moe_experts ({self.num_moe_experts}), "
                f"got {self.moe_router_topk}"))
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            if len(freq) != self.num_layers:
                yield self._problem(("moe_layer_freq", "num_layers"), (
                    f"must have one entry per layer (model.num_layers = {self.num_layers}), "
                    f"got {len(freq)}"))
            if any(x not in (0, 1) for x in freq):
                yield self._problem("moe_layer_freq", f"entries must be 0 or 1, got {freq}")
        elif freq < 1:
            yield self._problem("moe_layer_freq", f"must be >= 1, got {freq}")


@dataclass
class ParallelConfig(Section, name="parallel"):
    """How the model is split. Data parallel is whatever is left of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: attention heads and MLP columns split across ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: layers split into stages (1F1B schedule)."""
    expert_model_parallel_size: int = 1
    """EP: experts split across ranks."""
    expert_tensor_parallel_size: int | None = None
    """ETP: TP inside each expert; None = same as TP (Megatron's default)."""
    context_parallel_size: int = 1
    """CP: the sequence dimension split across ranks (ring attention)."""
    sequence_parallel: bool = True
    """Shard activations along the sequence in TP regions; Megatron requires it for MoE with TP>1."""

    def validate(self, world_size: int, model: ModelConfig) -> int:
        """Check the layout against the world size and the model; return the data-parallel size.

        Raises ``ValueError`` naming the field before any process group or weight exists.
        """
        self.check()
        model.check()
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size or tp
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {tp}x{pp}x{cp}")
        dp = world_size // model_parallel
        if (world_size // pp) % (ep * etp):
            raise ValueError(
                f"parallel.expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) "
                f"must divide the ranks of one pipeline stage ({world_size // pp})")
        if model.num_moe_experts % ep:
            raise ValueError(
                f"model.num_moe_experts ({model.num_moe_experts}) is not divisible by "
                f"parallel.expert_model_parallel_size ({ep})")
        if model.num_attention_heads % tp:
            raise ValueError(
                f"model.num_attention_heads ({model.num_attention_heads}) is not divisible by "
                f"parallel.tensor_model_parallel_size ({tp})")
        if model.padded_vocab_size() % tp:
            raise ValueError(
                f"padded vocabulary ({model.padded_vocab_size()}, from model.vocab_size and "
                f"model.make_vocab_size_divisible_by) is not divisible by "
                f"parallel.tensor_model_parallel_size ({tp})")
        if model.num_query_groups % tp:
            raise ValueError(
                f"model.num_query_groups ({model.num_query_groups}) is not divisible by "
                f"parallel.tensor_model_parallel_size ({tp})")
        if model.moe_ffn_hidden_size % etp or model.ffn_hidden_size % tp:
            raise ValueError(
                f"model.moe_ffn_hidden_size ({model.moe_ffn_hidden_size}) / ffn_hidden_size "
                f"({model.ffn_hidden_size}) not divisible by the (expert) tensor-parallel size")
        if model.num_layers % pp:
            raise ValueError(
                f"model.num_layers ({model.num_layers}) is not divisible by "
                f"parallel.pipeline_model_parallel_size ({pp})")
        if tp > 1 and not self.sequence_parallel:
            raise ValueError(
                "parallel.sequence_parallel must be true when tensor_model_parallel_size > 1 "
                "with MoE layers (Megatron-Core requires it)")
        if model.seq_length % (tp * 2 * cp if cp > 1 else tp):
            raise ValueError(
                f"model.seq_length ({model.seq_length}) must be divisible by TP"
                + (" x 2 x CP" if cp > 1 else "") + " so sequence/context sharding is even")
        return dp

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(1, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                  "expert_model_parallel_size", "expert_tensor_parallel_size",
                                  "context_parallel_size")


@dataclass
class PrecisionConfig(Section, name="precision"):
    """Numerics and kernels."""

    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    """Layer spec: Transformer Engine where importable with CUDA, else Megatron's local spec."""
    bf16: bool = False
    """Train in bf16 with fp32 master weights (GPU). CPU runs fp32."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 recipe through Transformer Engine (Hopper); requires ``transformer_engine``."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation (Megatron's knob)."""
    local_kernels: bool | None = None
    """With the local spec: use :mod:`gspo_megatron.compat.local_kernels` (SDPA attention, keys
    rotated once in the static KV cache, ``F.linear`` at TP=1, a direct expert loop): same
    parameters and checkpoints, 1.5-2x faster rollouts on CPU. null = on without CUDA only (the
    CUDA local-spec path has not been measured with them yet); true forces them; false = Megatron's
    own modules, for comparison or debugging."""

    def _problems(self) -> Iterator[Problem]:
        if self.fp8 is not None and self.transformer_impl == "local":
            yield self._problem(("fp8", "transformer_impl"), (
                "needs Transformer Engine (precision.transformer_impl 'auto' or "
                f"'transformer_engine', not 'local'), got {self.fp8!r}"))


# Published shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).
_QWEN3_COMMON = dict(
    kv_channels=128, num_query_groups=4, moe_router_topk=8, num_moe_experts=128,
    vocab_size=151936, rotary_base=1_000_000.0, norm_epsilon=1e-6, moe_aux_loss_coeff=1e-3,
    untie_embeddings_and_output_weights=True, seq_length=4096, moe_layer_freq=1,
)

MODEL_PRESETS: dict[str, dict] = {
    # CPU-sized: seconds per RL step on 2 cores.
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 kv_channels=16, ffn_hidden_size=128, num_moe_experts=4, moe_router_topk=2,
                 moe_ffn_hidden_size=64, vocab_size=128, seq_length=64),
    "qwen3-30b-a3b": dict(_QWEN3_COMMON, num_layers=48, hidden_size=2048, num_attention_heads=32,
                          ffn_hidden_size=6144, moe_ffn_hidden_size=768),
    "qwen3-235b-a22b": dict(_QWEN3_COMMON, num_layers=94, hidden_size=4096,
                            num_attention_heads=64, ffn_hidden_size=12288,
                            moe_ffn_hidden_size=1536),
}


def model_config_from_preset(name: str, **overrides) -> ModelConfig:
    """A ``ModelConfig`` from a preset name, with field overrides."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"model: unknown field(s) {sorted(unknown)}")
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides, "preset": name})
