"""Batch-invariant kernels (``precision.batch_invariant``): every per-token value computed in an
order that does not depend on which other tokens share the call, how many there are, whether the
row is packed or padded, or whether it runs in the rollout's decoding step or in the training
forward. The training forward (:mod:`.local`, :mod:`.moe`), the engine's prefill and decoding
step (:mod:`.decode`) and both log-prob paths (the engine's sampler, the trainer's scoring) call
these functions and no other implementation of the same op, so the rollout's log-probs and routes
are bitwise the trainer's by construction (``tests/unit/test_batch_invariant.py``).

Why each op needs it, on this project's CPU (``tools/bench/zero_mismatch.py``'s probe rows), and
its two forms: on CUDA fixed GEMM tiles (one shape per op whatever the batch); on CPU the cheaper
forms that the CPU's GEMM allows (``test_cpu_gemm_values_do_not_depend_on_the_shape`` checks what
they rest on, on the machine and thread count running it: MKL's GEMM values in ``F.linear``'s
layout depend neither on the row count from a few rows up, nor on the column count, nor on a
row's place).

* **matmul**: ``F.linear`` of ``m`` rows takes another kernel for ``m <= 3`` in fp32 (the row
  results differ in the last bits from the same rows inside a larger call). :func:`linear`: on
  CPU one ``F.linear``, the rows zero-padded to :data:`ROW_TILE` when fewer; on CUDA a ``bmm``
  of fixed ``[ROW_TILE, K]`` tiles (the rows zero-padded to a multiple), so the library sees one
  shape and picks one blocking (checked for every row count and shift).
* **attention**: SDPA over a KV cache (one query) and over a packed row (a causal block) reduce
  the keys in different orders. :func:`attention` reduces each query's keys in fixed chunks
  (the chunks' partial sums added in one fixed pairwise order, :func:`_tree_sum`; chunks past the
  query's keys add exact zeros).
  CUDA: the scores and the value sums of a (``QUERY_TILE`` queries, ``KEY_CHUNK`` keys) pair as
  GEMMs of one fixed shape. CPU (:func:`_cpu_attention`): a key head's query rows times all its
  keys as one GEMM, then ``p v`` per chunk of ``CPU_KEY_CHUNK`` keys as one GEMM of that fixed
  contraction (a GEMM's sum over its contraction does depend on its length: that is why the
  keys are chunked, not the queries); the decoding step gathers its cached keys and values in
  the layout these GEMMs read (:func:`key_window`).
* **log-softmax**: the engine's ``torch.log_softmax`` and the trainer's chunked log-sum-exp are
  different formulas. :func:`token_logprobs` is both: max (exact), ``exp`` and the sum in fixed
  vocabulary chunks of ``VOCAB_CHUNK``, the chunks' sums added in one fixed order
  (:func:`_tree_sum`, as attention's chunks).
* **experts**: a grouped GEMM's (or a dense ``bmm``'s) blocking follows the tokens per expert.
  :func:`expert_mlp` / :func:`expert_linear` run each expert's rows in whole ``ROW_TILE`` tiles
  (CUDA: one ``bmm`` of one shape for all experts; CPU: one grouped GEMM, an expert's rows
  padded to ``ROW_TILE`` when fewer), and :func:`experts` adds a token's ``k`` expert outputs in
  ascending expert index (on CPU with few experts the decoding step runs every expert over
  every token, :func:`_dense_experts`, the same GEMM rows).
* **router**: its gating GEMM through :func:`linear`; the softmax and ``torch.topk`` that follow
  are per row (the same function of a row in Megatron's router and the decoding step: ties
  go the same way in both; that they go to the lower expert index is ``torch.topk``'s behaviour,
  not enforced here).
* RMSNorm, the QK-norm, RoPE, the activation and the embedding are per row or elementwise
  already: both paths call the same module or op.

The constants are fixed, not tunable per call: a tile or chunk size that differed between the
rollout and the trainer would break the equality.
"""

from __future__ import annotations

import itertools
import types

import torch
import torch.nn.functional as F

ROW_TILE = 32
"""Rows per matmul tile (:func:`linear`): every GEMM is ``[ROW_TILE, K] x [K, N]``."""
KEY_CHUNK = 16
"""Key positions per attention chunk (:func:`attention`)."""
QUERY_TILE = 2
"""Query rows (of one key head) per attention tile (:func:`attention`)."""
CPU_KEY_CHUNK = 32
"""CPU (:func:`_cpu_attention`): key positions per chunk (the ``p v`` GEMMs' contraction)."""
CPU_QUERY_TILE = 4
"""CPU (:func:`_cpu_attention`): a key head's query rows padded up to this when fewer (MKL's
GEMM rows are invariant from 4 rows up)."""
VOCAB_CHUNK = 256
"""Vocabulary columns per log-sum-exp chunk (:func:`token_logprobs`)."""


def enabled(config) -> bool:
    """Whether ``config`` (Megatron's ``TransformerConfig``, tagged by the model builder) runs the
    batch-invariant kernels."""
    return bool(getattr(config, "batch_invariant", False))


def cpu_forms(t: torch.Tensor) -> bool:
    """Whether the kernels take their CPU forms for ``t`` (on CPU; the fixed tiles elsewhere)."""
    return t.device.type == "cpu"


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``): on CPU
    :func:`_padded_linear`; elsewhere one ``bmm`` over tiles of :data:`ROW_TILE` rows, the same
    GEMM shape whatever the row count. Differentiable: the backward is ``F.linear``'s (the same
    two matmuls; only the forward's values must be invariant, a gradient is a gradient of the
    same function)."""
    if cpu_forms(x):
        return _padded_linear(x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Linear.apply(x, weight)
    return _linear(x, weight)


def _padded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """CPU :func:`linear`: one GEMM, the rows zero-padded to :data:`ROW_TILE` when fewer (MKL
    takes another kernel for a block of 1 to 3 rows, and with several threads it splits a
    call's rows among them; from :data:`ROW_TILE` rows up a row's values do not depend on the
    row count, measured at 1, 2, 8 and 16 threads:
    ``test_cpu_gemm_values_do_not_depend_on_the_shape``). Differentiable by autograd (the pad
    rows' gradients are dropped by the slice)."""
    n = x.numel() // x.shape[-1] if x.numel() else 0
    if n >= ROW_TILE or n == 0:
        return F.linear(x, weight.to(x.dtype))
    lead, k = x.shape[:-1], x.shape[-1]
    rows = torch.cat((x.reshape(-1, k), x.new_zeros(ROW_TILE - n, k)))
    return F.linear(rows, weight.to(x.dtype))[:n].reshape(*lead, weight.shape[0])


class _Linear(torch.autograd.Function):
    """:func:`_linear` forward, ``F.linear``'s backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight.to(g.dtype)).view(x.shape).to(x.dtype) \
            if ctx.needs_input_grad[0] else None
        grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = rows.shape[0]
    pad = (-n) % ROW_TILE
    if pad or n == 0:
        rows = torch.cat((rows, rows.new_zeros(pad if n else ROW_TILE, k)))
    tiles = rows.view(-1, ROW_TILE, k)  # [n / T, T, K]
    w = weight.t().to(x.dtype).unsqueeze(0).expand(tiles.shape[0], -1, -1)  # [n / T, K, N]
    out = torch.bmm(tiles, w).view(-1, weight.shape[0])[:n]
    return out.reshape(*lead, weight.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              scale: float) -> torch.Tensor:
    """:func:`_attention` (see there); differentiable (only the forward's values must be
    invariant: a gradient is a gradient of the same function). The backward: on CPU from the
    forward's saved softmax weights (:func:`_cpu_attention_backward`), elsewhere SDPA's on the
    same inputs."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Attention.apply(q, k, v, allowed, scale)
    return _forward_attention(q, k, v, allowed, scale)


def _forward_attention(q, k, v, allowed, scale):
    """:func:`_cpu_attention` on CPU, :func:`_attention` (fixed GEMM tiles) elsewhere."""
    return (_cpu_attention if cpu_forms(q) else _attention)(q, k, v, allowed, scale)


class _Attention(torch.autograd.Function):
    """:func:`_attention` forward. Backward: on CPU :func:`_cpu_attention_backward` (the
    forward's weights saved: no recomputation); elsewhere ``F.scaled_dot_product_attention``
    recomputed on the saved inputs (memory: no ``[Lq, Lk]`` weights held; a query without any
    key, whose output is 0, is given every key there: none occurs in a causal row)."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale):
        ctx.scale = scale
        ctx.cpu = cpu_forms(q)
        if ctx.cpu:
            out, saved = _cpu_attention(q, k, v, allowed, scale, keep_weights=True)
            ctx.save_for_backward(*saved)
            ctx.shapes = (q.shape, q.dtype, k.shape, k.dtype, v.dtype)
            return out
        ctx.save_for_backward(q, k, v, allowed)
        return _attention(q, k, v, allowed, scale)

    @staticmethod
    def backward(ctx, grad):
        if ctx.cpu:
            return (*_cpu_attention_backward(grad, *ctx.saved_tensors, ctx.scale, *ctx.shapes),
                    None, None)
        q, k, v, allowed = ctx.saved_tensors
        mask = allowed | ~allowed.any(-1, keepdim=True)
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need)
                      for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            out = F.scaled_dot_product_attention(
                inputs[0], inputs[1].transpose(1, 2), inputs[2].transpose(1, 2),
                attn_mask=mask.unsqueeze(1), scale=ctx.scale,
                enable_gqa=q.shape[1] != k.shape[2])
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)


def _cpu_attention_backward(grad, qf, kf, vt, p, scale, q_shape, q_dtype, k_shape, k_dtype,
                            v_dtype):
    """``(dq, dk, dv)`` of :func:`_cpu_attention` from its saved ``qf [B, ng, R, hn]``, ``kf
    [B, ng, Lk, hn]``, ``vt [B, ng, nc, hn, C]`` (fp32) and weights ``p [B, ng, R, Lk]``, per
    key head:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dP P))``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q`` (the pad rows' and pad keys' gradients dropped)."""
    B, np_, Lq, hn = q_shape
    ng, R, Lk = qf.shape[1], qf.shape[2], kf.shape[2]
    rows = np_ // ng * Lq
    do = grad.float().reshape(B, ng, rows, hn)
    if rows < R:
        do = torch.cat((do, do.new_zeros(B, ng, R - rows, hn)), dim=2)
    do, P = do.reshape(B * ng, R, hn), p.view(B * ng, R, Lk)
    dv = torch.bmm(P.transpose(1, 2), do)  # [B ng, Lk, hn]
    vT = vt.transpose(2, 3).reshape(B * ng, hn, Lk)  # [B ng, hn, Lk]
    dp = torch.bmm(do, vT)  # [B ng, R, Lk]
    ds = P * (dp - (dp * P).sum(-1, keepdim=True)) * scale
    dq = torch.bmm(ds, kf.view(B * ng, Lk, hn)).view(B, ng, R, hn)[:, :, :rows]
    dk = torch.bmm(ds.transpose(1, 2), qf.view(B * ng, R, hn))  # [B ng, Lk, hn]

    def keys(t, dtype):  # [B ng, Lk, hn] -> the keys' layout [B, L, ng, hn]
        return t.view(B, ng, Lk, hn)[:, :, :k_shape[1]].permute(0, 2, 1, 3).to(dtype)

    return dq.reshape(q_shape).to(q_dtype), keys(dk, k_dtype), keys(dv, v_dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               scale: float) -> torch.Tensor:
    """``[B, np, Lq, hn]``: queries ``q [B, np, Lq, hn]`` over keys and values ``k, v [B, Lk, ng,
    hn]`` (key ``j`` of row ``b`` at position ``j`` of its sequence; masked slots must hold
    finite values) under ``allowed [B, Lq | 1, Lk]`` (True: attend); query head ``i`` reads key
    head ``i // (np / ng)`` (Megatron's order). Each query's value depends only on its own
    vector, its keys and values by position and the constants. In fp32 (the output in ``q``'s
    dtype), with each key head's query rows in tiles of :data:`QUERY_TILE` and its keys in chunks
    of :data:`KEY_CHUNK` (both zero-padded): the scores of a (tile, chunk) as one fixed
    ``[QUERY_TILE, hn] x [hn, KEY_CHUNK]`` GEMM, ``m`` = a query's max score (exact), ``p =
    exp(s - m)`` (exact zeros where masked), a chunk's sum of ``p`` a fixed-length reduction and
    its ``p v`` a fixed ``[QUERY_TILE, KEY_CHUNK] x [KEY_CHUNK, hn]`` GEMM, the chunks added one
    after the other (those past a query's keys add exact zeros)."""
    B, np_, Lq, hn = q.shape
    Lk, ng = k.shape[1], k.shape[2]
    r = np_ // ng
    pad = (-Lk) % KEY_CHUNK
    if pad:  # masked slots: zero keys and values (finite), not allowed
        k = torch.cat((k, k.new_zeros(B, pad, ng, hn)), dim=1)
        v = torch.cat((v, v.new_zeros(B, pad, ng, hn)), dim=1)
        allowed = torch.cat((allowed, allowed.new_zeros(*allowed.shape[:2], pad)), dim=2)
    Lk = k.shape[1]
    nc = Lk // KEY_CHUNK
    rows = r * Lq  # each key head's query rows: head j of its group, query l at j Lq + l
    qpad = (-rows) % QUERY_TILE
    nq = (rows + qpad) // QUERY_TILE
    allowed = allowed.expand(B, Lq, Lk)
    mask = allowed.unsqueeze(1).expand(B, r, Lq, Lk).reshape(B, 1, rows, Lk)
    qf = q.float().reshape(B, ng, rows, hn)
    if qpad:  # pad rows: zero queries that attend every slot (finite; dropped at the end)
        qf = torch.cat((qf, qf.new_zeros(B, ng, qpad, hn)), dim=2)
        mask = torch.cat((mask, mask.new_ones(B, 1, qpad, Lk)), dim=2)
    kf = k.float().permute(0, 2, 1, 3)  # [B, ng, Lk, hn]
    vf = v.float().permute(0, 2, 1, 3)
    # [B ng nq nc] fixed GEMMs: each (query tile, key chunk) pair
    qt = qf.reshape(B, ng, nq, 1, QUERY_TILE, hn).expand(B, ng, nq, nc, QUERY_TILE, hn)
    kt = kf.reshape(B, ng, 1, nc, KEY_CHUNK, hn).expand(B, ng, nq, nc, KEY_CHUNK, hn)
    s = torch.bmm(qt.reshape(-1, QUERY_TILE, hn), kt.reshape(-1, KEY_CHUNK, hn).transpose(1, 2))
    s = s.view(B, ng, nq, nc, QUERY_TILE, KEY_CHUNK).permute(0, 1, 2, 4, 3, 5)
    s = s.reshape(B, ng, nq * QUERY_TILE, Lk) * scale  # [B, ng, rows', Lk], key order
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a query with no key: output 0
    p = torch.exp(s - m)  # [B, ng, rows', Lk]
    sums = p.view(B, ng, nq * QUERY_TILE, nc, KEY_CHUNK).sum(-1)  # [B, ng, rows', nc]
    pt = p.view(B, ng, nq, QUERY_TILE, nc, KEY_CHUNK).permute(0, 1, 2, 4, 3, 5)
    vt = vf.reshape(B, ng, 1, nc, KEY_CHUNK, hn).expand(B, ng, nq, nc, KEY_CHUNK, hn)
    pv = torch.bmm(pt.reshape(-1, QUERY_TILE, KEY_CHUNK), vt.reshape(-1, KEY_CHUNK, hn))
    pv = pv.view(B, ng, nq, nc, QUERY_TILE, hn)
    total, out = _tree_sum(sums, 3), _tree_sum(pv, 3)  # the chunks in one fixed order
    out = out.reshape(B, ng, nq * QUERY_TILE, hn)[:, :, :rows]
    total = total[:, :, :rows].unsqueeze(-1)
    out = out / torch.where(total > 0, total, torch.ones_like(total))
    return out.reshape(B, np_, Lq, hn).to(q.dtype)


def key_window(keys: int, t: torch.Tensor) -> int:
    """The key window :func:`attention` computes over for ``keys`` keys of tensors like ``t``:
    whole chunks on CPU (:data:`CPU_KEY_CHUNK`). A caller that gathers its keys and values
    head-major (``[B, ng, window, hn]``, passed as their ``[B, window, ng, hn]`` transposed
    views, the slots past its keys finite and not allowed) spares the kernel their copies."""
    return keys + (-keys) % CPU_KEY_CHUNK if cpu_forms(t) else keys


def _head_major(t: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, ng, window, hn]`` fp32 contiguous of the keys ``t [B, L, ng, hn]`` (zero slots
    added past ``L``): a view of ``t`` where it was gathered so (:func:`key_window`), else a
    copy."""
    t = t.float().permute(0, 2, 1, 3)
    if t.shape[2] < window:
        t = F.pad(t, (0, 0, 0, window - t.shape[2]))
    return t.contiguous()


def _chunked_values(t: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, ng, nc, hn, CPU_KEY_CHUNK]`` fp32 contiguous of the values ``t [B, L, ng, hn]``
    (zero slots added past ``L``): each key chunk's values transposed, the ``p v`` GEMM's
    second operand in ``F.linear``'s layout; a view of ``t`` where it was gathered so
    (``[B, ng, hn, window]``, one chunk), else a copy."""
    B, _, ng, hn = t.shape
    t = t.float().permute(0, 2, 3, 1)  # [B, ng, hn, L]
    if t.shape[3] < window:
        t = F.pad(t, (0, window - t.shape[3]))
    return t.view(B, ng, hn, -1, CPU_KEY_CHUNK).transpose(2, 3).contiguous()


def _cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   scale: float, keep_weights: bool = False):
    """CPU :func:`_attention` (same arguments and result; its own order and constants), laid
    out so that the GEMMs read their operands in place. Per key head: its query rows (``np /
    ng Lq``, zero rows added up to :data:`CPU_QUERY_TILE`) times its keys (zero keys added up
    to whole :data:`CPU_KEY_CHUNK` chunks) as one GEMM of contraction ``hn`` (a score is the
    same bits whatever the other rows and keys: MKL's GEMM values do not depend on the row and
    column counts from 4 rows up, nor on a row's place,
    ``test_cpu_gemm_values_do_not_depend_on_the_shape``); the scores scaled, the most negative
    float added where masked, ``torch.softmax`` over the row (a masked key's weight is an exact
    zero, and a row's weights do not depend on how many masked chunks follow its keys nor on
    the other rows: ``test_cpu_softmax_values_do_not_depend_on_the_masked_chunks``); per key
    chunk ``p v`` as one GEMM of contraction :data:`CPU_KEY_CHUNK` (:func:`_chunked_values`),
    the chunks' results added by :func:`_tree_sum` (those past a query's keys add exact
    zeros). A query without keys gets every key's equal weight (finite). ``keep_weights``:
    ``(out, (qf, kf, vt, p))``, what :func:`_cpu_attention_backward` reads."""
    B, np_, Lq, hn = q.shape
    ng = k.shape[2]
    r = np_ // ng
    rows = r * Lq  # each key head's query rows: head j of its group, query l at j Lq + l
    Lk = key_window(k.shape[1], q)
    nc = Lk // CPU_KEY_CHUNK
    kf, vt = _head_major(k, Lk), _chunked_values(v, Lk)  # [B, ng, Lk, hn], [.., nc, hn, C]
    # [B | 1, Lq | 1, Lk]: 0 where attended, the most negative float where not (finite: a row
    # without keys stays finite)
    bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    if bias.shape[2] < Lk:
        bias = F.pad(bias, (0, Lk - bias.shape[2]), value=torch.finfo(torch.float32).min)
    qf = q.float().reshape(B, ng, rows, hn)
    if rows < CPU_QUERY_TILE:  # pad rows: zero queries (dropped at the end)
        qf = torch.cat((qf, qf.new_zeros(B, ng, CPU_QUERY_TILE - rows, hn)), dim=2)
    R = qf.shape[2]
    if Lq == 1:  # the decoding step: its one mask row for every query row, pad rows too
        bias, shape = bias.view(bias.shape[0], 1, 1, Lk), (B, ng, R, Lk)
    elif rows < R:  # each query's mask row for its heads' rows; pad rows attend every slot
        bias = bias.unsqueeze(1).expand(B, r, Lq, Lk).reshape(B, 1, rows, Lk)
        bias, shape = torch.cat((bias, bias.new_zeros(B, 1, R - rows, Lk)), 2), (B, ng, R, Lk)
    else:  # [B | 1, 1, 1, Lq | 1, Lk] over the scores' [B, ng, r, Lq, Lk]
        bias, shape = bias.view(bias.shape[0], 1, 1, *bias.shape[1:]), (B, ng, r, Lq, Lk)
    s = torch.bmm(qf.view(B * ng, R, hn), kf.view(B * ng, Lk, hn).transpose(1, 2))
    s.view(shape).mul_(scale).add_(bias)
    p = torch.softmax(s, dim=-1).view(B, ng, R, nc, CPU_KEY_CHUNK)
    pt = (p.view(B * ng, R, CPU_KEY_CHUNK) if nc == 1
          else p.transpose(2, 3).reshape(-1, R, CPU_KEY_CHUNK))  # [B ng nc, R, C]
    pv = torch.bmm(pt, vt.view(-1, hn, CPU_KEY_CHUNK).transpose(1, 2)).view(B, ng, nc, R, hn)
    out = _tree_sum(pv, 2)[:, :, :rows].reshape(B, np_, Lq, hn).to(q.dtype)
    if keep_weights:
        return out, (qf, kf, vt, p.view(B, ng, R, Lk))
    return out


def _tree_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` summed over ``dim`` (removed) in one fixed order: neighbours added pairwise, level
    after level (a zero added to an odd level's last), ``log2`` of the count in ops. Its value
    for a leading run of terms followed by zeros does not depend on how many zeros follow (a
    pair with a zero is its other term): the chunks past a query's keys, the vocabulary's
    padded chunk."""
    while t.shape[dim] > 1:
        if t.shape[dim] % 2:
            t = torch.cat((t, t.new_zeros(*t.shape[:dim], 1, *t.shape[dim + 1:])), dim)
        pairs = t.unflatten(dim, (t.shape[dim] // 2, 2))
        t = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return t.squeeze(dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``[n, np, L, hn]``: each of ``n`` right-padded rows' queries ``q [n, np, L, hn]`` over
    its keys at or before it (``k, v [n, ng, L, hn]``) through :func:`attention`: causal
    masking alone keeps a real query off the pads behind it (``row_attention.packed_sdpa``'s
    ``attend``)."""
    L = q.shape[2]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[None]  # [1, L, L]
    return attention(q, k.transpose(1, 2), v.transpose(1, 2), causal, scale)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     params, scale: float) -> torch.Tensor:
    """Causal attention of a packed row through :func:`attention`: ``query [S, np, hn]``,
    ``key/value [S, ng, hn]``, the segments of ``params`` (Megatron's ``PackedSeqParams``, or
    ``[m + 1]`` segment starts, the last the row's end) each attending only to itself -> ``[S,
    np, hn]``: ``row_attention.packed_sdpa``'s length groups and gathers (made once per
    microbatch), :func:`causal_attention` per group."""
    from gspo_megatron.backends.megatron.kernels.row_attention import packed_sdpa

    if isinstance(params, (list, tuple)):
        params = types.SimpleNamespace(cu_seqlens_q=torch.tensor(params),
                                       cu_seqlens_q_padded=None)
    return packed_sdpa(query, key, value, params, scale, attend=causal_attention)


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab: int | None = None,
                   temperature: float = 1.0, compute_entropy: bool = False):
    """``(logprobs [N], entropy [N] or None)`` fp32 of ``target [N]`` under
    ``logits [N, V'] / temperature`` over the first ``vocab`` columns (all: None): ``m`` = the
    row max (exact), ``S`` = :func:`_vocab_sum` of ``exp(l - m)``, ``logp = (l_y - m) - log
    S``; entropy ``log S - sum_j e_j (l_j - m) / S``. Differentiable."""
    vocab = logits.shape[1] if vocab is None else vocab
    x = logits[:, :vocab].float()
    if temperature != 1.0:
        x = x / temperature
    m = x.detach().amax(-1, keepdim=True)
    shifted = x - m  # [N, V]
    e = torch.exp(shifted)
    total = _vocab_sum(e)
    log_total = torch.log(total)
    lp = shifted.gather(-1, target.long().view(-1, 1)).squeeze(-1) - log_total
    if not compute_entropy:
        return lp, None
    # e x with x = -inf where e = 0: the product taken as 0
    spread = _vocab_sum(torch.where(e > 0, e * shifted, 0.0))
    return lp, log_total - spread / total


def _vocab_sum(t: torch.Tensor) -> torch.Tensor:
    """``[N]``: each row of ``t [N, V]`` summed in one fixed order: chunks of
    :data:`VOCAB_CHUNK` columns each summed (the last one's columns completed with zeros: the
    same values, so the same sum, as a wider row whose columns past ``V`` are zeros, such as a
    padded vocabulary's at ``-inf``), the chunks' sums added by :func:`_tree_sum`."""
    n, V = t.shape
    full = V - V % VOCAB_CHUNK
    sums = t[:, :full].reshape(n, full // VOCAB_CHUNK, VOCAB_CHUNK).sum(-1)  # [N, V / C]
    if full < V:
        tail = F.pad(t[:, full:], (0, VOCAB_CHUNK - (V - full)))  # [N, C]
        sums = torch.cat((sums, tail.sum(-1, keepdim=True)), dim=1)
    return _tree_sum(sums, 1)


def scaled_activation(h: torch.Tensor, probs: torch.Tensor, activation, gated: bool,
                      offset: float, dtype: torch.dtype) -> torch.Tensor:
    """``probs * act(h)`` (SwiGLU when ``gated``: ``act(gate) * (up + offset)``), ``h [n, (2)F]``,
    ``probs [n]`` -> ``[n, F]`` in ``dtype``: Megatron's ``MLP`` with ``per_token_scale``, the one
    expert activation of the training forward and the decoding step."""
    if gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        h = activation(gate) * (up + offset if offset else up)
    else:
        h = activation(h)
    return (h * probs.unsqueeze(-1)).to(dtype)


def expert_linear(x: torch.Tensor, counts: list[int], weights: torch.Tensor) -> torch.Tensor:
    """``[N, O]``: the rows ``x [N, K]``, grouped by expert (``counts[e]`` rows of expert ``e``,
    in order), each times its expert's ``weights[e] [O, K]`` (``F.linear``'s layout) as one
    ``bmm`` over tiles of :data:`ROW_TILE` rows of one expert each (each expert's rows
    zero-padded to whole tiles, its weight gathered per tile): the same GEMM shape for every
    row whatever the counts. Memory: a copy of an expert's weight per tile (fine on CPU; a GPU
    wants a grouped kernel with fixed tiles). Differentiable."""
    if cpu_forms(x):
        return _cpu_expert_linear(x, counts, weights)
    n, k = x.shape
    device = x.device
    # per tile (host ints: a handful of experts' tiles): its expert, first row and row limit
    experts_of, starts, limits, first = [], [], [], 0
    for e, c in enumerate(counts):
        for t in range(0, c, ROW_TILE):
            experts_of.append(e)
            starts.append(first + t)
            limits.append(first + c)
        first += c
    n_tiles = len(experts_of)
    if n_tiles == 0:
        return x.new_zeros(0, weights.shape[1]) + 0 * weights.sum()  # (a graph to the weights)
    expert_of_tile = torch.tensor(experts_of, device=device)
    slot = (torch.tensor(starts, device=device)[:, None]
            + torch.arange(ROW_TILE, device=device)[None, :])  # [tiles, T]: the row of a slot
    real = (slot < torch.tensor(limits, device=device)[:, None]).view(-1)
    index = torch.where(real, slot.view(-1), n)  # pads read the zero row n
    rows = torch.cat((x, x.new_zeros(1, k))).index_select(0, index)
    w = weights.index_select(0, expert_of_tile).to(x.dtype)  # [tiles, O, K]
    out = torch.bmm(rows.view(n_tiles, ROW_TILE, k), w.transpose(1, 2))
    return out.reshape(-1, weights.shape[1])[real]


def _cpu_expert_linear(x: torch.Tensor, counts: list[int], weights: torch.Tensor) -> torch.Tensor:
    """CPU :func:`expert_linear`: :func:`_grouped_rows`'s one grouped GEMM."""
    places, offs, rows = _expert_plan(counts, x.device)
    out = _grouped_rows(_padded_rows(x, places, rows), offs, weights)
    return out if places is None else out.index_select(0, places)


def _expert_plan(counts: list[int], device):
    """``(places [N] | None, offs [E] int32, rows)`` for :func:`_grouped_rows`: each expert's
    block of ``counts[e]`` rows taken to :data:`ROW_TILE` rows at least (an empty expert stays
    empty; ``offs``: the padded blocks' ends, ``rows`` the last), ``places`` the real rows'
    places in the padded layout (None where no expert needs padding)."""
    padded = [ROW_TILE if 0 < c < ROW_TILE else c for c in counts]
    ends = list(itertools.accumulate(padded))
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    rows = ends[-1] if ends else 0
    if padded == counts:
        return None, offs, rows
    places, start = [], 0
    for c, pc in zip(counts, padded):  # host ints: a handful of experts
        places += range(start, start + c)
        start += pc
    return torch.tensor(places, device=device), offs, rows


def _padded_rows(x: torch.Tensor, places, rows: int) -> torch.Tensor:
    """``[rows, ...]``: the rows of ``x [N, ...]`` at ``places`` of zeros (the padded layout of
    :func:`_expert_plan`; ``x`` itself where ``places`` is None). Differentiable."""
    if places is None:
        return x
    return x.new_zeros(rows, *x.shape[1:]).index_copy(0, places, x)


def _grouped_rows(x: torch.Tensor, offs, weights: torch.Tensor) -> torch.Tensor:
    """``[P, O]``: the rows ``x [P, K]`` (in the padded layout of :func:`_expert_plan`) through
    their experts' ``weights [E, O, K]`` as one grouped GEMM, on CPU one GEMM per expert, of
    ``ROW_TILE`` rows at least (MKL's row values do not depend on the row count from 4 up:
    ``test_cpu_gemm_values_do_not_depend_on_the_shape``). Differentiable."""
    return torch._grouped_mm(x, weights.to(x.dtype).transpose(1, 2), offs=offs)  # [P, O]


def expert_mlp(x: torch.Tensor, counts: list[int], probs: torch.Tensor, fc1: torch.Tensor,
               fc2: torch.Tensor, activate) -> torch.Tensor:
    """``[N, H]``: ``expert_linear(activate(expert_linear(x, counts, fc1), probs), counts,
    fc2)`` (``x [N, H]`` expert-major, ``probs [N]``, ``activate(h, p)`` row-wise); on CPU the
    rows padded once for both GEMMs (pad rows: zero inputs, zero probs; dropped at the end)."""
    if not cpu_forms(x):
        return expert_linear(activate(expert_linear(x, counts, fc1), probs), counts, fc2)
    places, offs, rows = _expert_plan(counts, x.device)
    h = activate(_grouped_rows(_padded_rows(x, places, rows), offs, fc1),
                 _padded_rows(probs, places, rows))
    out = _grouped_rows(h, offs, fc2)
    return out if places is None else out.index_select(0, places)


def _dense_experts(tokens: torch.Tensor, weights: torch.Tensor, fc1: torch.Tensor,
                   fc2: torch.Tensor, activate) -> torch.Tensor:
    """``[T, H]``: :func:`experts` with every local expert over every token (``E_l`` GEMMs of
    ``T`` rows, :data:`ROW_TILE` at least; ``E_l / k`` times the routed FLOPs, no permutation),
    ``weights [T, E_l]`` a token's prob for each local expert it chose, 0 for the others. A
    routed row's values are those of :func:`expert_mlp`'s GEMMs over the expert's routed rows
    (the same GEMM, row counts from 4 up); an unrouted row's activation is ``act(h) 0``, a zero
    (finite activations), and so are its outputs; a token's outputs are added from +0 in
    ascending expert index, its unrouted experts' zeros included (adding a zero to a sum
    started from +0 leaves its bits: the routed outputs' sum, as the training forward adds)."""
    T, H = tokens.shape
    E = fc1.shape[0]
    x = torch.cat((tokens, tokens.new_zeros(ROW_TILE - T, H))) if T < ROW_TILE else tokens
    Tp = x.shape[0]
    h = torch.bmm(x.expand(E, Tp, H), fc1.to(x.dtype).transpose(1, 2))  # [E, Tp, (2)F]
    p = weights.t()  # [E, T]
    if Tp > T:
        p = torch.cat((p, p.new_zeros(E, Tp - T)), dim=1)
    a = activate(h, p)  # [E, Tp, F] (row-wise: as over the routed rows)
    y = torch.bmm(a, fc2.to(x.dtype).transpose(1, 2))  # [E, Tp, H]
    out = torch.zeros_like(tokens)
    for e in range(E):  # fixed order: ascending expert index
        out = out + y[e, :T]
    return out


def experts(tokens: torch.Tensor, top: torch.Tensor, probs: torch.Tensor, fc1: torch.Tensor,
            fc2: torch.Tensor, activate, first: int = 0,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, H]``: each token's ``k`` chosen experts (``top [T, k]`` global ids, ``probs [T, k]``)
    over ``tokens [T, H]``, of the experts ``first .. first + E_l - 1`` here (the others'
    routes skipped: EP), through :func:`expert_mlp` (``fc1 [E_l, (2)F, H]``, ``fc2 [E_l, H,
    F]``, ``F.linear``'s layout), ``activate(h [n, (2)F], p [n]) -> [n, F]``; a token's outputs
    added in ascending expert index, starting from zero. Megatron's ``unpermute`` in the
    training forward adds the same outputs in the same order (the dispatcher's expert-major
    rows, scattered in order). On CPU with ``E_l <= 2 k``: :func:`_dense_experts`, over
    ``weights [T, E_l]`` (a token's prob for each local expert it chose, 0 for the others)
    where the caller has them."""
    T, H = tokens.shape
    k = top.shape[1]
    E = fc1.shape[0]
    if cpu_forms(tokens) and E <= 2 * k:
        if weights is None:
            local = top - first
            slot = torch.where((local >= 0) & (local < E), local, E)  # another rank's: col E
            weights = probs.new_zeros(T, E + 1).scatter_(1, slot, probs)[:, :E]
        return _dense_experts(tokens, weights, fc1, fc2, activate)
    ordered = torch.sort(top, dim=1, stable=True)
    flat = ordered.values.reshape(-1)  # route t k + j: token t's j-th smallest expert
    local = flat - first
    here = (local >= 0) & (local < fc1.shape[0])
    key = torch.where(here, local, fc1.shape[0])  # the other ranks' routes last
    routes = torch.argsort(key, stable=True)  # expert-major, token order within an expert
    counts = torch.bincount(key, minlength=fc1.shape[0] + 1)[:fc1.shape[0]].tolist()
    routes = routes[:sum(counts)]
    route_probs = probs.gather(1, ordered.indices).reshape(-1).index_select(0, routes)
    out_rows = expert_mlp(tokens.index_select(0, routes // k), counts, route_probs, fc1, fc2,
                          activate)
    per_route = tokens.new_zeros(T * k, H).index_copy(0, routes, out_rows).view(T, k, H)
    out = torch.zeros_like(tokens)  # (from zero, as unpermute's scatter-add: the same signed zeros)
    for j in range(k):  # fixed order: ascending expert index
        out = out + per_route[:, j]
    return out
