"""Typed configs for the policy model and its parallel layout, with Qwen3-MoE presets.

Field names follow Megatron-Core's ``TransformerConfig`` where a field is a Megatron knob
(``num_moe_experts``, ``moe_router_topk``, ``tensor_model_parallel_size`` ...), so a Megatron user
reads them without a glossary.

A converted checkpoint (``gspo-convert-hf``) carries ``model_config.json``, the ModelConfig it was
built with: with ``checkpoint.init_weights`` pointing at it, the loader takes the model from that
file (:func:`read_model_config_file`). Its *architecture* fields (``ARCHITECTURE_FIELDS``: what
the weights' shapes or the function they compute depend on) may be restated by a recipe only with
the same value; the others (``TRAINING_FIELDS``: ``seq_length``, the aux-loss settings, the
dispatcher, the router's dtype, the init std, the ``preset`` label) are training choices a recipe
sets freely, defaulting to the file's values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from gspo_megatron.sections import FieldError, Problem, Section
from gspo_megatron.config.coerce import CoerceError, coerce, suggest


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
    """The model's name. A ``MODEL_PRESETS`` name (tiny, qwen3-30b-a3b, qwen3-235b-a22b) fills
    every model field the recipe leaves out. Any other string is a free label (e.g. the converted
    model's name) and fills nothing, so the shape must come from elsewhere: from
    checkpoint.init_weights' model_config.json (whose own name is the default label), or from the
    recipe setting every shape field (num_layers, hidden_size, num_attention_heads,
    num_query_groups, kv_channels, ffn_hidden_size, num_moe_experts, moe_router_topk,
    moe_ffn_hidden_size, vocab_size); otherwise it is refused as an unknown preset.
    With a model_config.json, the architecture fields (all but seq_length, moe_aux_loss_coeff,
    moe_router_load_balancing_type, moe_token_dispatcher_type, moe_router_dtype, init_method_std
    and preset) come from the file; a recipe (or a known preset) that states one with another
    value is refused, naming the field and both values."""
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
    position_embedding_type: Literal["rope", "yarn"] = "rope"
    """Megatron's ``position_embedding_type``: plain RoPE, or YaRN (Peng et al. 2023, arXiv
    2309.00071: RoPE frequencies interpolated by ``yarn_rotary_scaling_factor`` below the
    ``beta`` band, cos/sin scaled by ``0.1 ln(factor) + 1``), how Qwen3 reaches 128k from its 32k
    pre-training context (HF ``rope_parameters.rope_type: yarn``)."""
    yarn_rotary_scaling_factor: float = 1.0
    """YaRN context extension factor (HF ``factor``; Qwen3's long-context recipe: 4.0)."""
    yarn_original_max_position_embeddings: int = 4096
    """The context the model was pre-trained at (HF ``original_max_position_embeddings``;
    Qwen3: 32768)."""
    yarn_beta_fast: float = 32.0
    """YaRN ramp: dimensions with more than this many rotations over the original context keep
    their frequency (HF ``beta_fast``)."""
    yarn_beta_slow: float = 1.0
    """YaRN ramp: dimensions with fewer rotations are fully interpolated (HF ``beta_slow``)."""
    yarn_mscale: float = 1.0
    """Attention temperature numerator ``0.1 mscale ln(factor) + 1`` (HF ``mscale``)."""
    yarn_mscale_all_dim: float = 0.0
    """Attention temperature denominator ``0.1 mscale_all_dim ln(factor) + 1`` (HF
    ``mscale_all_dim``; 0: none, the YaRN paper's ``0.1 ln(factor) + 1``)."""
    yarn_correction_range_round_to_int: bool = True
    """Round the ramp's dimension bounds to integers (HF ``truncate``)."""
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
        if self.position_embedding_type == "yarn":
            if not self.yarn_rotary_scaling_factor >= 1.0:
                yield self._problem("yarn_rotary_scaling_factor", (
                    f"must be >= 1 (YaRN extends the context), got "
                    f"{self.yarn_rotary_scaling_factor}"))
            yield from self._at_least(1, "yarn_original_max_position_embeddings")
            yield from self._positive("yarn_beta_fast", "yarn_beta_slow")
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
    """With the local spec: use :mod:`gspo_megatron.backends.megatron.kernels.local` (SDPA attention, keys
    rotated once in the static KV cache, ``F.linear`` at TP=1, the experts as two grouped GEMMs
    where ``torch._grouped_mm`` runs: CPU, bf16 on Hopper): same parameters and checkpoints,
    1.5-2x faster rollouts on CPU; on an H200 (Qwen3-30B-A3B slice, bf16) 7.8x Megatron's local
    spec in a training pass and 8.4x in a decoding step (docs/benchmarks.md section 6). null and
    true = on; false = Megatron's own modules, for comparison or debugging (packed training
    without TE needs them)."""

    batch_invariant: bool = False
    """Zero mismatch: every per-token value of the forward (matmuls in fixed row tiles, attention
    over keys in fixed chunks, the router, the experts added in expert order, the log-softmax in
    fixed vocabulary chunks) is computed in an order independent of the batch, the packing and of
    whether it runs in the rollout's decoding step or the training forward, with one
    implementation of each op shared by both
    (:mod:`gspo_megatron.backends.megatron.kernels.batch_invariant`): the rollout's log-probs
    and routes are bitwise the trainer's (``mismatch/tokens_differ`` 0, ``kl/rollout_vs_train``
    0.0) while the weights are the rollout's. Needs the local spec with this project's kernels,
    TP = CP = PP = 1 and the dynamic engine's step function; costs ~1.7x a rollout and ~1.4x a
    training phase on the tiny model on CPU (docs/routing.md)."""

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


SHAPE_FIELDS: tuple[str, ...] = tuple(k for k in MODEL_PRESETS["tiny"] if k != "seq_length")
"""The fields whose defaults are the tiny preset's: a free ``model.preset`` label without a
model_config.json needs every one of them set explicitly."""

ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_layer_freq", "moe_router_pre_softmax", "vocab_size", "rotary_base", "norm_epsilon",
    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
    "position_embedding_type", "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
)
"""ModelConfig fields that define the model a checkpoint holds: the tensors' shapes (including the
padded vocabulary, hence ``make_vocab_size_divisible_by``), or the function the weights compute
(routing: ``moe_router_topk``, ``moe_router_pre_softmax``; RoPE theta; RMSNorm epsilon; tied or
untied head). A recipe training from a converted checkpoint must agree with its
model_config.json on every one of them."""

TRAINING_FIELDS: tuple[str, ...] = (
    "preset", "seq_length", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
    "moe_token_dispatcher_type", "moe_router_dtype", "init_method_std",
)
"""ModelConfig fields that are training choices (a label, the context fed, the load-balancing loss,
communication, router numerics, the init of weights that are loaded anyway): a recipe may set them
to anything; left out, they take the converted checkpoint's values."""

MODEL_CONFIG_FILE = "model_config.json"
"""What ``gspo-convert-hf`` writes next to the weights: the ModelConfig (``dataclasses.asdict``)."""

MODEL_CONFIG_METADATA_KEYS = frozenset({"checkpoint_dtype"})
"""Keys of model_config.json that are not ModelConfig fields (written by the converter)."""


class ModelFileError(ValueError):
    """A malformed model_config.json; ``errors`` has one line per problem, each naming the file."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def model_config_file(init_weights: str | None) -> str | None:
    """``init_weights/model_config.json`` when ``init_weights`` is a directory that has one
    (a converted checkpoint), else ``None`` (e.g. ``sft_weights`` saved by gspo-train)."""
    if not init_weights:
        return None
    path = os.path.join(init_weights, MODEL_CONFIG_FILE)
    return path if os.path.isfile(path) else None


def _run_config_init_weights(run_dir: str) -> str | None:
    """``checkpoint.init_weights`` of the run in ``run_dir`` (its saved ``config.yaml``)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    import yaml

    try:
        with open(path) as f:
            saved = yaml.safe_load(f) or {}
        init = (saved.get("checkpoint") or {}).get("init_weights")
    except (yaml.YAMLError, AttributeError):
        return None
    if not init:
        return None
    return init if os.path.isabs(init) or os.path.isdir(init) else os.path.join(run_dir, init)


def find_converted_dir(mcore_dir: str) -> str | None:
    """The ``gspo-convert-hf`` directory behind ``mcore_dir``: itself, or for a run's checkpoint /
    checkpoints dir / ``sft_weights`` the run's ``checkpoint.init_weights`` (followed through runs
    that started from another run's weights). None when there is none."""
    seen: set[str] = set()
    todo = [os.path.abspath(mcore_dir)]
    while todo:
        d = todo.pop(0)
        if d in seen or len(seen) > 16:
            continue
        seen.add(d)
        if os.path.isfile(os.path.join(d, MODEL_CONFIG_FILE)):
            return d
        # run/checkpoints/iter_X -> run; run/checkpoints -> run; run/sft_weights -> run
        for up in (os.path.dirname(d), os.path.dirname(os.path.dirname(d))):
            init = _run_config_init_weights(up)
            if init:
                todo.append(os.path.abspath(init))
    return None


def read_model_config_file(path: str) -> dict[str, Any]:
    """``{field: value}`` of a model_config.json, each value coerced to its ModelConfig type.

    Every architecture field must be there; training fields may be missing (not returned).
    Metadata keys (``MODEL_CONFIG_METADATA_KEYS``) are ignored. Raises :class:`ModelFileError`
    (lines ``path: ...``) for unreadable or invalid JSON, a non-object, an unknown field, a value
    of the wrong type, a missing architecture field, or values ModelConfig refuses.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ModelFileError([f"{path}: cannot read: {e}"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError([f"{path}:{e.lineno}: invalid JSON: {e.msg}"]) from None
    if not isinstance(data, dict):
        raise ModelFileError([f"{path}: must be a JSON object of ModelConfig fields, "
                              f"got {type(data).__name__}"])
    hints = typing.get_type_hints(ModelConfig)
    errors: list[str] = []
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in MODEL_CONFIG_METADATA_KEYS:
            continue
        if key not in hints:
            errors.append(f"{path}: {key}: unknown ModelConfig field{suggest(key, hints)}")
            continue
        try:
            values[key] = coerce(value, hints[key])
        except CoerceError as e:
            errors.append(f"{path}: {key}: {e}, got {value!r}{e.hint}")
    missing = [k for k in ARCHITECTURE_FIELDS if k not in data]
    if missing:
        errors.append(f"{path}: missing architecture field(s) {', '.join(missing)}")
    if not errors:
        try:
            ModelConfig(**values)
        except FieldError as e:
            errors.extend(f"{path}: {line}" for line in e.messages)
        except (TypeError, ValueError) as e:
            errors.append(f"{path}: {e}")
    if errors:
        raise ModelFileError(errors)
    return values


def _canonical(field: str, value: Any, reference: ModelConfig) -> Any:
    """``value`` of ``field`` in a form where equal models compare equal (``moe_layer_freq`` 1 ==
    [1, 1]; ``kv_channels`` null == hidden / heads)."""
    if field == "moe_layer_freq":
        return moe_layer_pattern(value, reference.num_layers)
    if field == "kv_channels" and value is None:
        return reference.hidden_size // reference.num_attention_heads
    return value


def same_architecture_value(field: str, value: Any, reference: ModelConfig) -> bool:
    """Whether ``value`` for ``field`` describes the same model as ``reference``'s."""
    a = _canonical(field, value, reference)
    b = _canonical(field, getattr(reference, field), reference)
    if isinstance(a, float) or isinstance(b, float):
        return (not isinstance(a, bool) and not isinstance(b, bool)
                and isinstance(a, (int, float)) and isinstance(b, (int, float))
                and math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0))
    return a == b


def show_value(value: Any) -> str:
    """A value as a recipe writes it (``true``, ``null``, ``[1, 0]``, ``1000000.0``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def architecture_differences(model: ModelConfig, reference: ModelConfig) -> list[tuple[str, Any, Any]]:
    """``(field, model's value, reference's value)`` for each architecture field that differs."""
    return [(f, getattr(model, f), getattr(reference, f)) for f in ARCHITECTURE_FIELDS
            if not same_architecture_value(f, getattr(model, f), reference)]


def model_config_from_preset(name: str, **overrides) -> ModelConfig:
    """A ``ModelConfig`` from a preset name, with field overrides."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"model: unknown field(s) {sorted(unknown)}")
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides, "preset": name})
