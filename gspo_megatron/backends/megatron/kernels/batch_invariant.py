"""Batch-invariant kernels (``precision.batch_invariant``): every per-token value computed in an
order that does not depend on which other tokens share the call, how many there are, whether the
row is packed or padded, or whether it runs in the rollout's decoding step or in the training
forward. The training forward (:mod:`.local`, :mod:`.moe`), the engine's prefill and decoding
step (:mod:`.decode`) and both log-prob paths (the engine's sampler, the trainer's scoring) call
these functions and no other implementation of the same op, so the rollout's log-probs and routes
are bitwise the trainer's by construction (``tests/unit/test_batch_invariant.py``).

Why each op needs it, on this project's CPU (``tools/bench/zero_mismatch.py --probe``):

* **matmul**: ``F.linear`` of ``m`` rows takes another kernel for ``m <= 3`` in fp32 (the row
  results differ in the last bits from the same rows inside a larger call). :func:`linear` runs
  every call as a ``bmm`` of fixed ``[ROW_TILE, K]`` tiles (the rows zero-padded to a multiple),
  so the library sees one shape and picks one blocking; a row's value does not depend on its
  tile's other rows or on its place in the tile (checked for every row count and shift).
* **attention**: SDPA over a KV cache (one query) and over a packed row (a causal block) reduce
  the keys in different orders. :func:`attention` reduces each query's keys in fixed chunks of
  ``KEY_CHUNK`` positions (the chunks' partial sums added left to right; chunks past the query's
  keys add exact zeros), the scores and the value sums of a (``QUERY_TILE`` queries,
  ``KEY_CHUNK`` keys) pair as GEMMs of one fixed shape (2 queries: the GQA groups of the tiny
  model exactly, no padded row in its decoding step).
* **log-softmax**: the engine's ``torch.log_softmax`` and the trainer's chunked log-sum-exp are
  different formulas. :func:`token_logprobs` is both: max (exact), ``exp`` and the sum in fixed
  vocabulary chunks of ``VOCAB_CHUNK`` added left to right.
* **experts**: a grouped GEMM's (or a dense ``bmm``'s) blocking follows the tokens per expert.
  :func:`expert_linear` runs each expert's rows in whole ``ROW_TILE`` tiles (one ``bmm`` of one
  shape for all experts), and :func:`experts` adds a token's ``k`` expert outputs in ascending
  expert index.
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

import torch
import torch.nn.functional as F

ROW_TILE = 32
"""Rows per matmul tile (:func:`linear`): every GEMM is ``[ROW_TILE, K] x [K, N]``."""
KEY_CHUNK = 16
"""Key positions per attention chunk (:func:`attention`)."""
QUERY_TILE = 2
"""Query rows (of one key head) per attention tile (:func:`attention`)."""
VOCAB_CHUNK = 256
"""Vocabulary columns per log-sum-exp chunk (:func:`token_logprobs`)."""


def enabled(config) -> bool:
    """Whether ``config`` (Megatron's ``TransformerConfig``, tagged by the model builder) runs the
    batch-invariant kernels."""
    return bool(getattr(config, "batch_invariant", False))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``), computed as
    one ``bmm`` over tiles of :data:`ROW_TILE` rows: the same GEMM shape whatever the row count.
    Differentiable: the backward is ``F.linear``'s (the same two matmuls; only the forward's
    values must be invariant, a gradient is a gradient of the same function)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Linear.apply(x, weight)
    return _linear(x, weight)


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
    """:func:`_attention` (see there); differentiable, the backward SDPA's on the same inputs
    (the same function: only the forward's values must be invariant)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Attention.apply(q, k, v, allowed, scale)
    return _attention(q, k, v, allowed, scale)


class _Attention(torch.autograd.Function):
    """:func:`_attention` forward; backward through ``F.scaled_dot_product_attention``
    recomputed on the saved inputs (a query without any key, whose output is 0, is given every
    key there: none occurs in a causal row)."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale):
        ctx.save_for_backward(q, k, v, allowed)
        ctx.scale = scale
        return _attention(q, k, v, allowed, scale)

    @staticmethod
    def backward(ctx, grad):
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
    total, out = sums[..., 0], pv[:, :, :, 0]
    for c in range(1, nc):  # fixed order: chunk after chunk
        total, out = total + sums[..., c], out + pv[:, :, :, c]
    out = out.reshape(B, ng, nq * QUERY_TILE, hn)[:, :, :rows]
    total = total[:, :, :rows].unsqueeze(-1)
    out = out / torch.where(total > 0, total, torch.ones_like(total))
    return out.reshape(B, np_, Lq, hn).to(q.dtype)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     starts: list[int], scale: float) -> torch.Tensor:
    """Causal attention of a packed row through :func:`attention`: ``query [S, np, hn]``,
    ``key/value [S, ng, hn]``, the segments starting at ``starts`` (``[m + 1]`` host ints, the
    last the row's end) each attending only to itself -> ``[S, np, hn]``. Segments are grouped
    by length (at most 2x padding); every query reads its segment's keys at their positions."""
    from gspo_megatron.backends.megatron.kernels.row_attention import length_groups

    device = query.device
    lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    out = torch.empty_like(query)
    for members in length_groups(lens):
        longest = max(lens[i] for i in members)
        t = torch.arange(longest, device=device)
        first = torch.tensor([starts[i] for i in members], device=device)
        n = torch.tensor([lens[i] for i in members], device=device)
        valid = t[None, :] < n[:, None]  # [n_g, L]
        index = torch.where(valid, first[:, None] + t[None, :], first[:, None])  # pads: 1st token
        q = query[index].transpose(1, 2)  # [n_g, np, L, hn]
        causal = (t[None, :] <= t[:, None])[None] & valid[:, None, :]  # [n_g, L, L]
        o = attention(q, key[index], value[index], causal, scale)  # [n_g, np, L, hn]
        out[index[valid]] = o.transpose(1, 2)[valid]
    return out


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab: int | None = None,
                   temperature: float = 1.0, compute_entropy: bool = False):
    """``(logprobs [N], entropy [N] or None)`` fp32 of ``target [N]`` under
    ``logits [N, V'] / temperature`` over the first ``vocab`` columns (all: None), the columns
    padded with ``-inf`` to a multiple of :data:`VOCAB_CHUNK`: ``m`` = the row max (exact),
    ``S`` = the sums of ``exp(l - m)`` per chunk added chunk after chunk, ``logp = (l_y - m) -
    log S``; entropy ``log S - sum_j e_j (l_j - m) / S``. Differentiable."""
    n = logits.shape[0]
    vocab = logits.shape[1] if vocab is None else vocab
    x = logits[:, :vocab].float()
    if temperature != 1.0:
        x = x / temperature
    pad = (-vocab) % VOCAB_CHUNK
    if pad:
        x = torch.cat((x, x.new_full((n, pad), float("-inf"))), dim=1)
    m = x.detach().amax(-1, keepdim=True)
    shifted = x - m  # [N, V]
    e = torch.exp(shifted)
    total = x.new_zeros(n)
    spread = x.new_zeros(n) if compute_entropy else None
    for c in range(x.shape[1] // VOCAB_CHUNK):
        cols = slice(c * VOCAB_CHUNK, (c + 1) * VOCAB_CHUNK)
        total = total + e[:, cols].contiguous().sum(-1)
        if compute_entropy:  # e x with x = -inf where e = 0: the product taken as 0
            ex = torch.where(e[:, cols] > 0, e[:, cols] * shifted[:, cols], 0.0)
            spread = spread + ex.contiguous().sum(-1)
    log_total = torch.log(total)
    lp = shifted.gather(-1, target.long().view(-1, 1)).squeeze(-1) - log_total
    return lp, (log_total - spread / total if compute_entropy else None)


def scaled_activation(h: torch.Tensor, probs: torch.Tensor, activation, gated: bool,
                      offset: float, dtype: torch.dtype) -> torch.Tensor:
    """``probs * act(h)`` (SwiGLU when ``gated``: ``act(gate) * (up + offset)``), ``h [n, (2)F]``,
    ``probs [n]`` -> ``[n, F]`` in ``dtype``: Megatron's ``MLP`` with ``per_token_scale``, the one
    expert activation of the training forward and the decoding step."""
    if gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        h = activation(gate) * (up + offset)
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


def experts(tokens: torch.Tensor, top: torch.Tensor, probs: torch.Tensor, fc1: torch.Tensor,
            fc2: torch.Tensor, activate, first: int = 0) -> torch.Tensor:
    """``[T, H]``: each token's ``k`` chosen experts (``top [T, k]`` global ids, ``probs [T, k]``)
    over ``tokens [T, H]``, of the experts ``first .. first + E_l - 1`` here (the others'
    routes skipped: EP), through :func:`expert_linear` (``fc1 [E_l, (2)F, H]``, ``fc2 [E_l, H,
    F]``, ``F.linear``'s layout), ``activate(h [n, (2)F], p [n]) -> [n, F]``; a token's outputs
    added in ascending expert index, starting from zero. Megatron's ``unpermute`` in the
    training forward adds the same outputs in the same order (the dispatcher's expert-major
    rows, scattered in order)."""
    T, H = tokens.shape
    k = top.shape[1]
    ordered = torch.sort(top, dim=1, stable=True)
    flat = ordered.values.reshape(-1)  # route t k + j: token t's j-th smallest expert
    flat_probs = probs.gather(1, ordered.indices).reshape(-1)
    local = flat - first
    here = (local >= 0) & (local < fc1.shape[0])
    key = torch.where(here, local, fc1.shape[0])  # the other ranks' routes last
    routes = torch.argsort(key, stable=True)  # expert-major, token order within an expert
    counts = torch.bincount(key, minlength=fc1.shape[0] + 1)[:fc1.shape[0]].tolist()
    routes = routes[:sum(counts)]
    rows = tokens.index_select(0, routes // k)
    h = activate(expert_linear(rows, counts, fc1), flat_probs.index_select(0, routes))
    per_route = tokens.new_zeros(T * k, H).index_copy(0, routes, expert_linear(h, counts, fc2))
    per_route = per_route.view(T, k, H)
    out = torch.zeros_like(tokens)  # (from zero, as unpermute's scatter-add: the same signed zeros)
    for j in range(k):  # fixed order: ascending expert index
        out = out + per_route[:, j]
    return out
