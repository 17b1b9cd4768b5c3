"""What :func:`.decode.decode_forward` reads of a Megatron ``GPTModel``, found by capability.

The decoding step needs tensors, not modules: per layer a norm, the fused QKV weight, the
attention projection, the router and the experts' two weights ``W1 [E, H, (2) F]`` and
``W2 [E, F, H]``, or a dense MLP's. Megatron builds these as different module types per spec
and build (the local spec, Transformer Engine's fused norm + linear modules, ``SequentialMLP``,
``GroupedMLP``, ``TEGroupedMLP``); each adapter here reads one layout through its parameters:

* a norm: a module with ``weight`` (called as it is: this project's ``RMSNorm``, TE's ``TENorm``),
  or TE's norm fused into the next linear (``TELayerNormColumnParallelLinear``'s
  ``layer_norm_weight`` / ``layer_norm_bias`` beside an ``IdentityOp``): :class:`FusedNorm`, TE's
  formula (in fp32, out in the activations' dtype; ``config.normalization``, ``layernorm_epsilon``,
  ``layernorm_zero_centered_gamma``, as Megatron hands them to TE);
* a linear: its ``weight`` (``[out / tp, in]`` column shards, ``[out, in / tp]`` row shards: the
  local spec's and TE's alike);
* experts (:func:`expert_weights`): ``SequentialMLP``'s ``local_experts`` (stacked once per
  rollout: a copy), ``GroupedMLP``'s ``weight1 [H, E (2) F]`` / ``weight2 [E F, H]`` (zero-copy
  views, Megatron's own ``view``), ``TEGroupedMLP``'s ``weight0 .. weight{E-1}`` (stacked).

:func:`unsupported` asks the same adapters, without stacking anything: the fast path engages
wherever they find every tensor, whatever the module types are called.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


class Unsupported(Exception):
    """A part of the model no adapter reads (its message says which)."""


@dataclasses.dataclass
class FusedNorm:
    """Transformer Engine's norm fused into a linear (``layer_norm_weight`` ``[H]``), as a
    callable: ``x [..., H] -> [..., H]`` computed in fp32, returned in ``x``'s dtype (TE's
    kernels' precision)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    rms: bool
    zero_centered: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        if self.zero_centered:
            w = w + 1
        if self.rms:
            y = F.rms_norm(x.float(), (x.shape[-1],), w, self.eps)
        else:
            y = F.layer_norm(x.float(), (x.shape[-1],), w,
                             None if self.bias is None else self.bias.float(), self.eps)
        return y.to(x.dtype)


def norm_of(norm, fused_linear, config):
    """The norm before ``fused_linear``: ``norm`` itself when it is a real one (a module with a
    ``weight``), else the norm TE fused into ``fused_linear`` (:class:`FusedNorm`)."""
    if callable(norm) and torch.is_tensor(getattr(norm, "weight", None)):
        return norm
    weight = getattr(fused_linear, "layer_norm_weight", None)
    if not torch.is_tensor(weight):
        raise Unsupported(f"no norm weight found before {type(fused_linear).__name__} "
                          f"({type(norm).__name__} holds none, the linear no layer_norm_weight)")
    normalization = getattr(config, "normalization", "RMSNorm")
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise Unsupported(f"normalization {normalization!r}")
    return FusedNorm(weight, getattr(fused_linear, "layer_norm_bias", None),
                     float(config.layernorm_epsilon), normalization == "RMSNorm",
                     bool(getattr(config, "layernorm_zero_centered_gamma", False)))


def linear_weight(module, what: str) -> torch.Tensor:
    """``module.weight`` (a plain tensor: fp8 weights are refused earlier)."""
    weight = getattr(module, "weight", None)
    if not torch.is_tensor(weight):
        raise Unsupported(f"{what} of type {type(module).__name__} has no weight tensor")
    return weight


def expert_weights(experts, stack: bool = True):
    """``(W1 [E_l, H, (2) F / etp], W2 [E_l, F / etp, H])`` of this rank's experts: views of
    ``GroupedMLP``'s weights, the rollout call's stack (:func:`~.moe.stacked_expert_weights`),
    or a new stack of ``SequentialMLP``'s / ``TEGroupedMLP``'s per-expert weights. ``stack``
    False: only check that one of these applies (returns None)."""
    from gspo_megatron.backends.megatron.kernels.moe import stack_experts

    held = getattr(experts, "stacked", None)
    if held is not None:
        return held if stack else None
    w1, w2 = getattr(experts, "weight1", None), getattr(experts, "weight2", None)
    if torch.is_tensor(w1) and torch.is_tensor(w2):  # GroupedMLP: Megatron's own views
        if not stack:
            return None
        count, hidden = experts.num_local_experts, experts.config.hidden_size
        return w1.view(count, hidden, -1), w2.view(count, -1, hidden)
    local = getattr(experts, "local_experts", None)
    if local and all(torch.is_tensor(getattr(getattr(e, n, None), "weight", None))
                     for e in local for n in ("linear_fc1", "linear_fc2")):
        return stack_experts(local) if stack else None
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    count = getattr(experts, "num_local_experts", 0)
    names = [f"weight{i}" for i in range(count)]
    if count and all(torch.is_tensor(getattr(m, n, None)) for m in (fc1, fc2) for n in names):
        if not stack:
            return None
        with torch.no_grad():  # TE's grouped linear: one parameter per expert, stacked
            return (torch.stack([getattr(fc1, n) for n in names]).transpose(1, 2),
                    torch.stack([getattr(fc2, n) for n in names]).transpose(1, 2))
    raise Unsupported(f"experts of type {type(experts).__name__}: no adapter reads their weights "
                      "(SequentialMLP's local_experts, GroupedMLP's weight1/weight2, "
                      "TEGroupedMLP's weight0..N)")


def read_layer(layer, c, heads: int, groups: int, stack: bool = True) -> DecodeLayer:
    """One layer's tensors through the adapters (:mod:`.adapters`); ``heads`` / ``groups``: this
    TP rank's query heads and key/value heads; ``stack`` False: the experts' weights are only
    checked (None). Raises :class:`~.adapters.Unsupported`."""
    from gspo_megatron.backends.megatron.kernels.decode import DecodeLayer
    from gspo_megatron.backends.megatron.model import RMSNorm

    att, mlp = layer.self_attention, layer.mlp
    qkv = getattr(att, "linear_qkv", None)
    proj = getattr(att, "linear_proj", None)
    if qkv is None or proj is None:
        raise Unsupported(f"attention of type {type(att).__name__} (no linear_qkv / linear_proj)")
    moe = hasattr(mlp, "router")
    if moe:
        w1, w2 = expert_weights(mlp.experts, stack) or (None, None)
        mlp_norm = norm_of(layer.pre_mlp_layernorm, None, c)
    else:
        fc1, fc2 = getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None)
        if fc1 is None or fc2 is None:
            raise Unsupported(f"MLP of type {type(mlp).__name__}")
        w1, w2 = linear_weight(fc1, "linear_fc1"), linear_weight(fc2, "linear_fc2")
        mlp_norm = norm_of(layer.pre_mlp_layernorm, fc1, c)
    q_norm, k_norm = getattr(att, "q_layernorm", None), getattr(att, "k_layernorm", None)
    qk_weight = None
    if type(q_norm) is RMSNorm and type(k_norm) is RMSNorm and q_norm.eps == k_norm.eps:
        qk_weight = torch.cat((q_norm.weight.float().expand(heads, -1),
                               k_norm.weight.float().expand(groups, -1)))
    return DecodeLayer(
        norm_of(layer.input_layernorm, qkv, c), linear_weight(qkv, "linear_qkv"), q_norm, k_norm,
        linear_weight(proj, "linear_proj"), mlp_norm, mlp.router.weight if moe else None, w1, w2,
        qk_weight, q_norm.eps if qk_weight is not None else 0.0)


def unsupported(model, groups) -> str | None:
    """Why :func:`decode_forward` cannot decode ``model`` on ``groups`` (None: it can). Decided
    by capability: the configuration's maths, and whether :mod:`.adapters` find every tensor
    (whatever the modules' types: the local spec, Transformer Engine's fused modules,
    ``SequentialMLP`` / ``GroupedMLP`` / ``TEGroupedMLP``)."""
    import torch.distributed as dist

    c = model.config
    if groups.pp_size != 1:
        return "pipeline parallel rollout"
    if c.multi_latent_attention or c.apply_rope_fusion or c.rotary_interleaved:
        return "MLA or fused / interleaved RoPE"
    if c.add_bias_linear or c.add_qkv_bias or c.attention_output_gate:
        return "biases or an attention output gate"
    if c.fp8 or getattr(c, "fp4", None):
        return "fp8 / fp4 weights"
    if c.num_moe_experts and (c.moe_router_score_function != "softmax" or c.moe_router_num_groups
                              or c.moe_router_enable_expert_bias or c.moe_shared_expert_intermediate_size
                              or c.moe_expert_capacity_factor is not None or c.moe_latent_size
                              or c.moe_apply_probs_on_input):
        return "MoE routing other than dropless softmax top-k (groups, expert bias, shared experts)"
    if getattr(model, "position_embedding_type", "rope") not in ("rope", "yarn"):
        return f"position embedding {model.position_embedding_type!r}"
    tp = groups.tp_size
    if c.num_query_groups % tp:
        return f"{c.num_query_groups} key/value heads over {tp} tensor-parallel ranks"
    for layer in model.decoder.layers:
        try:
            read_layer(layer, c, c.num_attention_heads // tp, c.num_query_groups // tp,
                        stack=False)
        except Unsupported as why:
            return str(why)
        experts = getattr(layer.mlp, "experts", None)
        etp = getattr(experts, "tp_group", None)
        if experts is not None and etp is not None and etp.size() > 1:
            # (TE's linears keep no group: the layout's own TP group)
            if groups.tp_group is None or not set(dist.get_process_group_ranks(etp)) <= set(
                    dist.get_process_group_ranks(groups.tp_group)):
                return "expert tensor-parallel ranks outside one attention tensor-parallel group"
    return None


def group_or_none(group):
    """``group`` when it spans more than one rank, else None (the step's collectives skipped)."""
    return group if group is not None and group.size() > 1 else None
