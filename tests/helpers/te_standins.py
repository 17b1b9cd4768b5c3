"""CPU stand-ins for what only a GPU build has: Transformer Engine's fused norm + linear modules
and grouped experts, and the ``grouped_gemm`` package behind Megatron's ``GroupedMLP``.

Each holds the real module's parameter names and layouts (``layer_norm_weight`` beside
``weight`` in ``TELayerNormColumnParallelLinear``; ``weight0 .. weight{E-1}`` per expert in
``TEGroupedMLP``'s grouped linears; ``gg.ops.gmm(x, w [E, H, F], batch_sizes)``) and computes
the same maths with TE's precision (norms in fp32, out in the activations' dtype), so Megatron's
own forward runs through them on CPU and the decoding step's adapters read them as on a GPU.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def te_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """TE's RMSNorm: in fp32, out in ``x``'s dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


class TELayerNormColumnParallelLinear(torch.nn.Module):
    """TE's norm fused into a column-parallel linear: ``x [..., H] -> (W norm(x), None)``;
    parameters ``layer_norm_weight [H]`` and ``weight [out / tp, H]``."""

    def __init__(self, weight: torch.nn.Parameter, norm_weight: torch.nn.Parameter, eps: float,
                 tp_group):
        super().__init__()
        self.weight, self.layer_norm_weight = weight, norm_weight
        self.eps, self.tp_group = eps, tp_group

    def forward(self, x):
        return F.linear(te_rms_norm(x, self.layer_norm_weight, self.eps), self.weight), None


class TERowParallelLinear(torch.nn.Module):
    """TE's row-parallel linear (one rank): ``x -> (W x, None)``; parameter ``weight``."""

    def __init__(self, weight: torch.nn.Parameter, tp_group):
        super().__init__()
        self.weight, self.tp_group = weight, tp_group

    def forward(self, x):
        return F.linear(x, self.weight), None


class _GroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear``: one parameter per expert, ``weight0 .. weight{E-1}``."""

    def __init__(self, weights):
        super().__init__()
        for i, w in enumerate(weights):
            self.register_parameter(f"weight{i}", w)


class TEGroupedMLP(torch.nn.Module):
    """Megatron's ``TEGroupedMLP`` (expert TP one rank): ``linear_fc1`` / ``linear_fc2`` grouped
    linears over ``num_local_experts`` experts; forward as Megatron's experts' (rows sorted by
    expert, ``tokens_per_expert``, router probs applied after the activation)."""

    def __init__(self, local_experts, config, tp_group, ep_group):
        super().__init__()
        self.config, self.tp_group, self.ep_group = config, tp_group, ep_group
        self.num_local_experts = len(local_experts)
        self.linear_fc1 = _GroupedLinear([e.linear_fc1.weight for e in local_experts])
        self.linear_fc2 = _GroupedLinear([e.linear_fc2.weight for e in local_experts])

    def forward(self, x, tokens_per_expert, probs):
        c, out = self.config, []
        counts = [int(n) for n in tokens_per_expert]
        for i, (xe, pe) in enumerate(zip(torch.split(x, counts), torch.split(probs, counts))):
            h = F.linear(xe, getattr(self.linear_fc1, f"weight{i}"))
            if c.gated_linear_unit:
                gate, up = torch.chunk(h, 2, dim=-1)
                h = c.activation_func(gate) * up
            else:
                h = c.activation_func(h)
            out.append(F.linear((h * pe.unsqueeze(-1)).to(x.dtype),
                                getattr(self.linear_fc2, f"weight{i}")))
        return torch.cat(out), None


def to_te_standins(model) -> None:
    """Rebuild ``model``'s (a local-spec ``GPTModel``) layers in place as TE's spec lays them
    out, sharing the same parameters: the input norm fused into ``linear_qkv``, a dense MLP's
    norm into its ``linear_fc1`` (the norms become ``IdentityOp``), TE linears, ``TEGroupedMLP``
    experts. Megatron's forward is unchanged up to TE's norm formula."""
    from megatron.core.transformer.identity_op import IdentityOp

    eps = model.config.layernorm_epsilon
    for layer in model.decoder.layers:
        att, mlp = layer.self_attention, layer.mlp
        tp = att.linear_qkv.tp_group
        att.linear_qkv = TELayerNormColumnParallelLinear(
            att.linear_qkv.weight, layer.input_layernorm.weight, eps, tp)
        att.linear_proj = TERowParallelLinear(att.linear_proj.weight, tp)
        layer.input_layernorm = IdentityOp()
        if hasattr(mlp, "router"):
            mlp.experts = TEGroupedMLP(mlp.experts.local_experts, model.config,
                                       mlp.experts.tp_group, mlp.experts.ep_group)
        else:
            mlp.linear_fc1 = TELayerNormColumnParallelLinear(
                mlp.linear_fc1.weight, layer.pre_mlp_layernorm.weight, eps, tp)
            mlp.linear_fc2 = TERowParallelLinear(mlp.linear_fc2.weight, tp)
            layer.pre_mlp_layernorm = IdentityOp()


def grouped_mlp_on_cpu(monkeypatch) -> None:
    """Megatron's ``GroupedMLP`` runnable on CPU for a test: the ``grouped_gemm`` package stood
    in (:func:`grouped_gemm_standin`), the spec asked for grouped experts, and ``GroupedMLP``'s
    bf16-only guard lifted for its own call (the kernel's dtype limit, not the maths')."""
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.moe.experts import GroupedMLP

    from gspo_megatron.backends.megatron import model as model_mod

    gg = grouped_gemm_standin()
    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm", gg)
    monkeypatch.setattr(grouped_gemm_util, "ops", gg.ops)
    monkeypatch.setattr(model_mod, "grouped_gemm_available", lambda impl: True)
    forward = GroupedMLP.forward

    def fp32_forward(self, *args, **kwargs):
        saved, self.config.bf16 = self.config.bf16, True
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.config.bf16 = saved
    monkeypatch.setattr(GroupedMLP, "forward", fp32_forward)


def grouped_gemm_standin() -> types.SimpleNamespace:
    """The ``grouped_gemm`` package as Megatron's ``GroupedMLP`` calls it: ``ops.gmm(x [N, H],
    w [E, H, F], batch_sizes [E], trans_b=False) -> [N, F]`` (rows sorted by expert)."""

    def gmm(x, w, batch_sizes, trans_b=False):
        counts = [int(n) for n in batch_sizes]
        parts = [xe @ (w[e].t() if trans_b else w[e])
                 for e, xe in enumerate(torch.split(x, counts))]
        return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1 if trans_b else 2])

    ops = types.SimpleNamespace(gmm=gmm)
    return types.SimpleNamespace(ops=ops)
