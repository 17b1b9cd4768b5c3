"""Attention of rows that are not one plain causal sequence, in PyTorch SDPA: the local spec's
stand-ins for what Transformer Engine's fused attention does on GPU.

* :func:`packed_sdpa`: a packed (``thd``) row of several sequences, each attending only to itself
  (padding-free training, ``trainer.max_tokens_per_microbatch``).
* :func:`context_parallel_sdpa`: this context-parallel rank's share of every row
  (:class:`~gspo_megatron.layout.ContextShard`), keys and values gathered over the CP group
  (``parallel.context_parallel_size``; TE's ring attention on GPU).
* :func:`packed_context_parallel_sdpa`: both, this CP rank's two chunks of every sequence of a
  packed row (:meth:`~gspo_megatron.layout.PackedRows.context_index`).

Both are called by :class:`~gspo_megatron.backends.megatron.kernels.local.SDPADotProductAttention`
and are differentiable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gspo_megatron.layout import ContextShard, PackedRows


def length_groups(lens: list[int]) -> list[list[int]]:
    """Segments (indices into ``lens``) grouped for padded attention, the group of the longest
    first, each group's members in order: a group takes segments down to half its longest, so
    padding each to the group's longest costs at most ``4 len_i^2`` scores per segment, and a long
    tail (one 4k response among 200-token ones) does not make every short sequence pay
    ``L_max^2``. At most ``log2(L_max) + 1`` groups."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        if groups and 2 * lens[i] >= lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def packed_sdpa(query, key, value, params, scale, attend=None):
    """Causal attention of a packed row, each sequence attending only to itself: ``query
    [S, np, hn]``, ``key/value [S, ng, hn]`` -> ``[S, np, hn]``. The sequences, grouped by
    length (:func:`length_groups`), are gathered per group into right-padded
    ``[n_g, heads, L_g, hn]`` (``L_g``: the group's longest), where causal masking alone keeps a
    real query off the pads behind it; pad queries are dropped. Costs ``sum_g n_g L_g^2 <= 4 sum
    len_i^2`` scores (flash-attn / TE: ``sum len_i^2``). Differentiable (gathers; a pad reads
    its sequence's first token and gets an exact zero gradient). The gathers' indices are made
    once per microbatch (:func:`_padding_plan`) and shared by every layer. ``attend(q, k, v,
    scale)``: the causal attention of a group (``q [n_g, np, L_g, hn]``, ``k/v [n_g, ng, L_g,
    hn]`` -> like ``q``) in place of SDPA (``precision.batch_invariant``'s kernel)."""
    plan = _padding_plan(params, query.shape[0], query.device)
    outs = []
    for gather, keep, (n, longest) in plan.groups:
        q, k, v = (x.index_select(0, gather).view(n, longest, *x.shape[1:]).transpose(1, 2)
                   for x in (query, key, value))  # [n_g, heads, L_g, hn]
        out = attend(q, k, v, scale) if attend is not None else F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(1, 2).reshape(n * longest, *query.shape[1:])
        outs.append(out.index_select(0, keep))  # [S_g, np, hn]
    if plan.order is None:  # every segment in one group, in order: already the packed order
        return outs[0]
    return torch.cat(outs).index_select(0, plan.order)  # [S, np, hn], packed order


class PaddingPlan(NamedTuple):
    """How :func:`packed_sdpa` pads a packed row of ``S`` tokens, by length group: the row each
    padded position reads (``gather [n_g L_g]``), the padded positions of the real tokens
    (``keep [S_g]``, row-major) and the group's shape ``(n_g, L_g)``; ``order [S]`` puts the
    groups' outputs back in packed order (None: one group, already in order)."""

    groups: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]]
    order: torch.Tensor | None


def _padding_plan(params, total: int, device) -> PaddingPlan:
    """The :class:`PaddingPlan` of ``params``' packed row, made on first use and kept on the
    ``PackedSeqParams`` (one per microbatch, shared by every layer)."""
    kept = getattr(params, "padding_plan", None)
    if kept is not None and kept[0] == (total, device):
        return kept[1]
    cu = _segment_starts(params).to(device)
    lens = cu[1:] - cu[:-1]
    host_lens = lens.tolist()
    groups, where = [], []
    for members in length_groups(host_lens):
        seg = torch.tensor(members, device=device)
        longest = max(host_lens[i] for i in members)
        t = torch.arange(longest, device=device)
        valid = t[None, :] < lens[seg, None]  # [n_g, L_g]
        index = cu[seg, None] + t[None, :]
        index = torch.where(valid, index, cu[seg, None])  # pads read the segment's first token
        groups.append((index.reshape(-1), valid.reshape(-1).nonzero().squeeze(1),
                       (len(members), longest)))
        where.append(index[valid])
    plan = PaddingPlan(groups, None if len(groups) == 1 else torch.argsort(torch.cat(where)))
    params.padding_plan = ((total, device), plan)
    return plan


def _segment_starts(params) -> torch.Tensor:
    """``[m + 1]`` int64 segment starts of a packed row (its pads included)."""
    cu = getattr(params, "cu_seqlens_q_padded", None)
    return (params.cu_seqlens_q if cu is None else cu).long()


class _GatherContextShards(torch.autograd.Function):
    """``[s, ...]`` this context-parallel rank's positions -> ``[cp s, ...]`` the whole rows in
    position order, ``index[r]`` being the positions rank ``r`` holds
    (:class:`~gspo_megatron.layout.ContextShard`, or a packed row's
    :meth:`~gspo_megatron.layout.PackedRows.context_index`). Backward: every rank's gradient of
    the whole rows summed (an all-reduce), this rank's positions kept."""

    @staticmethod
    def forward(ctx, x, group, index):
        ctx.group, ctx.own = group, index[dist.get_rank(group)]
        parts = [torch.empty_like(x) for _ in index]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = torch.cat(parts)
        return torch.empty_like(out).index_copy_(0, torch.cat(index).to(x.device), out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.own.to(grad.device)], None, None


def context_parallel_sdpa(query, key, value, group, scale):
    """Causal attention under context parallelism (the local spec's stand-in for TE's ring
    attention): ``query [s, b, np, hn]`` holds this rank's two chunks of every row
    (:class:`~gspo_megatron.layout.ContextShard`), ``key/value [s, b, ng, hn]`` likewise; the
    keys and values of every CP rank are gathered into whole rows (``cp x`` the local KV memory,
    one all-gather each, an all-reduce of their gradients in the backward) and each query sees
    the keys at or before its global position. -> ``[s, b, np * hn]``."""
    s, b, np_, hn = query.shape
    size = dist.get_world_size(group)
    index = [ContextShard(r, size).positions(s * size) for r in range(size)]
    positions = index[dist.get_rank(group)].to(query.device)
    k, v = (_GatherContextShards.apply(x, group, index) for x in (key, value))  # [T, b, ng, hn]
    keys = torch.arange(s * size, device=query.device)
    mask = keys[None, :] <= positions[:, None]  # [s, T]
    out = F.scaled_dot_product_attention(
        query.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=mask,
        scale=scale, enable_gqa=np_ != k.shape[2])  # [b, np, s, hn]
    return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def packed_context_parallel_sdpa(query, key, value, params, group, scale):
    """Causal attention of this context-parallel rank's share of a packed row: ``query
    [s, np, hn]`` and ``key/value [s, ng, hn]`` hold, of every segment of ``params``'
    ``cu_seqlens_q_padded`` (lengths multiples of ``2 cp``), chunks ``rank`` and
    ``2 cp - 1 - rank`` (:meth:`~gspo_megatron.layout.PackedRows.context_index`). The keys and
    values of every rank are gathered into the whole packed row (one all-gather each, an
    all-reduce of their gradients); then, per group of segments of similar length
    (:func:`length_groups`), each query attends to the keys of its own segment at or before its
    position. -> ``[s, np, hn]``, this rank's order. Costs ``cp x`` the local KV memory and
    ``sum_g n_g (L_g / cp) L_g`` scores (TE's ring attention: ``sum len_i^2 / cp``, no
    gather)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = query.device
    cu = _segment_starts(params).cpu()
    lens = cu[1:] - cu[:-1]
    if bool((lens % (2 * size)).any()):
        raise ValueError(f"packed segments {lens.tolist()} do not split into 2 x "
                         f"context_parallel_size = {2 * size} chunks")
    packing = PackedRows(lens, int(cu[-1]))  # one segment per entry: the row's own split
    index = [packing.context_index(ContextShard(r, size)) for r in range(size)]
    k_all, v_all = (_GatherContextShards.apply(x, group, index) for x in (key, value))
    local_cu = (cu // size).to(device)  # each segment's share starts here in this rank's row
    cu, lens = cu.to(device), lens.to(device)
    host_lens = lens.tolist()
    outs, where = [], []
    for members in length_groups(host_lens):
        seg = torch.tensor(members, device=device)
        longest = max(host_lens[i] for i in members)
        t = torch.arange(longest, device=device)
        k_index = cu[seg, None] + torch.where(t[None, :] < lens[seg, None], t[None, :], 0)
        u = torch.arange(longest // size, device=device)
        share = lens[seg, None] // size  # [n_g, 1] this rank's queries of each segment
        chunk = share // 2
        q_valid = u[None, :] < share
        q_index = local_cu[seg, None] + torch.where(q_valid, u[None, :], 0)
        # Position within its segment of this rank's u-th query: chunk `rank`, then 2 cp - 1 - rank.
        q_pos = torch.where(u[None, :] < chunk, rank * chunk + u[None, :],
                            (2 * size - 2 - rank) * chunk + u[None, :])
        mask = t[None, None, :] <= q_pos[:, :, None]  # [n_g, L_g / cp, L_g]
        q = query[q_index].transpose(1, 2)  # [n_g, np, L_g / cp, hn]
        k, v = (x[k_index].transpose(1, 2) for x in (k_all, v_all))  # [n_g, ng, L_g, hn]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out.transpose(1, 2)[q_valid])
        where.append(q_index[q_valid])
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs)[torch.argsort(torch.cat(where))]
