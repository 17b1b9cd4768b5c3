"""One decoding step of a Megatron ``GPTModel`` as a single pure-torch function over its weights
and the dynamic engine's paged KV buffer: no module tree, no host reads, static shapes.

Megatron's forward of a decoding step walks ~20 modules per layer, and its dynamic engine reads
the device ~9 times per step (attention metadata, ``update_requests``, the block allocator); on
a GPU each read waits for the step to finish, so a step costs its launches and waits, not its
arithmetic (90-96 ms on the Qwen3-30B-A3B slice whose weights take ~0.7 ms to read). Here a
step is one function of tensors:

    logits [B, V], routes [L_moe, B, k] = decode_forward(weights, kv, batch)

with every shape fixed by ``B`` (the request slots) and ``Lk`` (the keys each request may read),
so it compiles with ``torch.compile(fullgraph=True)`` and a CUDA graph can hold it. The maths is
Megatron's local spec with this project's kernels (:mod:`.local`, :mod:`.moe`), op for op:
RMSNorm, fused QKV split per query group, QK-norm, RoPE (:mod:`.rotary`), the key/value written
into the paged buffer, attention over each request's keys gathered from its blocks (SDPA with
each key/value head's query heads folded into the query axis: :func:`_grouped_sdpa`),
top-k softmax routing with Megatron's ``topk`` and dropless experts as two grouped GEMMs over
the tokens in expert-major order (:func:`~.moe.permute_without_host_reads`; with at most ``2 k``
experts, or this rank's experts under EP, every expert over every token: :func:`_dense_experts`),
final norm and output layer. Greedy tokens equal Megatron's forward's
(``tests/unit/test_fast_decode.py``). A step that prefills prompts runs it too: a request's
several queries attend causally to its paged keys (:attr:`KeyGroup.queries`), and only the last
tokens' logits are computed (:attr:`DecodeBatch.last`).

Tensor parallelism as Megatron's modules do it, without sequence parallelism (a decoding step
has one token per request): every TP rank holds every row, ``linear_qkv`` / ``linear_fc1`` are
column shards (its heads, its part of ``F``), ``linear_proj`` / ``linear_fc2`` row shards whose
partial sums are all-reduced over the TP group, the embedding a vocabulary shard (looked up,
all-reduced), the logits gathered over the vocabulary. Experts: their own tensor parallelism
(``expert_tensor_parallel_size``: F-shards, partial sums all-reduced over that group) and EP
(sharded, :func:`_moe_ep`, or gathered once per call,
:func:`~..engine.decode_weights.replicate_experts`). Every group is the model's own (its
modules' ``tp_group``, ``ep_group``), passed explicitly.

The weights are read through :mod:`.adapters` (the local spec, Transformer Engine's fused norm +
linear modules, ``SequentialMLP`` / ``GroupedMLP`` / ``TEGroupedMLP``): :func:`unsupported` says
why not where they find no tensor, or where the maths differs (PP > 1, MLA, fused /
interleaved RoPE, biases, fp8, routing other than dropless softmax top-k without groups, expert
bias or shared experts). Everything else decodes through Megatron's forward, as before.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from gspo_megatron.backends.megatron.kernels import batch_invariant as bi
from gspo_megatron.backends.megatron.kernels.adapters import read_layer, unsupported  # noqa: F401
from gspo_megatron.backends.megatron.kernels.moe import (grouped_mm_runs_on,
                                                         permute_without_host_reads)
from gspo_megatron.backends.megatron.kernels.rotary import rotate
from gspo_megatron.backends.megatron.model import RMSNorm
from gspo_megatron.rollouts import kv_fp8


@dataclasses.dataclass
class DecodeLayer:
    """One transformer layer's weights (the model's own tensors, not copies; the experts
    stacked once per rollout call)."""

    input_norm: torch.nn.Module
    """The norm before attention: a norm module, or TE's norm fused into ``linear_qkv``
    (:class:`~.adapters.FusedNorm`); likewise ``mlp_norm``."""
    qkv: torch.Tensor
    """``[(np + 2 ng) hn, H]``: Megatron's fused layout, per query group its ``np / ng`` query
    heads, then its key, then its value."""
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    proj: torch.Tensor
    """``[H, np hn]``."""
    mlp_norm: torch.nn.Module
    router: torch.Tensor | None
    """``[E, H]``; None: a dense layer."""
    w1: torch.Tensor
    """``[E, H, (2) F]`` (experts, transposed views as ``F.linear`` reads them) or ``[(2) F, H]``
    (a dense layer's ``linear_fc1``)."""
    w2: torch.Tensor
    """``[E, F, H]`` or ``[H, F]``."""
    qk_weight: torch.Tensor | None = None
    """``[np + ng, hn]`` fp32: QK-norm's query weight per query head, then its key weight per
    key head, so one RMSNorm and one rotation serve both (our ``RMSNorm`` on both sides, same
    eps: its formula, in fp32, then the activations' dtype); None: the two modules are called."""
    qk_eps: float = 0.0
    logit_noise: object = None
    """``logits [T, E] -> logits``: the router's ``rollout.router_noise_std`` noise
    (:class:`~..rollout_numerics.RouterNoise`, also in its Megatron forward); None: none."""
    fp8_w1: object = None
    """``rollout.precision: fp8`` on Hopper: ``w1`` as FP8 experts for the grouped GEMM
    (:class:`~gspo_megatron.rollouts.fp8.Fp8Experts`, ``(rows, offs) -> [T k, (2) F]``: one
    ``torch._scaled_grouped_mm``); None: ``torch._grouped_mm`` over ``w1``. Likewise ``fp8_w2``."""
    fp8_w2: object = None


@dataclasses.dataclass
class DecodeWeights:
    """What :func:`decode_forward` reads of a ``GPTModel`` (:meth:`of`)."""

    embedding: torch.Tensor
    """``[V, H]``."""
    layers: list[DecodeLayer]
    final_norm: torch.nn.Module
    output: torch.Tensor
    """``[V, H]`` (``V``: the real vocabulary, or Megatron's padded one)."""
    heads: int
    groups: int
    head_dim: int
    rot_dim: int
    topk: int
    pre_softmax: bool
    scaling_factor: float | None
    router_dtype: torch.dtype | None
    gated: bool
    activation: object
    glu_offset: float
    softmax_scale: float
    grouped_query: bool
    """More query heads than key/value heads (SDPA's ``enable_gqa``; a bool, not a comparison of
    two ints, which ``torch.compile(dynamic=True)`` would make symbolic)."""
    grouped_mm: bool = True
    """Experts as ``torch._grouped_mm`` (:func:`~.moe.grouped_mm_runs_on`: any dtype on CPU,
    bf16 on Hopper); else each route multiplies its expert's gathered weights."""
    ep_group: object = None
    """The expert-parallel group (None: every expert is here)."""
    local_experts: tuple[int, int] = (0, 0)
    """``(first, count)``: the global indices of this rank's experts."""
    ep_rows: int = 0
    """Under EP: the tokens every rank contributes to a MoE layer's gather (the most any rank
    decodes this round; fewer are padded): set per round (:class:`~..engine.rounds.FastDecoder`)."""

    tp_group: object = None
    """The tensor-parallel group of attention, dense MLPs, embedding and output layer (None: one
    rank): ``qkv`` / ``w1`` are column shards (this rank's heads, its part of ``F``), ``proj`` /
    ``w2`` row shards whose partial sums are all-reduced, ``embedding`` / ``output`` this rank's
    rows of the (padded) vocabulary. No sequence parallelism: every TP rank holds every row."""
    expert_tp_group: object = None
    """The experts' own tensor-parallel group (Megatron's ``expert_tensor_parallel_size``; None:
    one rank): each expert's ``W1`` / ``W2`` a column / row shard of ``F``, the experts' partial
    sums all-reduced over it. Its ranks lie inside one ``tp_group`` (:func:`unsupported`), so
    they hold the same rows."""
    vocab_start: int = 0
    """The first vocabulary id of this TP rank's ``embedding`` rows."""
    vocab: int | None = None
    """Under TP: the logits' columns kept after the gather (the tokenizer's ids)."""
    invariant: bool = False
    """``precision.batch_invariant``: every op through :mod:`.batch_invariant`, as the training
    forward's modules run them (the QK-norm by its modules, not fused)."""

    @classmethod
    def of(cls, model, vocab: int | None = None) -> "DecodeWeights":
        """The weights of ``model`` (a ``GPTModel``, :func:`unsupported` None), read through
        :mod:`.adapters` (experts stacked, or viewed where the layout allows); ``vocab``: the
        output layer's first ``vocab`` rows only (the tokenizer's ids: the columns Megatron pads
        the vocabulary with are never sampled)."""
        from gspo_megatron.backends.megatron.kernels.adapters import group_or_none

        c = model.config
        embedding = model.embedding.word_embeddings
        tp_group = group_or_none(getattr(embedding, "tp_group", None))
        tp = tp_group.size() if tp_group is not None else 1
        heads, groups = c.num_attention_heads // tp, c.num_query_groups // tp
        # rollout.precision fp8 where FP8 GEMMs run: attention weights as FP8 (F.linear on them
        # is torch._scaled_mm: ..rollout_numerics.Fp8Weights); else the tensors themselves
        fp8 = getattr(model, "fp8_gemm_weights", None) or {}
        layers = []
        invariant = bi.enabled(c)
        for layer in model.decoder.layers:
            read = read_layer(layer, c, heads, groups)
            router = getattr(layer.mlp, "router", None)
            layers.append(dataclasses.replace(
                read, qkv=fp8.get(id(read.qkv), read.qkv), proj=fp8.get(id(read.proj), read.proj),
                logit_noise=getattr(router, "logit_noise", None),
                # the invariant mode norms queries and keys with the training forward's modules
                qk_weight=None if invariant else read.qk_weight))
        head_dim = c.kv_channels
        rot = model.rotary_pos_emb
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(c.moe_router_dtype)
        moe = next((layer.mlp for layer in model.decoder.layers if hasattr(layer.mlp, "router")),
                   None)
        ep_group = moe.ep_group if moe is not None and moe.ep_group.size() > 1 else None
        local = (moe.local_expert_indices[0], moe.num_local_experts) if moe is not None else (0, 0)
        expert_tp = (group_or_none(getattr(moe.experts, "tp_group", None))
                     if moe is not None else None)
        output = (model.shared_embedding_or_output_weight()
                  if model.share_embeddings_and_output_weights else model.output_layer.weight)
        if tp_group is None:
            output = output[:vocab] if vocab is not None else output  # (a view: no copy)
        return cls(embedding.weight, layers, model.decoder.final_layernorm,
                   output, heads, groups, head_dim,
                   rot.inv_freq.numel() * 2, c.moe_router_topk, bool(c.moe_router_pre_softmax),
                   c.moe_router_topk_scaling_factor, router_dtype, bool(c.gated_linear_unit),
                   c.activation_func, float(c.glu_linear_offset),
                   c.softmax_scale if c.softmax_scale is not None else head_dim ** -0.5,
                   c.num_attention_heads != c.num_query_groups,
                   grouped_mm_runs_on(layers[0].w1) if layers else True, ep_group, local,
                   tp_group=tp_group, expert_tp_group=expert_tp,
                   vocab_start=int(getattr(embedding, "vocab_start_index", 0)),
                   vocab=vocab if vocab is not None else output.shape[0] * tp,
                   invariant=invariant)


def step_function_applies(rollout, tp: int, pp: int) -> bool:
    """Whether a run's rollouts decode with :func:`decode_forward`, from its config alone
    (``rollout``: the ``rollout`` section; ``tp``, ``pp``: the rollout's layout): the dynamic
    engine with ``decode_steps_per_sync`` > 0 without pipeline parallelism (tensor parallelism
    is decoded by the step function). The model-level part (its modules, read through
    :mod:`.adapters`) is :func:`unsupported`'s; this is what the layer spec is chosen by before
    the model exists (:func:`~gspo_megatron.backends.megatron.model.choose_transformer_impl`)."""
    del tp  # the step function shards as Megatron's modules do
    return rollout.engine != "static" and rollout.decode_steps_per_sync > 0 and pp == 1


@dataclasses.dataclass
class KeyGroup:
    """The keys some requests of a step read (their rows of the batch, ``B_g`` of them, each
    reading ``Lk`` keys): requests of similar length share a group, so a long request beside
    short ones costs its own length, not the batch x its length."""

    rows: torch.Tensor | None
    """``[B_g]`` long: the group's rows of the batch (None: every row, in order)."""
    key_rows: torch.Tensor
    """``[B_g, Lk]`` long: the flat KV slots (``block * block_size + offset``) of each request's
    keys ``0 .. Lk - 1``."""
    key_mask: torch.Tensor | None
    """``[B_g, Lk]`` bool: which of those are the request's (positions ``<= positions[b]``)."""
    positions: torch.Tensor
    """``[Lk]``: ``0 .. Lk - 1`` (what the mask compares against)."""
    key_blocks: torch.Tensor | None = None
    """``[B_g]`` long, when every request's ``Lk`` keys lie in its first KV block: that block, so
    the keys are read as one contiguous run per request (a per-row gather costs 1.5-2x on CPU);
    the slots past a request's keys must then hold finite values."""
    queries: torch.Tensor | None = None
    """``[B_g, Lq]`` long: the batch rows of each request's queries, when a request forwards
    several tokens (a prefill beside decoding rows, :meth:`~..engine.rounds.FastDecoder.
    mixed_logits`), padded with the row ``B`` (dropped); ``key_mask`` is then ``[B_g, Lq, Lk]``
    and ``rows`` unused. None: one query per request, its row in ``rows``."""


@dataclasses.dataclass
class DecodeBatch:
    """One decoding step's inputs, ``B`` request slots.

    A slot whose request has finished (or holds none) still runs, on its own blocks: its output
    is ignored, so nothing here depends on which slots are live."""

    tokens: torch.Tensor
    """``[B]`` long: each request's newest token (the one this step forwards)."""
    positions: torch.Tensor
    """``[B]`` long: its position in its request (= the keys cached before it)."""
    slots: torch.Tensor
    """``[B]`` long: the flat KV slot its key and value go to."""
    cos: torch.Tensor
    """``[S, 1, 1, rot]``: the rotary table's cosines (:func:`~.rotary.cos_sin`), by position."""
    sin: torch.Tensor
    groups: list[KeyGroup]
    """The keys, by length group (one group: ``rows`` None)."""
    last: torch.Tensor | None = None
    """``[n]`` long: the rows whose logits are computed (a prefill's last token per request);
    None: every row."""
    kv_error: list | None = None
    """With an FP8 cache (``rollout.kv_cache_dtype: fp8``): where the step appends, per layer,
    ``[2]`` sums of the squared error its written keys and values make and of their squares
    (:func:`~gspo_megatron.rollouts.kv_fp8.error_sums`, on the device); None: not measured."""


def decode_forward(w: DecodeWeights, kv: torch.Tensor, batch: DecodeBatch,
                   record_routes: bool = False):
    """``(logits [B, V] fp32, routes [L_moe, B, k] or None)`` of one decoding step; the step's
    keys and values are written into ``kv [2, L, blocks, block_size, Hk, D]`` (Megatron's paged
    buffer, whose every slot must hold finite values: zeroed once when allocated) at
    ``batch.slots``. ``routes``: each MoE layer's top-k experts in ``torch.topk``'s
    order (what R3 records). A ``uint8`` ``kv`` of last dimension ``D + 4`` is the FP8 cache
    (``rollout.kv_cache_dtype: fp8``, :mod:`gspo_megatron.rollouts.kv_fp8`): keys and values
    are written as e4m3 codes with a scale per token and head, and read back dequantized to
    the activations' dtype."""
    B = batch.tokens.shape[0]
    np_, ng, hn = w.heads, w.groups, w.head_dim
    x = _embed(w, batch.tokens).unsqueeze(1)  # [B, 1, H] (sequence-major, b = 1)
    cos, sin = batch.cos[batch.positions], batch.sin[batch.positions]  # [B, 1, 1, rot]
    routes = []
    for i, layer in enumerate(w.layers):
        y = _norm(layer.input_norm, x)
        qkv = _mm(w, y, layer.qkv).view(B, 1, ng, (np_ // ng + 2) * hn)
        q, k, v = torch.split(qkv, [np_ // ng * hn, hn, hn], dim=3)
        q = q.reshape(B, 1, np_, hn)  # [B, 1, np, hn]
        if layer.qk_weight is not None:  # QK-norm and RoPE of queries and keys at once
            qk = torch.cat((q, k), dim=2)  # [B, 1, np + ng, hn]
            normed = F.rms_norm(qk.float(), (hn,), None, layer.qk_eps) * layer.qk_weight
            q, k = rotate(normed.to(qk.dtype), cos, sin, w.rot_dim).split([np_, ng], dim=2)
        else:  # the training forward's norm modules (their one op), one rotation for both
            if layer.q_norm is not None:
                q = _norm(layer.q_norm, q)
            if layer.k_norm is not None:
                k = _norm(layer.k_norm, k)
            q, k = rotate(torch.cat((q, k), dim=2), cos, sin, w.rot_dim).split([np_, ng], dim=2)
        kv_fp8.write(kv, i, batch.slots, k.squeeze(1), v.squeeze(1), batch.kv_error)
        if len(batch.groups) == 1 and batch.groups[0].rows is None \
                and batch.groups[0].queries is None:
            out = _attend(w, kv, i, q, batch.groups[0])  # [B, np, 1, hn]
        else:  # (row B: where padded queries of a prefill group go)
            out = q.new_empty(B + 1, np_, 1, hn)
            padded = None
            for g in batch.groups:
                if g.queries is None:
                    out.index_copy_(0, g.rows, _attend(w, kv, i, q.index_select(0, g.rows), g))
                    continue
                if padded is None:
                    padded = torch.cat((q, q.new_zeros(1, *q.shape[1:])))
                out.index_copy_(0, g.queries.reshape(-1), _attend_queries(w, kv, i, padded, g))
            out = out[:B]
        x = x + _reduce(_mm(w, out.transpose(1, 2).reshape(B, 1, np_ * hn), layer.proj),
                        w.tp_group)
        y = _norm(layer.mlp_norm, x)
        if layer.router is None:
            mlp, top = _dense(w, layer, y), None
        else:
            mlp, top = _moe(w, layer, y)
        x = x + mlp
        if record_routes and top is not None:
            routes.append(top)
    if batch.last is not None:
        x = x.index_select(0, batch.last)
    logits = _mm(w, _norm(w.final_norm, x), w.output).squeeze(1)  # [B or n, V / tp]
    if w.tp_group is not None:  # every rank's columns, the padded ones dropped
        logits = _gather_columns(logits, w.tp_group)[:, :w.vocab]
    logits = logits.float()  # [B or n, V]
    return logits, (torch.stack(routes) if record_routes and routes else None)


def _mm(w: DecodeWeights, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``; :func:`.batch_invariant.linear` in the invariant mode."""
    return bi.linear(x, weight) if w.invariant else F.linear(x, weight)


def _embed(w: DecodeWeights, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, H]``: Megatron's ``VocabParallelEmbedding``: under TP each rank looks up the ids in
    its rows (the others zero) and the ranks' rows are summed (one exact term each)."""
    if w.tp_group is None:
        return F.embedding(tokens, w.embedding)
    local = tokens - w.vocab_start
    outside = (local < 0) | (local >= w.embedding.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), w.embedding)
    return _reduce(x.masked_fill(outside.unsqueeze(-1), 0), w.tp_group)


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` in place (a row-parallel linear's partial sums: Megatron's
    ``reduce_from_tensor_model_parallel_region``); ``x`` itself for None."""
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(x, group=group)
    return x


def _gather_columns(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, size c]``: every rank's ``x [n, c]`` side by side in rank order (a column-parallel
    linear's gathered output: Megatron's ``gather_from_tensor_model_parallel_region``)."""
    import torch.distributed as dist

    size = group.size()
    parts = x.new_empty(size * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(parts, x.contiguous(), group=group)
    return parts.view(size, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], -1)


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; this project's RMSNorm on fp32 as the one op its forward runs (bitwise),
    without the module call (a decoding step of a small model is its op count)."""
    if type(norm) is RMSNorm and x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    return norm(x)


def _attend(w: DecodeWeights, kv: torch.Tensor, layer: int, q: torch.Tensor,
            g: KeyGroup) -> torch.Tensor:
    """``[B_g, np, 1, hn]``: queries ``q [B_g, 1, np, hn]`` over their group's keys of ``layer``
    (``[B_g, Lk, ng, hn]`` gathered from the paged buffer; masked slots hold finite values)."""
    B, Lk = g.key_rows.shape
    ng, width = w.groups, kv.shape[-1]
    if w.invariant and g.key_blocks is not None and bi.key_window(Lk, q) == Lk:
        # gathered in the invariant kernel's layouts (keys head-major, values transposed:
        # read in place there); the round's window is whole key chunks (..engine.rounds.
        # FastDecoder._keys)
        k_all = kv[0, layer].permute(0, 2, 1, 3)[:, :, :Lk].index_select(0, g.key_blocks)
        v_all = kv[1, layer].permute(0, 2, 3, 1)[..., :Lk].index_select(0, g.key_blocks)
        k_all, v_all = k_all.transpose(1, 2), v_all.permute(0, 3, 1, 2)  # [B, Lk, ng, hn]
    elif g.key_blocks is not None:  # one contiguous run per request
        k_all = kv[0, layer][:, :Lk].index_select(0, g.key_blocks)
        v_all = kv[1, layer][:, :Lk].index_select(0, g.key_blocks)
    else:
        rows = g.key_rows.reshape(-1)  # [B_g Lk]
        k_all = kv[0, layer].view(-1, ng, width).index_select(0, rows).view(B, Lk, ng, width)
        v_all = kv[1, layer].view(-1, ng, width).index_select(0, rows).view(B, Lk, ng, width)
    k_all, v_all = kv_fp8.read(kv, k_all, q.dtype), kv_fp8.read(kv, v_all, q.dtype)
    return _grouped_sdpa(w, q.transpose(1, 2), k_all, v_all, g.key_mask[:, None, :])


def _attend_queries(w: DecodeWeights, kv: torch.Tensor, layer: int, q: torch.Tensor,
                    g: KeyGroup) -> torch.Tensor:
    """``[B_g Lq, np, 1, hn]``: each request's queries (``q [B + 1, 1, np, hn]`` at the rows
    ``g.queries``) over its keys (``g.key_rows``, causal by ``g.key_mask [B_g, Lq, Lk]``)."""
    B, Lq = g.queries.shape
    Lk = g.key_rows.shape[1]
    np_, ng, hn, width = w.heads, w.groups, w.head_dim, kv.shape[-1]
    rows = g.key_rows.reshape(-1)
    k_all, v_all = (kv_fp8.read(kv, kv[t, layer].view(-1, ng, width).index_select(0, rows)
                          .view(B, Lk, ng, width), q.dtype) for t in (0, 1))
    qg = q.index_select(0, g.queries.reshape(-1)).view(B, Lq, np_, hn)
    out = _grouped_sdpa(w, qg.transpose(1, 2), k_all, v_all, g.key_mask)  # [B_g, np, Lq, hn]
    return out.transpose(1, 2).reshape(B * Lq, np_, 1, hn)


def _grouped_sdpa(w: DecodeWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """``[B, np, Lq, hn]``: queries ``q [B, np, Lq, hn]`` over keys and values ``[B, Lk, ng,
    hn]`` under ``mask [B, Lq, Lk]`` (True: attend), with each key/value group's ``np / ng``
    query heads folded into the query axis (``[B, ng, np / ng Lq, hn]``; Megatron orders the
    query heads group by group): one key/value head per SDPA head, so neither ``enable_gqa``
    nor a repeat of K/V per query head (which send SDPA to its math path on a GPU, K/V copied
    ``np / ng`` times); the mask stays ``[B, 1, Lq, Lk]`` at ``Lq = 1`` (broadcast over the
    folded heads). Each query's dot products and softmax are the unfolded ones' (on CPU the
    kernel's blocking differs: logits within 1e-6, ``tests/unit/test_fast_decode.py``)."""
    if w.invariant:
        return bi.attention(q, k, v, mask, w.softmax_scale)
    B, np_, Lq, hn = q.shape
    ng = w.groups
    r = np_ // ng
    folded = q.reshape(B, ng, r * Lq, hn)
    if Lq > 1:  # each folded head's rows carry their query's mask row
        mask = mask.unsqueeze(1).expand(B, r, Lq, mask.shape[-1]).reshape(B, r * Lq, -1)
    out = F.scaled_dot_product_attention(folded, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask.unsqueeze(1), scale=w.softmax_scale)
    # reshape, not view: CUDA's fused kernels return [B, ng, r Lq, hn] laid out as
    # [B, r Lq, ng, hn] (heads innermost), which no view can regroup into [B, np, Lq, hn].
    return out.reshape(B, np_, Lq, hn)


def attention_backend(w: DecodeWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor) -> str:
    """The SDPA kernel :func:`_grouped_sdpa` gets for these inputs (``torch._fused_sdp_choice``:
    ``flash_attention``, ``efficient_attention``, ``math``, ...): what the GPU check records."""
    from torch.nn.attention import SDPBackend

    B, np_, Lq, hn = q.shape
    folded = q.reshape(B, w.groups, np_ // w.groups * Lq, hn)
    choice = torch._fused_sdp_choice(folded, k.transpose(1, 2), v.transpose(1, 2),
                                     mask.unsqueeze(1), 0.0, False, scale=w.softmax_scale)
    return SDPBackend(choice).name.lower()


def _act(w: DecodeWeights, h: torch.Tensor) -> torch.Tensor:
    if w.gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        return w.activation(gate) * (up + w.glu_offset if w.glu_offset else up)
    return w.activation(h)


def _dense(w: DecodeWeights, layer: DecodeLayer, y: torch.Tensor) -> torch.Tensor:
    return _reduce(_mm(w, _act(w, _mm(w, y, layer.w1)), layer.w2), w.tp_group)


def moe_only_step(w: DecodeWeights) -> None:
    """A decoding step of a rank with no request, under EP: its experts still serve the other
    ranks' tokens, one gather and one reduction per MoE layer, as theirs."""
    H = w.embedding.shape[1]
    y = w.embedding.new_zeros(0, 1, H)
    for layer in w.layers:
        if layer.router is not None:
            _moe_ep(w, layer, y)


def _moe_ep(w: DecodeWeights, layer: DecodeLayer, y: torch.Tensor):
    """``_moe`` under expert parallelism: every rank's ``ep_rows`` tokens gathered (this
    rank's ``B`` padded with zeros), routed alike on every rank (the router is replicated), this
    rank's experts run densely over all of them (an expert's weights are read once, as a
    decoding step's bandwidth wants; a token's weight is 0 for an expert it did not choose), and
    each rank receives its rows of every rank's partial sums (an all-to-all) and adds them. Two
    collectives per MoE layer and step, no host read (Megatron's all-to-all dispatcher exchanges counts on the
    host first)."""
    import torch.distributed as dist

    B, _, H = y.shape
    rows, group = w.ep_rows, w.ep_group
    mine = torch.zeros(rows, H, dtype=y.dtype, device=y.device)
    mine[:B] = y.view(-1, H)
    parts = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(parts, mine, group=group)
    tokens = torch.cat(parts)  # [ep rows, H]
    routing_probs, probs, top = _route(w, layer, tokens)
    first, count = w.local_experts
    weights = routing_probs[:, first:first + count]  # [T, E_l]
    # [ep rows, H]: this rank's experts' part (their F-shards summed over the expert TP group)
    out = _reduce(_invariant_experts(w, layer, tokens, top, probs, first, weights) if w.invariant
                  else _dense_experts(w, layer, tokens, weights), w.expert_tp_group)
    # each rank's rows of every rank's part (an all-to-all: ~0.34 ms on gloo where an all-reduce
    # of the whole takes ~0.61 ms), added here
    parts = torch.empty_like(out)
    dist.all_to_all_single(parts, out, group=group)
    rank = dist.get_rank(group)
    mine = parts.view(group.size(), rows, H).sum(dim=0)[:B]
    return mine.view(B, 1, H), top[rank * rows:rank * rows + B]


def _dense_experts(w: DecodeWeights, layer: DecodeLayer, tokens: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: every expert of ``layer.w1 / w2`` over every token, weighted by ``weights [T,
    E]`` (0 where a token did not choose the expert) and summed: ``E / k`` times the routed
    FLOPs, but each expert's weights read once and two batched GEMMs instead of a permutation,
    two grouped GEMMs and a scatter (a decoding step of a narrow model is its op count)."""
    x = tokens.unsqueeze(0).expand(weights.shape[1], -1, -1)  # [E, T, H]
    h = torch.bmm(x, layer.w1)  # [E, T, (2) F]
    h = (_act(w, h) * weights.t().unsqueeze(-1)).to(tokens.dtype)
    return torch.bmm(h, layer.w2).sum(dim=0)  # [T, H]


def _route(w: DecodeWeights, layer: DecodeLayer, tokens: torch.Tensor):
    """``(routing probs [T, E], probs [T, k], experts [T, k])`` of ``tokens [T, H]``: Megatron's
    router, gating in its router dtype, then ``topk_routing_with_score_function``'s softmax
    branch (its top-k indices kept: what R3 records)."""
    dtype = w.router_dtype or tokens.dtype
    logits = (bi.linear(tokens.to(dtype), layer.router.to(dtype)) if w.invariant
              else torch.mm(tokens.to(dtype), layer.router.to(dtype).t()))  # [T, E]
    if layer.logit_noise is not None:  # rollout.router_noise_std (a research control)
        logits = layer.logit_noise(logits)
    if w.pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        probs, top = torch.topk(scores, k=w.topk, dim=1)
    else:
        scores, top = torch.topk(logits, k=w.topk, dim=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    if w.scaling_factor:
        probs = probs * w.scaling_factor
    return torch.zeros_like(logits).scatter(1, top, probs), probs, top


def _moe(w: DecodeWeights, layer: DecodeLayer, y: torch.Tensor):
    """``(out [B, 1, H], top-k experts [B, k])``: Megatron's router (gating in its router dtype,
    ``topk_routing_with_score_function``'s softmax branch), dropless dispatch, grouped experts."""
    if w.ep_group is not None:
        return _moe_ep(w, layer, y)
    B, _, H = y.shape
    tokens = y.view(-1, H)  # [T, H]
    routing_probs, probs, top = _route(w, layer, tokens)
    if w.invariant:
        return _reduce(_invariant_experts(w, layer, tokens, top, probs, 0, routing_probs),
                       w.expert_tp_group).view(B, 1, H), top
    if routing_probs.shape[1] <= 2 * w.topk:  # at most twice the routed FLOPs: every expert
        out = _dense_experts(w, layer, tokens, routing_probs)
        return _reduce(out, w.expert_tp_group).view(B, 1, H), top
    if not w.grouped_mm or (torch.compiler.is_compiling() and tokens.dtype != torch.bfloat16):
        # torch._grouped_mm's shape function takes bf16 only (its CPU kernel any dtype), its
        # CUDA kernel bf16 on Hopper: otherwise each route multiplies its expert's gathered
        # weights (T k weight reads: the fp32 GPU and CPU compile-check path, not a fast one)
        x = tokens.unsqueeze(1).expand(-1, w.topk, -1).reshape(-1, 1, H)  # [T k, 1, H]
        h = torch.bmm(x, layer.w1.index_select(0, top.reshape(-1)))  # [T k, 1, (2) F]
        h = (_act(w, h) * probs.reshape(-1, 1, 1)).to(tokens.dtype)
        h = torch.bmm(h, layer.w2.index_select(0, top.reshape(-1)))  # [T k, 1, H]
        out = h.view(B, w.topk, H).sum(dim=1, keepdim=True)
        return _reduce(out, w.expert_tp_group), top
    routing_map = torch.zeros_like(routing_probs).int().scatter(1, top, 1).bool()
    permuted, permuted_probs, mapping = permute_without_host_reads(
        tokens, routing_map, routing_probs, tokens.shape[0] * w.topk)
    offs = routing_map.sum(dim=0).cumsum(0).to(torch.int32)
    h = (layer.fp8_w1(permuted, offs) if layer.fp8_w1 is not None  # [T k, (2) F]
         else torch._grouped_mm(permuted, layer.w1, offs=offs))
    h = (_act(w, h) * permuted_probs.unsqueeze(-1)).to(permuted.dtype)
    h = (layer.fp8_w2(h, offs) if layer.fp8_w2 is not None  # [T k, H]
         else torch._grouped_mm(h, layer.w2, offs=offs))
    out = torch.zeros_like(tokens).scatter_add_(0, mapping.unsqueeze(1).expand(-1, H), h)
    return _reduce(out, w.expert_tp_group).view(B, 1, H), top


def _invariant_experts(w: DecodeWeights, layer: DecodeLayer, tokens: torch.Tensor,
                       top: torch.Tensor, probs: torch.Tensor, first: int = 0,
                       weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, H]``: :func:`.batch_invariant.experts` over this rank's experts (from ``first``;
    ``weights [T, E_l]`` their routing probs), each expert's weights as ``F.linear`` takes them
    (``layer.w1 / w2`` hold transposed views)."""
    return bi.experts(tokens, top, probs, layer.w1.transpose(1, 2), layer.w2.transpose(1, 2),
                      lambda h, p: bi.scaled_activation(h, p, w.activation, w.gated, w.glu_offset,
                                                        tokens.dtype), first, weights)
