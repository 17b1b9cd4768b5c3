"""HF Qwen3-MoE <-> Megatron-Core ``GPTModel`` weight names and layouts (unsharded, TP=1).

Every Megatron tensor is assembled from one or more HF tensors, each written into its own slice
of the destination ("pieces"), so a converter can fill the destination tensor by tensor, in
whatever order the safetensors shards hold them, without buffering a layer.

=====================================================  ===============================================
HF (on-disk safetensors names)                         Megatron ``GPTModel`` state dict
=====================================================  ===============================================
``model.embed_tokens.weight`` [V, H]                   ``embedding.word_embeddings.weight`` [Vp, H]
``model.layers.N.input_layernorm.weight``              ``decoder.layers.N.input_layernorm.weight``
``model.layers.N.self_attn.{q,k,v}_proj.weight``       ``decoder.layers.N.self_attention.linear_qkv.weight``
``model.layers.N.self_attn.o_proj.weight``             ``decoder.layers.N.self_attention.linear_proj.weight``
``model.layers.N.self_attn.q_norm.weight``             ``decoder.layers.N.self_attention.q_layernorm.weight``
``model.layers.N.self_attn.k_norm.weight``             ``decoder.layers.N.self_attention.k_layernorm.weight``
``model.layers.N.post_attention_layernorm.weight``     ``decoder.layers.N.pre_mlp_layernorm.weight``
``model.layers.N.mlp.gate.weight``                     ``decoder.layers.N.mlp.router.weight``
``model.layers.N.mlp.experts.E.{gate,up}_proj.weight`` ``decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight``
``model.layers.N.mlp.experts.E.down_proj.weight``      ``decoder.layers.N.mlp.experts.local_experts.E.linear_fc2.weight``
``model.layers.N.mlp.{gate,up}_proj.weight`` (dense)   ``decoder.layers.N.mlp.linear_fc1.weight``
``model.layers.N.mlp.down_proj.weight`` (dense)        ``decoder.layers.N.mlp.linear_fc2.weight``
``model.norm.weight``                                  ``decoder.final_layernorm.weight``
``lm_head.weight`` [V, H] (absent when tied)           ``output_layer.weight`` [Vp, H]
=====================================================  ===============================================

Layouts:

* ``linear_qkv`` interleaves per query group ``g`` (``G = num_key_value_heads`` groups,
  ``r = heads / G``, ``d = head_dim``): rows ``[q heads g*r .. g*r+r-1 (r*d rows); k_g (d); v_g (d)]``.
  HF's ``repeat_kv`` gives query head ``h`` the key/value head ``h // r``, so this is the same model.
* ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]`` (Megatron applies ``silu(first half) * second half``).
* The vocabulary is padded to ``ModelConfig.padded_vocab_size()``; padded rows are zero on import
  and dropped on export.
* transformers 5.x keeps experts in memory as fused 3-D tensors ``mlp.experts.gate_up_proj``
  ``[E, 2F, H]`` (``[gate; up]`` per expert) and ``mlp.experts.down_proj`` ``[E, H, F]`` but writes
  per-expert tensors to disk (the Hub format). Both are accepted on import; export writes per-expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from gspo_megatron.config.model import ModelConfig

# How a piece of HF weight lands in its Megatron tensor.
COPY, VOCAB, Q, K, V, GATE, UP, FUSED_GATE_UP, FUSED_DOWN = (
    "copy", "vocab", "q", "k", "v", "gate", "up", "fused_gate_up", "fused_down")


@dataclass(frozen=True)
class Piece:
    """One HF tensor (or one expert of a fused 3-D HF tensor) and where it goes."""

    hf_name: str
    kind: str
    expert: int | None = None
    """Index into the leading dim of a fused HF expert tensor (``FUSED_*`` kinds only)."""


@dataclass(frozen=True)
class Target:
    """One Megatron tensor and the HF pieces that fill it completely."""

    mcore_name: str
    pieces: tuple[Piece, ...]


# ---------------------------------------------------------------------------------------------
# Shapes


def hf_expected_shapes(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF Qwen3-MoE checkpoint for ``cfg`` with its shape.

    ``lm_head.weight`` is listed only for untied embeddings. ``fused_experts`` lists the in-memory
    3-D expert tensors instead of the per-expert on-disk ones.
    """
    h, d = cfg.hidden_size, cfg.head_dim()
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    f, fm, e = cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n, moe in enumerate(cfg.layer_is_moe()):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (groups * d, h),
            p + "self_attn.v_proj.weight": (groups * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if moe:
            out[p + "mlp.gate.weight"] = (e, h)
            if fused_experts:
                out[p + "mlp.experts.gate_up_proj"] = (e, 2 * fm, h)
                out[p + "mlp.experts.down_proj"] = (e, h, fm)
            else:
                for x in range(e):
                    q = f"{p}mlp.experts.{x}."
                    out[q + "gate_proj.weight"] = (fm, h)
                    out[q + "up_proj.weight"] = (fm, h)
                    out[q + "down_proj.weight"] = (h, fm)
        else:
            out[p + "mlp.gate_proj.weight"] = (f, h)
            out[p + "mlp.up_proj.weight"] = (f, h)
            out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def uses_fused_experts(hf_names) -> bool:
    """True when a checkpoint stores experts as fused 3-D tensors (``mlp.experts.gate_up_proj``)."""
    return any(n.endswith("mlp.experts.gate_up_proj") for n in hf_names)


# ---------------------------------------------------------------------------------------------
# The plan: Megatron tensor <- HF pieces


def layer_targets(cfg: ModelConfig, local: int, glob: int, moe: bool,
                  experts: list[int] | None = None, fused_experts: bool = False) -> list[Target]:
    """Targets of one decoder layer: local index ``local`` in this model, global HF index ``glob``.

    ``experts`` are the global expert indices held locally (all of them by default), in local order.
    """
    m, p = f"decoder.layers.{local}.", f"model.layers.{glob}."
    t = [
        Target(m + "input_layernorm.weight", (Piece(p + "input_layernorm.weight", COPY),)),
        Target(m + "self_attention.linear_qkv.weight",
               (Piece(p + "self_attn.q_proj.weight", Q), Piece(p + "self_attn.k_proj.weight", K),
                Piece(p + "self_attn.v_proj.weight", V))),
        Target(m + "self_attention.linear_proj.weight", (Piece(p + "self_attn.o_proj.weight", COPY),)),
        Target(m + "self_attention.q_layernorm.weight", (Piece(p + "self_attn.q_norm.weight", COPY),)),
        Target(m + "self_attention.k_layernorm.weight", (Piece(p + "self_attn.k_norm.weight", COPY),)),
        Target(m + "pre_mlp_layernorm.weight", (Piece(p + "post_attention_layernorm.weight", COPY),)),
    ]
    if moe:
        t.append(Target(m + "mlp.router.weight", (Piece(p + "mlp.gate.weight", COPY),)))
        for le, ge in enumerate(range(cfg.num_moe_experts) if experts is None else experts):
            me = f"{m}mlp.experts.local_experts.{le}."
            if fused_experts:
                fc1 = (Piece(p + "mlp.experts.gate_up_proj", FUSED_GATE_UP, ge),)
                fc2 = (Piece(p + "mlp.experts.down_proj", FUSED_DOWN, ge),)
            else:
                he = f"{p}mlp.experts.{ge}."
                fc1 = (Piece(he + "gate_proj.weight", GATE), Piece(he + "up_proj.weight", UP))
                fc2 = (Piece(he + "down_proj.weight", COPY),)
            t += [Target(me + "linear_fc1.weight", fc1), Target(me + "linear_fc2.weight", fc2)]
    else:
        t += [Target(m + "mlp.linear_fc1.weight",
                     (Piece(p + "mlp.gate_proj.weight", GATE), Piece(p + "mlp.up_proj.weight", UP))),
              Target(m + "mlp.linear_fc2.weight", (Piece(p + "mlp.down_proj.weight", COPY),))]
    return t


def conversion_plan(cfg: ModelConfig, *, layers: list[tuple[int, int]] | None = None,
                    experts: dict[int, list[int]] | None = None, pre_process: bool = True,
                    post_process: bool = True, fused_experts: bool = False) -> list[Target]:
    """All Megatron tensors of a (TP=1) model and their HF sources.

    ``layers``: (local, global) layer indices held (all by default); ``experts``: per local MoE layer,
    the global expert indices held (all by default). The defaults describe the unsharded model.
    """
    moe = cfg.layer_is_moe()
    layers = [(i, i) for i in range(cfg.num_layers)] if layers is None else layers
    out: list[Target] = []
    if pre_process:
        out.append(Target("embedding.word_embeddings.weight",
                          (Piece("model.embed_tokens.weight", VOCAB),)))
    for local, glob in layers:
        out += layer_targets(cfg, local, glob, moe[glob], (experts or {}).get(local), fused_experts)
    if post_process:
        out.append(Target("decoder.final_layernorm.weight", (Piece("model.norm.weight", COPY),)))
        if cfg.untie_embeddings_and_output_weights:
            out.append(Target("output_layer.weight", (Piece("lm_head.weight", VOCAB),)))
        elif not pre_process:  # tied, last pipeline stage: its copy of the embedding
            out.append(Target("output_layer.weight", (Piece("model.embed_tokens.weight", VOCAB),)))
    return out


def conversion_plan_for_model(gpt_model, cfg: ModelConfig, fused_experts: bool = False) -> list[Target]:
    """The plan for the part of the model this rank holds (any PP stage / EP rank, TP=1 only)."""
    layers, experts = [], {}
    for local, layer in enumerate(gpt_model.decoder.layers):
        glob = layer.layer_number - 1  # Megatron's 1-based global layer number
        layers.append((local, glob))
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if indices is not None:
            experts[local] = list(indices)
    names = set(gpt_model.state_dict())
    plan = conversion_plan(cfg, layers=layers, experts=experts, pre_process=gpt_model.pre_process,
                           post_process=gpt_model.post_process, fused_experts=fused_experts)
    return [t for t in plan if t.mcore_name in names]


def mcore_tensor_names(state_dict) -> set[str]:
    """Weight names of a Megatron state dict (without ``_extra_state`` and non-tensors)."""
    return {k for k, v in state_dict.items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


# ---------------------------------------------------------------------------------------------
# Placing pieces (import) and extracting them (export)


def _qkv_view(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    g, d = cfg.num_query_groups, cfg.head_dim()
    r = cfg.num_attention_heads // g
    return t.view(g, r + 2, d, t.shape[-1])


def piece_view(dest: torch.Tensor, piece: Piece, cfg: ModelConfig) -> torch.Tensor:
    """The region of the Megatron tensor ``dest`` that ``piece`` occupies, in the HF tensor's layout
    except for Q/K/V (see :func:`place`)."""
    g = cfg.num_query_groups
    r = cfg.num_attention_heads // g
    kind = piece.kind
    if kind in (COPY, FUSED_DOWN, FUSED_GATE_UP):
        return dest
    if kind == VOCAB:
        return dest[:cfg.vocab_size]
    if kind in (GATE, UP):
        half = dest.shape[0] // 2
        return dest[:half] if kind == GATE else dest[half:]
    view = _qkv_view(dest, cfg)
    if kind == Q:
        return view[:, :r]
    if kind == K:
        return view[:, r]
    if kind == V:
        return view[:, r + 1]
    raise ValueError(f"unknown piece kind {kind!r}")


def _src_as_region(src: torch.Tensor, piece: Piece, cfg: ModelConfig) -> torch.Tensor:
    g, d = cfg.num_query_groups, cfg.head_dim()
    r = cfg.num_attention_heads // g
    if piece.kind == Q:
        return src.reshape(g, r, d, src.shape[-1])
    if piece.kind in (K, V):
        return src.reshape(g, d, src.shape[-1])
    return src


@torch.no_grad()
def place(dest: torch.Tensor, piece: Piece, src: torch.Tensor, cfg: ModelConfig) -> None:
    """Copy the HF tensor ``src`` (for fused kinds: the expert's 2-D slice) into ``dest`` in place.

    VOCAB zero-fills the padded rows. Dtype conversion (if any) is ``copy_``'s.
    """
    if piece.kind == VOCAB:
        dest[cfg.vocab_size:].zero_()
    piece_view(dest, piece, cfg).copy_(_src_as_region(src, piece, cfg))


def extract(src: torch.Tensor, piece: Piece, cfg: ModelConfig) -> torch.Tensor:
    """The HF tensor of ``piece`` cut out of the Megatron tensor ``src`` (contiguous, a new tensor)."""
    region = piece_view(src, piece, cfg)
    if piece.kind == Q:
        region = region.reshape(cfg.num_attention_heads * cfg.head_dim(), src.shape[-1])
    elif piece.kind in (K, V):
        region = region.reshape(cfg.num_query_groups * cfg.head_dim(), src.shape[-1])
    return region.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------
# Whole state dicts (in memory; the converters stream instead)


def mcore_state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig,
                             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Unsharded Megatron state dict from a full HF state dict (per-expert or fused experts)."""
    fused = uses_fused_experts(hf_sd)
    out = {}
    for target in conversion_plan(cfg, fused_experts=fused):
        shape = mcore_shape(target, cfg)
        first = hf_sd[target.pieces[0].hf_name]
        dest = torch.empty(shape, dtype=dtype or first.dtype)
        for piece in target.pieces:
            src = hf_sd[piece.hf_name]
            place(dest, piece, src[piece.expert] if piece.expert is not None else src, cfg)
        out[target.mcore_name] = dest
    return out


def iter_hf_tensors(mcore_sd: dict[str, torch.Tensor] | Callable[[str], torch.Tensor],
                    cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the HF checkpoint (per-expert names), in plan order.

    ``mcore_sd`` is a mapping or a function from Megatron name to tensor.
    """
    get = mcore_sd.__getitem__ if isinstance(mcore_sd, dict) else mcore_sd
    for target in conversion_plan(cfg):
        src = get(target.mcore_name)
        for piece in target.pieces:
            yield piece.hf_name, extract(src, piece, cfg)


def hf_state_dict_from_mcore(mcore_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full HF state dict (on-disk, per-expert names) from an unsharded Megatron state dict."""
    return dict(iter_hf_tensors(mcore_sd, cfg))


def mcore_shape(target: Target, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of a Megatron tensor of the unsharded model."""
    name = target.mcore_name
    h, d = cfg.hidden_size, cfg.head_dim()
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        return (cfg.padded_vocab_size(), h)
    if name.endswith("linear_qkv.weight"):
        return ((cfg.num_attention_heads + 2 * cfg.num_query_groups) * d, h)
    if name.endswith("linear_proj.weight"):
        return (h, cfg.num_attention_heads * d)
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return (d,)
    if name.endswith("layernorm.weight"):
        return (h,)
    if name.endswith("router.weight"):
        return (cfg.num_moe_experts, h)
    ffn = cfg.moe_ffn_hidden_size if "local_experts" in name else cfg.ffn_hidden_size
    if name.endswith("linear_fc1.weight"):
        return (2 * ffn, h)
    if name.endswith("linear_fc2.weight"):
        return (h, ffn)
    raise ValueError(f"unknown Megatron tensor {name!r}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_layer_index(hf_name: str) -> int | None:
    m = _LAYER.match(hf_name)
    return int(m.group(1)) if m else None
