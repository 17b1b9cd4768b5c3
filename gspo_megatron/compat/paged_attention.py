"""Pure-PyTorch stand-ins for flash-attn 2's paged-KV kernels, for megatron-core's dynamic engine.

megatron-core 0.16's ``Attention.flash_decode_and_prefill`` (``DynamicInferenceContext``, paged KV
cache) calls ``flash_attn_varlen_func(..., block_table=...)`` for prefill/mixed steps and
``flash_attn_with_kvcache(..., block_table=...)`` for decode-only steps, and ``forward`` asserts
``HAVE_FA3 or is_fa_min_version("2.7.3")``. :func:`install` points those module globals of
``megatron.core.transformer.attention`` at the functions below when flash-attn is absent.

Layouts (``H`` query heads, ``Hk`` kv heads, ``H % Hk == 0``; query head ``h`` reads kv head
``h // (H // Hk)`` as in flash-attn): caches ``[num_blocks, block_size, Hk, D]``; block tables
``[B, max_blocks]`` int (``-1`` = unused; padded requests have kv length 0). Kv lengths include
the current query tokens (already appended). Causal masking is flash-attn's bottom-right
alignment: query ``i`` of a request with ``q_len`` queries and ``kv_len`` keys sits at position
``kv_len - q_len + i`` and sees keys ``j <= kv_len - q_len + i``. Queries with no visible key
(padded requests / tokens) yield zeros.

Cost versus flash-attn: every call copies the used keys and values densely (``2 * B * Lk * Hk *
D`` elements, ``Lk`` = the longest kv length; SDPA groups the query heads itself; reading the
blocks in place instead was measured slower on CPU, the strided reads cold), pads the
queries to ``[B, Lq, H, D]`` (``Lq`` = longest query; decode requests in a mixed batch are padded
to it too) and builds a ``[B, Lq, Lk]`` boolean mask; then SDPA (memory-efficient or math kernel,
as a mask rules out the flash backend). Reading the max lengths syncs the host once per call, so
it cannot be captured in CUDA graphs. Fine for RL rollouts of modest batch x length; flash-attn
reads blocks in place and needs none of this memory.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_UNSUPPORTED: dict[str, Any] = {  # flash-attn options we do not implement, with their no-op value
    "k": None, "v": None, "rotary_cos": None, "rotary_sin": None, "cache_batch_idx": None,
    "cache_leftpad": None, "alibi_slopes": None, "dropout_p": 0.0, "window_size": (-1, -1),
    "softcap": 0.0, "return_attn_probs": False, "return_softmax_lse": False,
}


def _reject_unsupported(fn: str, unused: dict[str, Any]) -> None:
    for key, default in _UNSUPPORTED.items():
        val = unused.get(key, default)
        if isinstance(val, list):
            val = tuple(val)
        if not (val is default or (default is not None and not torch.is_tensor(val) and val == default)):
            raise NotImplementedError(f"{fn} (PyTorch fallback for flash-attn): option {key!r} "
                                      "is not supported; install flash-attn for it")


class _Plan:
    """What a paged attention call needs besides the queries and the caches, for requests of
    ``q_lens`` / ``kv_lens`` over ``block_table``: where each request's keys are (``blocks
    [B]``, its first block, when every request's keys fit in one; else ``rows [B * Lk]``, the
    flat cache row of each key), the rows of the gathered keys no request wrote (``unwritten``,
    flat, or None), the mask (``[B, 1, Lq, Lk]``, True = attend) and which queries see a key
    (``live [B, Lq]``). It depends on the step's lengths and block table only, so every layer
    of a step shares one (:func:`_step_plans`)."""

    __slots__ = ("blocks", "rows", "unwritten", "mask", "live", "all_live", "B", "Lk")

    def __init__(self, q_lens: torch.Tensor, kv_lens: torch.Tensor, max_kv: int, Lq: int,
                 block_table: torch.Tensor, block_size: int, causal: bool):
        device = block_table.device
        kv_lens, q_lens = kv_lens.to(device).long(), q_lens.to(device).long()
        j, written = self._keys(kv_lens, max_kv, block_table, block_size)
        self._unwritten(written)
        i = torch.arange(Lq, device=device)
        mask = written[:, None, :] & (i[None, :, None] < q_lens[:, None, None])  # [B, Lq, Lk]
        if causal:  # bottom-right aligned: query i sits at kv_len - q_len + i
            pos = (kv_lens - q_lens)[:, None] + i[None, :]  # [B, Lq]
            mask = mask & (j[None, None, :] <= pos[:, :, None])
        self.live = mask.any(dim=-1)  # [B, Lq]
        self.all_live = bool(self.live.all())
        mask[..., 0] |= ~self.live  # a fully masked row would give NaN; it is zeroed below
        self.mask = mask[:, None]

    def _keys(self, kv_lens: torch.Tensor, max_kv: int, block_table: torch.Tensor,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sets ``B``, ``Lk`` and ``blocks`` or ``rows``; returns the key positions ``j [Lk]`` and
        ``written [B, Lk]`` (the request's own keys)."""
        self.B, device = block_table.shape[0], block_table.device
        nb = min(max(-(-max_kv // block_size), 1), block_table.shape[1])
        # Only the first max_kv keys of the gathered blocks can be visible: the rest of the last
        # block is cut before the attention (a 256-token block holding 20 keys costs 20, not 256).
        self.Lk = Lk = min(nb * block_size, max(max_kv, 1))
        blocks = block_table[:, :nb].long().clamp(min=0)  # -1 (unused) reads block 0
        j = torch.arange(Lk, device=device)
        if nb == 1:
            self.blocks, self.rows = blocks[:, 0], None
        else:  # [B * Lk]
            self.blocks = None
            self.rows = (blocks[:, j // block_size] * block_size + j % block_size).reshape(-1)
        return j, j[None, :] < kv_lens[:, None]

    def _unwritten(self, written: torch.Tensor, known_none: bool = False) -> None:
        """Sets ``unwritten``: the flat ``[B * Lk]`` rows of the gathered keys past each
        request's own, or None if there are none (``known_none``: the caller knows every
        request has ``Lk`` keys)."""
        if known_none:
            self.unwritten = None
            return
        rows = torch.nonzero(~written.reshape(-1)).squeeze(1)  # one host sync (its size)
        self.unwritten = rows if rows.numel() else None

    @classmethod
    def single_query(cls, kv_lens: torch.Tensor, most: int, least: int,
                     block_table: torch.Tensor, block_size: int) -> "_Plan":
        """The plan of a decoding step (one query per request, at its last key, so causal
        masking is the kv length's): what ``_Plan(ones, kv_lens, most, 1, ...)`` builds, bitwise,
        in about half the tensor ops (~70 us less per step on TRL's workload). ``most`` /
        ``least``: the longest / shortest kv length (read by the caller in one host sync)."""
        plan = cls.__new__(cls)
        _, written = plan._keys(kv_lens, most, block_table, block_size)
        plan._unwritten(written, least == most)
        plan.live = (kv_lens > 0)[:, None]  # [B, 1]
        plan.all_live = least > 0
        mask = written[:, None, None, :]  # [B, 1, 1, Lk]
        if not plan.all_live:  # a fully masked row would give NaN; it is zeroed after the attention
            mask = mask.clone()
            mask[:, 0, :, 0] |= ~plan.live
        plan.mask = mask
        return plan


def _gather(cache: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """``[B, Lk, Hk, D]``: each request's first ``Lk`` keys (or values) of ``cache [num_blocks,
    block_size, Hk, D]``, and the slots past a request's keys zeroed. Those were never written
    (Megatron allocates the cache with ``torch.empty``) and may hold NaN bit patterns; a masked
    score does not cancel a NaN key, nor a zero weight a NaN value, and a zero weighs exactly
    what the mask leaves of any finite key: nothing.

    Keys in one block per request are copied block by block (one contiguous ``Lk x Hk x D`` run
    each: 1.5-2x the speed of a row-by-row copy on CPU, 128 requests x 48 keys); keys over
    several blocks row by row (``index_select``, not ``cache[rows]``: ~4x advanced indexing's
    generic kernel), which measured faster than whole blocks cut to ``Lk``."""
    Hk, D = cache.shape[2:]
    if plan.rows is None:
        out = cache[:, :plan.Lk].index_select(0, plan.blocks)  # [B, Lk, Hk, D]
    else:
        out = cache.reshape(-1, Hk, D).index_select(0, plan.rows).view(plan.B, plan.Lk, Hk, D)
    if plan.unwritten is not None:
        out.view(-1, Hk, D).index_fill_(0, plan.unwritten, 0)
    return out


def _paged_sdpa(q: torch.Tensor, plan: _Plan, k_cache: torch.Tensor, v_cache: torch.Tensor,
                softmax_scale: float | None) -> torch.Tensor:
    """Attention of padded queries over paged keys/values, all requests of ``plan`` at once.

    q ``[B, Lq, H, D]`` (request ``b``'s queries in ``q[b, :q_lens[b]]``, the rest ignored);
    k_cache, v_cache ``[num_blocks, block_size, Hk, D]``.
    Returns ``[B, Lq, H, D]`` in q's dtype, zero where a query is padding or sees no key.
    """
    H, D = q.shape[2:]
    Hk = k_cache.shape[2]
    k, v = _gather(k_cache, plan).transpose(1, 2), _gather(v_cache, plan).transpose(1, 2)
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    # GQA: query head h reads kv head h // (H // Hk), SDPA's own grouping (no expanded copy).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=plan.mask,
                                         scale=scale, enable_gqa=H != Hk)  # [B, H, Lq, D]
    out = out.transpose(1, 2)
    return out if plan.all_live else out.masked_fill(~plan.live[:, :, None, None], 0.0)


def _worth_splitting(n: int, most: int, total: int) -> bool:
    """Whether ``n`` requests of ``total`` keys (or queries), the longest ``most``, should be
    split (:func:`_length_groups`): padding them to the longest would more than double their
    work, and there are enough of them (>= 8) for a second attention call to pay."""
    return n >= 8 and n * most > 2 * total


def _length_groups(lengths: torch.Tensor, depth: int = 3) -> list[torch.Tensor]:
    """Row indices of ``lengths`` ``[B]``, split in two at the median (up to ``depth`` times)
    while padding a group to its longest would more than double its work: a long tail (a few
    requests at 10x the others' length, decodes beside a partial rollout's continued prefixes)
    then costs its own length, not ``B x`` the longest. Similar lengths stay one group."""
    groups = [torch.arange(lengths.numel(), device=lengths.device)]
    for _ in range(depth):
        split = []
        for rows in groups:
            sub = lengths[rows]
            if rows.numel() >= 8 and _worth_splitting(rows.numel(), int(sub.max()),
                                                      int(sub.sum())):  # (no host read < 8)
                short = sub <= sub.median()
                if not bool(short.all()):
                    split += [rows[short], rows[~short]]
                    continue
            split.append(rows)
        if len(split) == len(groups):
            break
        groups = split
    return groups


class StepPlans:
    """The plans of the current forward step, made by its first layer and reused by the rest:
    megatron-core builds one view of its block-table buffer per step (``MHAMetadata.update``) and
    hands the same view and the same length tensors to every layer. An entry is reused only for
    the very same ``block_table`` and ``lengths`` tensors (held here, so their ids stay theirs),
    unmodified since (their ``_version``); a new step's table drops the last step's plans."""

    def __init__(self):
        self._table: torch.Tensor | None = None
        self._plans: dict = {}

    def get(self, block_table: torch.Tensor, key: tuple, lengths: tuple, build):
        """``build()``'s plans for this call; ``key``: what else they depend on (kind, shapes)."""
        if block_table is not self._table:
            self._table, self._plans = block_table, {}
        versions = (block_table._version, *(t._version for t in lengths))
        hit = self._plans.get(key)
        if hit is None or hit[1] != versions or any(a is not b for a, b in zip(hit[0], lengths)):
            hit = self._plans[key] = (lengths, versions, build())
        return hit[2]


def _step_plans(cache: StepPlans | None, block_table: torch.Tensor, key: tuple, lengths: tuple,
                build):
    """``build()``, through ``cache`` when there is one (the installed :class:`PagedAttention`)."""
    return build() if cache is None else cache.get(block_table, key, lengths, build)


def _decode_plans(q_lens: torch.Tensor, kv_lens: torch.Tensor, Lq: int,
                  block_table: torch.Tensor, block_size: int, causal: bool):
    """``[(rows or None, plan)]`` per :func:`_length_groups` of the kv lengths (one plan for
    similar lengths, ``rows`` None: every request)."""
    groups = _length_groups(kv_lens)
    if len(groups) == 1:
        most = int(kv_lens.max())  # one host sync
        return [(None, _Plan(q_lens, kv_lens, most, Lq, block_table, block_size, causal))]
    return [(rows, _Plan(q_lens[rows], kv_lens[rows], int(kv_lens[rows].max()), Lq,
                         block_table[rows], block_size, causal)) for rows in groups]


def _attend(q: torch.Tensor, plans, k_cache, v_cache, softmax_scale) -> torch.Tensor:
    """:func:`_paged_sdpa` of ``q [B, Lq, H, D]`` per group of :func:`_decode_plans`."""
    if plans[0][0] is None:
        return _paged_sdpa(q, plans[0][1], k_cache, v_cache, softmax_scale)
    out = torch.empty_like(q)
    for rows, plan in plans:
        out[rows] = _paged_sdpa(q[rows], plan, k_cache, v_cache, softmax_scale)
    return out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None,
                           causal: bool = False, block_table: torch.Tensor | None = None,
                           plan_cache: StepPlans | None = None, **unused: Any) -> torch.Tensor:
    """Paged varlen attention (flash-attn 2 signature; only the ``block_table`` form).

    q ``[T, H, D]`` (tokens of request ``b`` at ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; tokens past
    ``cu_seqlens_q[-1]`` are padding and get zeros); k, v ``[num_blocks, block_size, Hk, D]``;
    cu_seqlens_q, cu_seqlens_k ``[B + 1]``; block_table ``[B, max_blocks]``. ``max_seqlen_*`` are
    not used (Megatron passes loose bounds under CUDA graphs); the exact maxima are read from the
    lengths. Returns ``[T, H, D]`` in q's dtype.
    """
    if block_table is None:
        raise NotImplementedError("flash_attn_varlen_func (PyTorch fallback for flash-attn) "
                                  "supports only the paged form (block_table=...)")
    _reject_unsupported("flash_attn_varlen_func", unused)
    T = q.shape[0]
    out = torch.zeros_like(q)
    if cu_seqlens_q.numel() <= 1 or T == 0:
        return out
    plans = _step_plans(plan_cache, block_table, ("varlen", T, k.shape[1], causal),
                        (cu_seqlens_q, cu_seqlens_k),
                        lambda: _varlen_plans(cu_seqlens_q, cu_seqlens_k, T, block_table,
                                              k.shape[1], causal))
    for gather, dest, valid, group_plans in plans:
        o_pad = _attend(q[gather], group_plans, k, v, softmax_scale)  # [B, Lq, H, D]
        out[dest] = o_pad[valid]
    return out


def _varlen_plans(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, T: int,
                  block_table: torch.Tensor, block_size: int, causal: bool) -> list:
    """Per group of similar query lengths (a mixed step's decodes apart from its prefills:
    padded together, every decode would cost the longest prefill's queries): the token index of
    each padded query (``gather [B, Lq]``), where the real ones go (``dest``, ``valid [B, Lq]``)
    and the group's :func:`_decode_plans`."""
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    q_lens, kv_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    starts, groups = cu_q[:-1], _length_groups(q_lens)
    out = []
    for rows in groups:
        sub_q, sub_kv = (q_lens, kv_lens) if len(groups) == 1 else (q_lens[rows], kv_lens[rows])
        most_q = int(sub_q.max())  # one host sync per group
        if most_q <= 0:
            continue
        arange = torch.arange(most_q, device=starts.device)
        idx = starts[rows][:, None] + arange  # [B, Lq] token index
        valid = arange[None, :] < sub_q[:, None]
        out.append((idx.clamp(0, T - 1), idx[valid], valid,
                    _decode_plans(sub_q, sub_kv, most_q, block_table[rows], block_size,
                                  causal)))
    return out


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor | int | None = None, causal: bool = True,
                            block_table: torch.Tensor | None = None, num_splits: int = 0,
                            softmax_scale: float | None = None, plan_cache: StepPlans | None = None,
                            **unused: Any) -> torch.Tensor:
    """Paged decode attention (flash-attn 2 signature; only ``block_table`` with no new k/v).

    q ``[B, Sq, H, D]``; k_cache, v_cache ``[num_blocks, block_size, Hk, D]``; cache_seqlens
    ``[B]`` (includes the new token(s); rows with 0 get zeros); block_table ``[B, max_blocks]``.
    Returns ``[B, Sq, H, D]`` in q's dtype. (flash-attn defaults ``causal=False``; Megatron always
    passes ``causal=True``.)
    """
    if block_table is None or cache_seqlens is None:
        raise NotImplementedError("flash_attn_with_kvcache (PyTorch fallback for flash-attn) "
                                  "supports only the paged form (block_table=, cache_seqlens=)")
    _reject_unsupported("flash_attn_with_kvcache", unused)
    B, Sq = q.shape[0], q.shape[1]
    if not torch.is_tensor(cache_seqlens):
        cache_seqlens = torch.full((B,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if cache_seqlens.shape[0] != B or block_table.shape[0] != B:
        raise ValueError(f"flash_attn_with_kvcache: q has batch {B} but cache_seqlens "
                         f"{tuple(cache_seqlens.shape)}, block_table {tuple(block_table.shape)}")
    if B == 0:
        return torch.zeros_like(q)

    def build():
        kv_lens = cache_seqlens.long()
        if Sq == 1:  # a decoding step: one host read decides the grouping and the key count
            most, total, least = torch.stack(
                (kv_lens.max(), kv_lens.sum(), kv_lens.min())).tolist()
            if not _worth_splitting(B, most, total):  # one group, as _length_groups decides
                return [(None, _Plan.single_query(kv_lens, most, least, block_table,
                                                  k_cache.shape[1]))]
        q_lens = torch.full((B,), Sq, dtype=torch.long, device=q.device)
        return _decode_plans(q_lens, kv_lens, Sq, block_table, k_cache.shape[1], causal)
    plans = _step_plans(plan_cache, block_table, ("decode", Sq, k_cache.shape[1], causal), (cache_seqlens,),
                        build)
    return _attend(q, plans, k_cache, v_cache, softmax_scale)


class PagedAttention:
    """What :func:`install` puts in Megatron's attention module: flash-attn's two paged entry
    points sharing one :class:`StepPlans` (the layers of a step plan once)."""

    def __init__(self):
        self.plans = StepPlans()

    def varlen(self, *args, **kwargs) -> torch.Tensor:
        return flash_attn_varlen_func(*args, plan_cache=self.plans, **kwargs)

    def with_kvcache(self, *args, **kwargs) -> torch.Tensor:
        return flash_attn_with_kvcache(*args, plan_cache=self.plans, **kwargs)


def _ours(fn) -> bool:
    return isinstance(getattr(fn, "__self__", None), PagedAttention)


def _attention_module(attention_module: ModuleType | None) -> ModuleType:
    return attention_module or importlib.import_module("megatron.core.transformer.attention")


def installed(attention_module: ModuleType | None = None) -> bool:
    """Whether our fallback is what Megatron's attention module calls."""
    return _ours(getattr(_attention_module(attention_module), "flash_attn_varlen_func", None))


def install(attention_module: ModuleType | None = None) -> bool:
    """Use the fallback in ``megatron.core.transformer.attention`` when flash-attn is absent.

    Sets its globals ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` and wraps its
    ``is_fa_min_version`` so the dynamic engine's ``"2.7.3"`` check passes. Touches nothing when
    flash-attn 2 or 3 is importable there. Idempotent: returns True only on the call that
    installed (later calls, or with real flash-attn, return False; see :func:`installed`).
    """
    mod = _attention_module(attention_module)
    if getattr(mod, "flash_attn_varlen_func", None) is not None or getattr(mod, "HAVE_FA3", False):
        return False
    original = mod.is_fa_min_version

    @functools.wraps(original)
    def is_fa_min_version(version: str, check_equality: bool = True) -> bool:
        if version == "2.7.3" and _ours(mod.flash_attn_varlen_func):
            return True
        return original(version, check_equality)

    paged = PagedAttention()
    mod.flash_attn_varlen_func = paged.varlen
    mod.flash_attn_with_kvcache = paged.with_kvcache
    mod.is_fa_min_version = is_fa_min_version
    logger.info("flash-attn is absent: the dynamic inference engine uses PyTorch SDPA paged "
                "attention (gspo_megatron.compat.paged_attention)")
    return True
