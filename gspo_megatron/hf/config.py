"""Hugging Face Qwen3-MoE ``config.json`` <-> :class:`ModelConfig`, both ways.

Only what the Megatron model built by :func:`gspo_megatron.backends.megatron.model.build_gpt_model` computes
exactly is accepted. Anything else (another ``model_type``, biased attention, RoPE scaling other
than YaRN, sliding window attention, shared experts, a non-SiLU activation) is refused with a
``ValueError`` that names the offending HF field, before any weight is read. YaRN's keys map as
:func:`hf_yarn` says.

Field map (HF -> ModelConfig):

=============================================  ===========================================
``num_hidden_layers``                          ``num_layers``
``hidden_size``                                ``hidden_size``
``num_attention_heads``                        ``num_attention_heads``
``num_key_value_heads``                        ``num_query_groups``
``head_dim`` (default hidden/heads)            ``kv_channels``
``intermediate_size`` (dense layers)           ``ffn_hidden_size``
``moe_intermediate_size``                      ``moe_ffn_hidden_size``
``num_experts`` (5.x writes ``num_local_experts``)  ``num_moe_experts``
``num_experts_per_tok``                        ``moe_router_topk``
``norm_topk_prob`` True / False                ``moe_router_pre_softmax`` False / True
``decoder_sparse_step`` + ``mlp_only_layers``  ``moe_layer_freq`` (0/1 list)
``rope_theta`` / ``rope_parameters.rope_theta``  ``rotary_base``
``rope_type: yarn`` and its keys               ``position_embedding_type: yarn``, ``yarn_*``
``rms_norm_eps``                               ``norm_epsilon``
``vocab_size``                                 ``vocab_size``
``tie_word_embeddings``                        ``not untie_embeddings_and_output_weights``
``max_position_embeddings``                    ``seq_length`` (unless overridden)
``router_aux_loss_coef``                       ``moe_aux_loss_coeff``
``initializer_range``                          ``init_method_std``
=============================================  ===========================================

Routing: HF computes ``softmax`` over all experts, takes the top-k, and renormalises them when
``norm_topk_prob`` is true. Renormalised top-k softmax equals a softmax over the top-k logits, which
is Megatron's ``moe_router_pre_softmax=False``; without renormalisation it is Megatron's
``moe_router_pre_softmax=True`` (softmax over all experts, then top-k, no renormalisation).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

from gspo_megatron.config.model import ModelConfig

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"


def load_hf_config(path: str) -> dict:
    """Read ``config.json`` from an HF model directory (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"HF config not found: {file}")
    with open(file) as f:
        try:
            config = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{file} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def _get(hf: dict, name: str, default: Any = None, required: bool = False) -> Any:
    if name not in hf or hf[name] is None:
        if required:
            raise ValueError(f"HF config: required field {name!r} is missing")
        return default
    return hf[name]


def hf_num_experts(hf: dict) -> int:
    """``num_experts`` (Hub config.json) or ``num_local_experts`` (what transformers 5.x writes)."""
    for name in ("num_experts", "num_local_experts"):
        if hf.get(name) is not None:
            return int(hf[name])
    raise ValueError("HF config: required field 'num_experts' is missing")


YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
"""transformers' values for YaRN keys a config leaves out (``_compute_yarn_parameters``)."""


def _rope_parameters(hf: dict) -> dict:
    """The RoPE dict in either spelling: ``rope_parameters`` (transformers 5, theta inside) or
    ``rope_scaling`` + top-level ``rope_theta`` (4.x). Refuses what Megatron cannot compute."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None and hf.get("rope_scaling") is not None:
        params, field = dict(hf["rope_scaling"]), "rope_scaling"
    if params is None:
        return {"rope_type": "default"}
    if not isinstance(params, dict):
        raise ValueError(f"HF config: {field} must be a dict, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"HF config: {field}.rope_type={rope_type!r} (RoPE scaling) is not "
                         "supported; only 'default' and 'yarn'")
    allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if rope_type == "yarn":
        allowed |= {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                    "mscale", "mscale_all_dim", "truncate"}
    extra = set(params) - allowed
    if extra:
        raise ValueError(f"HF config: {field} has unsupported keys {sorted(extra)} "
                         f"for rope_type {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"HF config: {field}.partial_rotary_factor != 1 is not supported")
    return {**params, "rope_type": rope_type}


def hf_rope_theta(hf: dict) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x)."""
    params = _rope_parameters(hf)
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(_get(hf, "rope_theta", 10000.0))


def hf_yarn(hf: dict) -> dict:
    """The ModelConfig YaRN fields of an HF config (empty for plain RoPE). HF's attention factor
    is ``0.1 ln(factor) + 1``, or with both ``mscale`` and ``mscale_all_dim`` set (and non-zero)
    their ratio of those: Megatron's ``yarn_mscale`` / ``yarn_mscale_all_dim`` with the
    same rule (1 / 0 give the plain one)."""
    params = _rope_parameters(hf)
    if params["rope_type"] != "yarn":
        return {}
    field = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"HF config: {field}.{key} is required for rope_type 'yarn'")
    factor = float(params["factor"])
    if not factor >= 1.0:
        raise ValueError(f"HF config: {field}.factor must be >= 1 for YaRN, got {factor}")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale) and bool(all_dim)
    return dict(
        position_embedding_type="yarn",
        yarn_rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        yarn_beta_fast=float(params.get("beta_fast") or YARN_DEFAULTS["beta_fast"]),
        yarn_beta_slow=float(params.get("beta_slow") or YARN_DEFAULTS["beta_slow"]),
        yarn_mscale=float(mscale) if both else 1.0,
        yarn_mscale_all_dim=float(all_dim) if both else 0.0,
        yarn_correction_range_round_to_int=bool(params.get("truncate", YARN_DEFAULTS["truncate"])),
    )


def _hf_rope_out(model: ModelConfig, base_rope: dict) -> dict:
    """``rope_parameters`` for ``model``: the base config's own keys kept where they still say
    the same (so a round trip writes back what it read), ours for the rest."""
    rope = {k: v for k, v in base_rope.items() if k != "type"}
    rope.update(rope_type=model.position_embedding_type.replace("rope", "default"),
                rope_theta=float(model.rotary_base))
    yarn_keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim", "truncate")
    if model.position_embedding_type != "yarn":
        for key in yarn_keys:
            rope.pop(key, None)
        return rope
    rope.update(factor=model.yarn_rotary_scaling_factor,
                original_max_position_embeddings=model.yarn_original_max_position_embeddings)
    ours = {"beta_fast": model.yarn_beta_fast, "beta_slow": model.yarn_beta_slow,
            "truncate": model.yarn_correction_range_round_to_int}
    for key, value in ours.items():
        if key in rope or value != YARN_DEFAULTS[key]:
            rope[key] = value
    if model.yarn_mscale_all_dim:
        rope.update(mscale=model.yarn_mscale, mscale_all_dim=model.yarn_mscale_all_dim)
    else:
        rope.pop("mscale", None)
        rope.pop("mscale_all_dim", None)
    return rope


def hf_moe_layer_pattern(hf: dict) -> list[int]:
    """Per-layer 1 (MoE) / 0 (dense MLP), exactly as ``Qwen3MoeDecoderLayer`` decides it."""
    n = int(_get(hf, "num_hidden_layers", required=True))
    step = int(_get(hf, "decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"HF config: decoder_sparse_step must be >= 1, got {step}")
    mlp_only = set(_get(hf, "mlp_only_layers", []) or [])
    bad = [i for i in mlp_only if not 0 <= int(i) < n]
    if bad:
        raise ValueError(f"HF config: mlp_only_layers has indices outside [0, {n}): {bad}")
    experts = hf_num_experts(hf)
    return [int(i not in mlp_only and experts > 0 and (i + 1) % step == 0) for i in range(n)]


def validate_hf_config(hf: dict) -> None:
    """Raise ``ValueError`` naming the HF field for anything the Megatron model cannot reproduce."""
    model_type = hf.get("model_type")
    if model_type != MODEL_TYPE:
        raise ValueError(f"HF config: model_type={model_type!r} is not supported; only {MODEL_TYPE!r}")
    if hf.get("attention_bias"):
        raise ValueError("HF config: attention_bias=true is not supported (Qwen3 has no QKV bias)")
    if hf.get("mlp_bias"):
        raise ValueError("HF config: mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config: hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
    if hf.get("use_sliding_window"):
        raise ValueError("HF config: use_sliding_window=true (sliding-window attention) is not supported")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"HF config: layer_types other than 'full_attention' are not supported: "
                         f"{sorted(set(layer_types))}")
    for name in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(name):
            raise ValueError(f"HF config: {name}={hf[name]} (shared experts) is not supported")
    if hf.get("qk_layernorm") is False or hf.get("use_qk_norm") is False:
        raise ValueError("HF config: Qwen3 QK-norm must be on (use_qk_norm/qk_layernorm)")
    hf_rope_theta(hf)
    hf_yarn(hf)
    experts = hf_num_experts(hf)
    if experts < 1:
        raise ValueError(f"HF config: num_experts={experts}; a model without experts is not supported")
    topk = int(_get(hf, "num_experts_per_tok", required=True))
    if not 1 <= topk <= experts:
        raise ValueError(f"HF config: num_experts_per_tok={topk} must be in [1, num_experts={experts}]")
    if topk == 1 and hf.get("norm_topk_prob"):
        # HF then weights the single expert by exactly 1; Megatron refuses top-1 without
        # pre-softmax (whose weight is the softmax probability), so this cannot be reproduced.
        raise ValueError("HF config: norm_topk_prob=true with num_experts_per_tok=1 is not supported "
                         "(Megatron-Core requires moe_router_pre_softmax for top-1)")
    if not any(hf_moe_layer_pattern(hf)):
        raise ValueError("HF config: decoder_sparse_step / mlp_only_layers leave no MoE layer; "
                         "a dense-only model is not supported")
    heads = int(_get(hf, "num_attention_heads", required=True))
    kv = int(_get(hf, "num_key_value_heads", heads))
    if heads % kv:
        raise ValueError(f"HF config: num_attention_heads={heads} is not divisible by "
                         f"num_key_value_heads={kv}")
    for name in ("hidden_size", "vocab_size", "moe_intermediate_size"):
        _get(hf, name, required=True)


def model_config_from_hf(hf: dict | str, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` reproducing the HF Qwen3-MoE config (a dict or a model directory).

    ``overrides`` set ModelConfig fields the HF config does not determine (``seq_length`` defaults to
    ``max_position_embeddings``; ``moe_token_dispatcher_type``, ``moe_router_dtype`` ...).
    """
    if isinstance(hf, str):
        hf = load_hf_config(hf)
    validate_hf_config(hf)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    pattern = hf_moe_layer_pattern(hf)
    kwargs = dict(
        preset="hf",
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(_get(hf, "num_key_value_heads", heads)),
        kv_channels=int(_get(hf, "head_dim", hidden // heads)),
        ffn_hidden_size=int(_get(hf, "intermediate_size", hf["moe_intermediate_size"])),
        num_moe_experts=hf_num_experts(hf),
        moe_router_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_router_pre_softmax=not bool(_get(hf, "norm_topk_prob", False)),
        moe_aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 1e-3)),
        vocab_size=int(hf["vocab_size"]),
        seq_length=int(_get(hf, "max_position_embeddings", 4096)),
        rotary_base=hf_rope_theta(hf),
        **hf_yarn(hf),
        norm_epsilon=float(_get(hf, "rms_norm_eps", 1e-6)),
        untie_embeddings_and_output_weights=not bool(_get(hf, "tie_word_embeddings", False)),
        init_method_std=float(_get(hf, "initializer_range", 0.02)),
    )
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"model: unknown field(s) {sorted(unknown)}")
    kwargs.update(overrides)
    cfg = ModelConfig(**kwargs)
    cfg.validate()
    return cfg


def hf_config_from_model_config(model: ModelConfig, base: dict | None = None,
                                dtype: str | None = None) -> dict:
    """An HF ``config.json`` dict (``Qwen3MoeForCausalLM``) for ``model``.

    ``base`` (e.g. the original config.json kept next to a converted checkpoint) supplies the fields
    the ModelConfig does not carry (token ids, ``max_position_embeddings`` ...); the architecture
    fields are always taken from ``model``. ``decoder_sparse_step`` / ``mlp_only_layers`` of ``base``
    are kept when they describe the same layer pattern.
    """
    model.validate()
    out = copy.deepcopy(base) if base else {}
    if out:
        validate_hf_config(out)
    pattern = [int(x) for x in model.layer_is_moe()]
    if not (out and hf_moe_layer_pattern(out) == pattern):
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = [i for i, moe in enumerate(pattern) if not moe]
    rope = _hf_rope_out(model, _rope_parameters(out) if out else {})
    out.pop("rope_scaling", None)
    out.pop("num_local_experts", None)
    out.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.head_dim(),
        intermediate_size=model.ffn_hidden_size,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        num_experts=model.num_moe_experts,
        num_experts_per_tok=model.moe_router_topk,
        norm_topk_prob=not model.moe_router_pre_softmax,
        router_aux_loss_coef=model.moe_aux_loss_coeff,
        vocab_size=model.vocab_size,
        rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=not model.untie_embeddings_and_output_weights,
        rope_parameters=rope,
        rope_theta=float(model.rotary_base),
        attention_bias=False,
        hidden_act="silu",
        use_sliding_window=False,
    )
    out.setdefault("max_position_embeddings", model.seq_length)
    out.setdefault("initializer_range", model.init_method_std)
    out.setdefault("attention_dropout", 0.0)
    out.setdefault("output_router_logits", False)
    out.setdefault("use_cache", True)
    if dtype is not None:
        out["dtype"] = dtype
        out["torch_dtype"] = dtype
    validate_hf_config(out)
    return out
