"""Build a Megatron-Core ``GPTModel`` with Qwen3-MoE architecture from typed configs.

Transformer Engine's layer spec (bf16/FP8 kernels) or Megatron's local spec, with
:class:`RMSNorm` swapped in for the torch norm wrapper (which refuses sequence parallel):
:func:`choose_transformer_impl` decides, one log line says which and why.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Any

import torch

from gspo_megatron.config.model import ModelConfig, ParallelConfig, PrecisionConfig

logger = logging.getLogger(__name__)


class RMSNorm(torch.nn.Module):
    """RMSNorm usable in Megatron's local spec, including under sequence parallel.

    Megatron's ``WrappedTorchNorm`` asserts ``not sequence_parallel``. Under SP every TP rank normalises
    a different slice of the sequence, so the weight's gradient is partial per rank; tagging the weight
    with ``sequence_parallel`` makes ``finalize_model_grads`` all-reduce it over TP.
    Shapes: ``x [S, B, H] -> [S, B, H]``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's composite rms_norm: the same ops as below in one dispatch from Python,
            # bitwise equal forward and backward (tests/unit/test_model.py).
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Computed in fp32 (as TE does) whatever the activation dtype.
        x32 = x if x.dtype == torch.float32 else x.float()
        w32 = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * w32
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def transformer_engine_available() -> bool:
    """True when TE imports and CUDA is present (the only case its spec can run)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a half-installed TE raises RuntimeError, not ImportError
        return False
    return True


def grouped_gemm_available(impl: str) -> bool:
    """Whether Megatron can run its experts as one grouped GEMM for ``impl``: Transformer Engine's
    ``TEGroupedMLP`` (TE spec) or the ``grouped_gemm`` package (local spec's ``GroupedMLP``), on
    CUDA only. Otherwise the experts run as a loop (``SequentialMLP``)."""
    if not torch.cuda.is_available():
        return False
    if impl == "transformer_engine":
        return True
    from megatron.core.transformer.moe.grouped_gemm_util import grouped_gemm_is_available

    return bool(grouped_gemm_is_available())


def choose_transformer_impl(precision: PrecisionConfig, *, te_available: bool,
                            decode_step_function: bool) -> tuple[str, str]:
    """``(impl, why)`` for ``precision.transformer_impl``: 'transformer_engine' or 'local'.

    ``auto`` takes Transformer Engine only where it imports with CUDA (``te_available``) and no
    path the run takes is one that has not run on a GPU with TE: the decode step function
    (:func:`~gspo_megatron.backends.megatron.kernels.decode.step_function_applies`,
    ``decode_step_function``) reads TE's fused modules through its adapters (tested on CPU with
    stand-ins holding TE's parameter names) but has not decoded TE modules on a GPU yet, so a run
    whose rollouts decode with it stays on the local spec and this project's kernels (the path
    that has run on a GPU); a run whose rollouts decode through Megatron's forward (PP > 1,
    ``rollout.decode_steps_per_sync: 0``) takes TE. FP8 needs TE whatever the decode path."""
    if precision.transformer_impl != "auto":
        return precision.transformer_impl, f"precision.transformer_impl={precision.transformer_impl!r}"
    if precision.batch_invariant:
        return "local", "auto: precision.batch_invariant runs this project's kernels"
    if not te_available:
        return "local", "auto: Transformer Engine with CUDA not available"
    if precision.fp8:
        return "transformer_engine", f"auto: precision.fp8={precision.fp8!r} needs it"
    if decode_step_function:
        return "local", ("auto: the rollout decodes with the step function "
                         "(rollout.decode_steps_per_sync), not yet run on a GPU with TE's modules")
    return "transformer_engine", ("auto: Transformer Engine imports and the rollout decodes "
                                  "through Megatron's forward")


def resolve_transformer_impl(precision: PrecisionConfig, *, decode_step_function: bool = False,
                             log: bool = True) -> str:
    """:func:`choose_transformer_impl` on this machine, with one INFO line saying which layer spec
    and why (``log``); raises if TE was demanded, or FP8 asked for, and TE is absent."""
    te_ok = transformer_engine_available()
    if precision.transformer_impl == "transformer_engine" and not te_ok:
        raise RuntimeError(
            "precision.transformer_impl='transformer_engine' but Transformer Engine with CUDA is not "
            "available; use 'auto' or 'local'")
    if precision.fp8 and not te_ok:
        raise RuntimeError("precision.fp8 needs Transformer Engine with CUDA (Hopper or newer)")
    impl, why = choose_transformer_impl(precision, te_available=te_ok,
                                        decode_step_function=decode_step_function)
    if log:
        logger.info("layer spec: %s (%s)", "Transformer Engine" if impl == "transformer_engine"
                    else "Megatron's local spec with this project's kernels where they apply", why)
    return impl


def bf16_runs_here() -> bool:
    """Whether ``precision.bf16`` takes effect: on CUDA. On CPU the model stays fp32 (bf16
    matmuls there are slow and Megatron's bf16 optimizer asserts CUDA tensors); the tests'
    ``tests/helpers/bf16_cpu.py`` turns it on to run the bf16 optimizer path in CI."""
    return torch.cuda.is_available()


def build_transformer_config(
    model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, *,
    impl: str = "local", **overrides: Any
):
    """Translate our configs into Megatron's ``TransformerConfig`` for layer spec ``impl``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    bf16 = precision.bf16 and bf16_runs_here()
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim(),
        ffn_hidden_size=model.ffn_hidden_size,
        # Qwen3: RMSNorm, QK-norm, SwiGLU, no bias, RoPE (set on the GPTModel), no dropout.
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        # MoE
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_layer_freq=model.moe_layer_freq,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_router_dtype=model.moe_router_dtype,
        # One grouped GEMM for all experts where a kernel exists (TE, or the grouped_gemm
        # package with the local spec); else Megatron's SequentialMLP loop. Before this was
        # decided per kernel, the local spec on CUDA asserted in GroupedMLP without that package.
        moe_grouped_gemm=grouped_gemm_available(impl),
        # Parallelism
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1,
        # Numerics
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        fp8=precision.fp8,
        recompute_granularity=precision.recompute_granularity,
        recompute_method="uniform" if precision.recompute_granularity == "full" else None,
        recompute_num_layers=1 if precision.recompute_granularity == "full" else None,
        # CPU: fused kernels from apex/TE are absent; Megatron's own fusions are kept.
        bias_activation_fusion=False,
        bias_dropout_fusion=on_gpu,
        # Megatron's fused masked softmax needs its compiled extension (apex / Megatron-LM's
        # build); without it the check for the kernel raises ModuleNotFoundError mid-forward.
        masked_softmax_fusion=on_gpu and importlib.util.find_spec("scaled_masked_softmax_cuda")
        is not None,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not on_gpu,
    )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    # Read by this project's kernels (kernels.batch_invariant.enabled); Megatron ignores it.
    config.batch_invariant = bool(precision.batch_invariant)
    if model.position_embedding_type == "yarn":
        # Megatron-Core reads YaRN's knobs off the config by name (GPTModel's
        # YarnRotaryEmbedding, the attention's cos/sin scale) but declares them only on the MLA
        # config: set them on ours under the same names.
        for name in YARN_FIELDS:
            setattr(config, name, getattr(model, name))
    return config


YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
               "yarn_correction_range_round_to_int")
"""The ModelConfig fields of YaRN, Megatron-Core's names for them."""


def _swap_modules(spec: Any, old: type, new: type) -> Any:
    """Return ``spec`` (a ModuleSpec / submodules dataclass tree) with class ``old`` replaced by ``new``."""
    if spec is old:
        return new
    if isinstance(spec, list):
        return [_swap_modules(s, old, new) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap_modules(getattr(spec, f.name), old, new)
                   for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def build_layer_spec(config, impl: str, pp_rank: int | None = None, local_kernels: bool = True):
    """Megatron's decoder block spec (dense and MoE layers per ``moe_layer_freq``) for ``impl``;
    with the local spec and ``local_kernels``, our drop-in faster modules swapped in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    use_te = impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank)
    if not use_te:
        spec = _swap_modules(spec, WrappedTorchNorm, RMSNorm)
    if not use_te and local_kernels:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.moe.experts import SequentialMLP
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from gspo_megatron.backends.megatron.kernels import local as lk
        from gspo_megatron.backends.megatron.kernels import moe as local_moe

        # Same parameters and checkpoints, less Python per call (see local_kernels' docstring).
        for old, new in ((SelfAttention, lk.RopeOnceSelfAttention),
                         (DotProductAttention, lk.SDPADotProductAttention),
                         (ColumnParallelLinear, lk.DirectColumnParallelLinear),
                         (RowParallelLinear, lk.DirectRowParallelLinear),
                         (SequentialMLP, local_moe.LoopedSequentialMLP),
                         (MoELayer, local_moe.DirectMoELayer)):
            spec = _swap_modules(spec, old, new)
    return spec


def build_gpt_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    *,
    pre_process: bool,
    post_process: bool,
    pp_rank: int | None = None,
    transformer_config_overrides: dict | None = None,
):
    """One pipeline stage of the policy as a Megatron ``GPTModel`` (not yet wrapped in DDP).
    With the local spec our kernels (:mod:`.kernels.local`) replace Megatron's attention and
    experts unless ``precision.local_kernels`` is false (which the config refuses with packed
    training: its ``thd`` attention is theirs).

    Output of ``forward(input_ids [B, T], position_ids [B, T], attention_mask)`` on the last stage:
    vocab-parallel logits ``[B, T, V/TP]`` (``parallel_output=True``; never gathered).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    model.validate()
    # Megatron's per-layer aux-loss tracker is process-global and sized by the first model that
    # logs into it; a model with more layers built later in the same process would index past it.
    get_moe_layer_wise_logging_tracker().clear()
    # (an 'auto' left to here is resolved and logged here; gspo-train resolves it once first)
    impl = resolve_transformer_impl(precision, log=precision.transformer_impl == "auto")
    config = build_transformer_config(model, parallel, precision, impl=impl,
                                      **(transformer_config_overrides or {}))
    local_kernels = precision.local_kernels is not False
    spec = build_layer_spec(config, impl, pp_rank=pp_rank, local_kernels=local_kernels)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.padded_vocab_size(),
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
    )
    if local_kernels and impl == "local" and post_process:
        # GPTModel builds its output layer itself, outside the spec: give it the same one-F.linear
        # short path at TP=1 (a subclass without state of its own; parameters unchanged).
        from gspo_megatron.backends.megatron.kernels.local import DirectColumnParallelLinear

        gpt.output_layer.__class__ = DirectColumnParallelLinear
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt
