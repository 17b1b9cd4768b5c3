"""Routing statistics in plain torch (no Megatron): route changes, top-k overlap, router entropy,
expert load and imbalance, and how route changes line up with token log-ratios and clipping.

Conventions
-----------
* ``routes``: integer top-k expert ids ``[..., N, k]`` (any integer dtype; the order of the k ids
  does not matter: routes are compared as *sets*).
* ``mask``: bool ``[..., N]`` (broadcast against the leading dims), True for the positions that
  count. The trainer passes the label-aligned ``response_mask``: the positions whose outputs are
  scored (padding and prompt positions are routed too, but excluded).
* Which tokens the loss clips, and the k3 estimator, come from :mod:`gspo_megatron.algorithms`
  (``clipped_positions``, ``k3``): the diagnostics use the loss's own rules.
* Everything is returned as *sums and counts* (:class:`LayerSums`, :class:`AlignmentSums`) so that
  ranks can all-reduce them before dividing; :meth:`LayerSums.metrics` and
  :meth:`AlignmentSums.metrics` turn them into the logged ``routing/...`` numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AlignmentSums", "LayerSums", "alignment_sums", "entropy_from_logits",
    "entropy_from_probs", "expert_load", "imbalance", "layer_sums", "multi_hot",
    "route_change", "route_dtype",
]


def route_dtype(num_experts: int) -> torch.dtype:
    """Smallest dtype that stores an expert id: uint8 up to 256 experts, uint16 up to 65,536,
    else int32 (1, 2 or 4 bytes per id). torch's uint16 supports cat, indexing and ``.long()``
    (what the route store uses) but not ``index_put``."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 65536:
        return torch.uint16
    return torch.int32


def multi_hot(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[..., N, k]`` expert ids -> ``[..., N, E]`` bool set membership."""
    out = torch.zeros(*routes.shape[:-1], num_experts, dtype=torch.bool, device=routes.device)
    return out.scatter_(-1, routes.long(), True)


def route_change(old: torch.Tensor, new: torch.Tensor, num_experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: (changed ``[..., N]`` bool: the top-k *sets* differ,
    jaccard ``[..., N]`` float: |old & new| / |old | new|)."""
    a, b = multi_hot(old, num_experts), multi_hot(new, num_experts)
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float().clamp(min=1)
    return (a != b).any(-1), inter / union


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim, computed in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of non-negative scores over the last dim after normalising them to sum 1
    (softmax probabilities, or sigmoid scores)."""
    p = probs.float().clamp(min=0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-20)
    return -(p * torch.log(p.clamp(min=1e-30))).sum(-1)


def expert_load(routes: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Tokens sent to each expert: ``[..., N, k]`` -> ``[..., E]`` float counts (masked)."""
    hot = multi_hot(routes, num_experts).float()
    if mask is not None:
        hot = hot * mask.to(hot.dtype).unsqueeze(-1)
    return hot.sum(-2)


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """``max / mean`` of the per-expert load over the last dim (1 = perfectly balanced; E = all
    tokens on one expert when k = 1). 0 where no token was routed."""
    mean = load.float().mean(-1)
    return torch.where(mean > 0, load.float().amax(-1) / mean.clamp(min=1e-20),
                       torch.zeros_like(mean))


# ----------------------------------------------------------------------------- per-layer sums

@dataclass
class LayerSums:
    """Per-MoE-layer sums over (masked) positions; all tensors are float64 with a leading layer
    dim ``L``. Add two with ``+`` or all-reduce :meth:`flat` to combine ranks."""

    tokens: torch.Tensor       # [L] positions counted
    changed: torch.Tensor      # [L] positions whose top-k set changed
    jaccard: torch.Tensor      # [L] sum of top-k Jaccard overlaps
    entropy: torch.Tensor      # [L] sum of router entropies (0 when not captured)
    load: torch.Tensor         # [L, E] tokens per expert (under the *new* routes)

    @staticmethod
    def zeros(num_layers: int, num_experts: int) -> "LayerSums":
        z = torch.zeros(num_layers, dtype=torch.float64)
        return LayerSums(z.clone(), z.clone(), z.clone(), z.clone(),
                         torch.zeros(num_layers, num_experts, dtype=torch.float64))

    def __add__(self, other: "LayerSums") -> "LayerSums":
        return LayerSums(*(a + b for a, b in zip(self._parts(), other._parts())))

    def _parts(self):
        return (self.tokens, self.changed, self.jaccard, self.entropy, self.load)

    def flat(self) -> torch.Tensor:
        """One float64 vector (for a single all-reduce)."""
        return torch.cat([p.reshape(-1) for p in self._parts()])

    def with_flat(self, flat: torch.Tensor) -> "LayerSums":
        """The same layout filled from :meth:`flat`'s output (e.g. after an all-reduce)."""
        out, i = [], 0
        for p in self._parts():
            out.append(flat[i:i + p.numel()].reshape(p.shape).to(p.dtype))
            i += p.numel()
        return LayerSums(*out)

    def metrics(self, prefix: str = "routing", with_entropy: bool = True) -> dict[str, float]:
        """``routing/change_rate`` (over all (position, layer) pairs) and per layer
        ``routing/change_rate/layer_i``, plus ``jaccard``, ``entropy``, ``load_imbalance`` (max/mean
        per layer; the overall value is the mean over layers) and ``load/layer_i/expert_e``
        (share of the layer's routed slots)."""
        m: dict[str, float] = {}
        tok = self.tokens.clamp(min=1)
        total = float(self.tokens.sum())
        if total <= 0:
            return m
        m[f"{prefix}/change_rate"] = float(self.changed.sum() / total)
        m[f"{prefix}/jaccard"] = float(self.jaccard.sum() / total)
        if with_entropy:
            m[f"{prefix}/entropy"] = float(self.entropy.sum() / total)
        imb = imbalance(self.load)
        m[f"{prefix}/load_imbalance"] = float(imb.mean())
        for i in range(self.tokens.numel()):
            m[f"{prefix}/change_rate/layer_{i}"] = float(self.changed[i] / tok[i])
            m[f"{prefix}/jaccard/layer_{i}"] = float(self.jaccard[i] / tok[i])
            if with_entropy:
                m[f"{prefix}/entropy/layer_{i}"] = float(self.entropy[i] / tok[i])
            m[f"{prefix}/load_imbalance/layer_{i}"] = float(imb[i])
            slots = self.load[i].sum().clamp(min=1)
            for e in range(self.load.shape[1]):
                m[f"{prefix}/load/layer_{i}/expert_{e}"] = float(self.load[i, e] / slots)
        return m


def layer_sums(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, num_experts: int,
               entropy: torch.Tensor | None = None) -> LayerSums:
    """Sums for routes ``old``/``new`` ``[L, N, k]`` over positions ``mask`` (``[N]`` or
    ``[L, N]``); ``entropy`` ``[L, N]`` is the router entropy under the new policy (optional)."""
    if old.shape != new.shape:
        raise ValueError(f"old routes {tuple(old.shape)} and new routes {tuple(new.shape)} differ")
    maskf = mask.expand(old.shape[:-1]).double()
    changed, jac = route_change(old, new, num_experts)
    ent = (entropy.double() * maskf).sum(-1) if entropy is not None else torch.zeros(old.shape[0])
    return LayerSums(
        tokens=maskf.sum(-1),
        changed=(changed.double() * maskf).sum(-1),
        jaccard=(jac.double() * maskf).sum(-1),
        entropy=ent.double(),
        load=expert_load(new, num_experts, mask.expand(old.shape[:-1])).double(),
    )


# ------------------------------------------------------------ route changes vs ratios and clipping

@dataclass
class AlignmentSums:
    """Sums over response positions split by whether the position's route changed in any MoE
    layer: counts, sum |log ratio|, clipped counts. float64 ``[2]`` tensors: index 1 = changed."""

    count: torch.Tensor
    abs_log_ratio: torch.Tensor
    clipped: torch.Tensor

    def flat(self) -> torch.Tensor:
        return torch.cat([self.count, self.abs_log_ratio, self.clipped])

    @staticmethod
    def from_flat(flat: torch.Tensor) -> "AlignmentSums":
        return AlignmentSums(flat[0:2], flat[2:4], flat[4:6])

    def metrics(self, prefix: str = "routing") -> dict[str, float]:
        """``token_change_rate`` (share of positions with a changed route in >= 1 layer),
        ``abs_log_ratio_changed`` / ``_unchanged`` (mean |log pi/pi_old| of those positions) and
        ``clipfrac_changed`` / ``_unchanged``; a side with no position is left out."""
        total = float(self.count.sum())
        if total <= 0:
            return {}
        m = {f"{prefix}/token_change_rate": float(self.count[1]) / total}
        for i, side in ((1, "changed"), (0, "unchanged")):
            if self.count[i] > 0:
                m[f"{prefix}/abs_log_ratio_{side}"] = float(self.abs_log_ratio[i] / self.count[i])
                m[f"{prefix}/clipfrac_{side}"] = float(self.clipped[i] / self.count[i])
        return m


def alignment_sums(changed_any: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor,
                   mask: torch.Tensor) -> AlignmentSums:
    """``changed_any`` / ``log_ratio`` / ``clipped`` / ``mask``: ``[B, T]`` (label-aligned)."""
    mask = mask.bool()
    ch = changed_any.bool() & mask
    un = ~changed_any.bool() & mask
    lr = log_ratio.double().abs()
    c = clipped.double()
    return AlignmentSums(
        count=torch.stack([un.sum(), ch.sum()]).double(),
        abs_log_ratio=torch.stack([(lr * un).sum(), (lr * ch).sum()]),
        clipped=torch.stack([(c * un).sum(), (c * ch).sum()]),
    )
