"""Per-token log-probabilities and entropy from vocab-parallel logits.

The LM head of a TP=k model leaves each rank with logits for V/k vocabulary entries. The log-prob of
the sampled token needs the global log-sum-exp, which costs two scalar all-reduces per token (max,
sum of exp) plus one for the target logit; the vocabulary is never gathered on one rank.

Memory: the logits are read in row chunks and up-cast to fp32 one chunk at a time into (at most)
two reusable ``[rows, V/k]`` fp32 buffers, every elementwise step in place; ``rows`` is
``chunk_size`` or fewer, so that the two buffers stay within a fifth of the logits tensor (see
:func:`_chunk_rows`). Forward holds no full-size copy of ``[B, T, V/k]``; backward recomputes the
softmax chunk by chunk from the saved per-token log-sum-exp and entropy and writes the gradient
(same dtype as the logits) straight into its output, so forward + backward peak at the gradient
plus at most ~0.2x the logits on top of the logits (``docs/benchmarks.md``). Backward needs no
communication; an unused output (the entropy, when it is detached) costs no backward work.

Temperature: rollouts sample from ``softmax(logits / temperature)``; the trainer must score tokens
under the same distribution, so logits are divided by the temperature here too.

Maths, with ``l = logits / temperature`` and ``p = softmax(l)`` over the *global* vocabulary:
    logp(y)      = l_y - logsumexp(l)
    H            = logsumexp(l) - sum_j p_j l_j
    d logp / d l = onehot(y) - p
    d H / d l_j  = -p_j (log p_j + H)
and ``d/d logits = (d/d l) / temperature``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


MIN_CHUNK_ELEMENTS = 1 << 22
"""Smallest fp32 chunk (elements) the working-set cap shrinks a chunk to: below ~16 MB the loop
overhead, not memory, is what matters."""


def _chunk_rows(n: int, local_vocab: int, chunk_size: int, logits_dtype: torch.dtype,
                compute_dtype: torch.dtype) -> int:
    """Rows per chunk: at most ``chunk_size``, and few enough that the two compute-dtype chunk
    buffers stay within a fifth of the logits tensor (so forward + backward, the gradient included,
    hold at most ~1.2x the logits on top of them; the rest of the 1.25x budget is per-token
    vectors), but never below ``MIN_CHUNK_ELEMENTS``."""
    in_bytes = torch.empty((), dtype=logits_dtype).element_size()
    work_bytes = torch.empty((), dtype=compute_dtype).element_size()
    cap = (n * in_bytes) // (10 * work_bytes)
    floor = -(-MIN_CHUNK_ELEMENTS // max(local_vocab, 1))
    return max(1, min(int(chunk_size), max(cap, floor)))


def _load_chunk(buf: torch.Tensor, logits: torch.Tensor, s: int, e: int, nreal: int,
                temperature: float) -> torch.Tensor:
    """``logits[s:e, :nreal] / temperature`` up-cast into the reusable buffer ``buf``. [C, nreal]"""
    chunk = buf[: e - s]
    chunk.copy_(logits[s:e, :nreal])
    if temperature != 1.0:
        chunk.div_(temperature)
    return chunk


class _VocabParallelLogProbs(torch.autograd.Function):
    """One pass over the logits in forward, one in backward, each through at most two reusable
    compute-dtype buffers of ``[rows, V/k]`` (see :func:`_chunk_rows`); every elementwise step is
    done in place in them. Padded vocabulary columns are never read: the real columns of this shard
    are a slice, and their gradient is zero.

    TP: each rank reduces its shard against its own per-token max ``m_r`` (so the chunk loop needs
    no communication); afterwards one MAX all-reduce gives the global max ``M`` and one SUM
    all-reduce combines ``[sum exp(l - m_r) w_r, w_r (sum exp(l - m_r)(l - m_r) + (m_r - M) s_r),
    target logit]`` with ``w_r = exp(m_r - M)``. Then, with ``S`` the global sum of exponentials
    relative to ``M``: ``logsumexp = M + log S`` and ``H = log S - Q / S``."""

    @staticmethod
    def forward(ctx, logits, target, temperature, tp_group, vocab_size, compute_entropy, chunk_size):
        # logits [N, V/k] (N = flattened tokens), target [N] global token ids.
        ctx.set_materialize_grads(False)
        n, local_vocab = logits.shape
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        vocab_start = rank * local_vocab
        nreal = local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - vocab_start))
        dtype = _compute_dtype(logits)
        device = logits.device
        rows = _chunk_rows(n, nreal, chunk_size, logits.dtype, dtype)

        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < local_vocab)
        in_real = owned & (local_target < nreal)
        safe_target = local_target.clamp(0, max(nreal - 1, 0))

        row_max = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        # [3, N]: sum exp(l - m_r), sum exp(l - m_r) (l - m_r), target logit (owning rank, else 0)
        sums = torch.zeros(3, n, dtype=dtype, device=device)
        if nreal > 0 and n > 0:
            buf = torch.empty(min(rows, n), nreal, dtype=dtype, device=device)
            buf2 = torch.empty_like(buf) if compute_entropy else None
            for s in range(0, n, rows):
                e = min(s + rows, n)
                chunk = _load_chunk(buf, logits, s, e, nreal, temperature)
                m = chunk.amax(-1)
                row_max[s:e] = m
                sums[2, s:e] = chunk.gather(-1, safe_target[s:e, None]).squeeze(-1)
                chunk.sub_(m[:, None])                         # x = l - m_r  (<= 0)
                if compute_entropy:
                    ex = torch.exp(chunk, out=buf2[: e - s])
                    sums[0, s:e] = ex.sum(-1)
                    sums[1, s:e] = ex.mul_(chunk).sum(-1)      # sum exp(x) x
                else:
                    sums[0, s:e] = chunk.exp_().sum(-1)
        # The target logit: -inf for a padded-vocabulary target, 0 on ranks that do not own it.
        sums[2] = torch.where(in_real, sums[2], torch.where(owned, float("-inf"), 0.0))

        local_max = row_max.clone()
        _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            w = torch.exp(local_max - row_max)                  # 0 where this rank has no real vocab
            shift = torch.where(w > 0, (local_max - row_max) * sums[0], torch.zeros_like(w))
            sums[1] = w * sums[1] + w * shift
            sums[0] = w * sums[0]
            _all_reduce(sums, dist.ReduceOp.SUM, tp_group)

        logsumexp = row_max + torch.log(sums[0])
        logprobs = sums[2] - logsumexp
        entropy = torch.log(sums[0]) - sums[1] / sums[0] if compute_entropy else None

        ctx.save_for_backward(logits, target, logsumexp, entropy if compute_entropy else logsumexp)
        ctx.params = (temperature, vocab_start, nreal, compute_entropy, rows)
        if compute_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros_like(logprobs)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, target, logsumexp, entropy = ctx.saved_tensors
        temperature, vocab_start, nreal, compute_entropy, rows = ctx.params
        use_entropy = compute_entropy and grad_entropy is not None
        if grad_logprobs is None and not use_entropy:
            return None, None, None, None, None, None, None
        n, local_vocab = logits.shape
        dtype = _compute_dtype(logits)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(n, dtype=dtype, device=logits.device)
        grad_logprobs = grad_logprobs.to(dtype)
        grad = torch.empty_like(logits)
        if nreal < local_vocab:
            grad[:, nreal:] = 0
        if nreal == 0 or n == 0:
            return grad, None, None, None, None, None, None
        local_target = target - vocab_start
        in_real = (local_target >= 0) & (local_target < nreal)
        safe_target = local_target.clamp(0, nreal - 1)
        picked = torch.where(in_real, grad_logprobs, torch.zeros_like(grad_logprobs))
        if use_entropy:
            grad_entropy = grad_entropy.to(dtype)
        buf = torch.empty(min(rows, n), nreal, dtype=dtype, device=logits.device)
        buf2 = torch.empty_like(buf)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            logp = _load_chunk(buf, logits, s, e, nreal, temperature)
            logp.sub_(logsumexp[s:e, None])                   # log p
            g = torch.exp(logp, out=buf2[: e - s])            # p
            if use_entropy:
                # d/dl_j = -p_j (gL + gH (log p_j + H)) + onehot_j gL
                logp.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None])
                logp.add_(grad_logprobs[s:e, None])
                g.mul_(logp).neg_()
            else:
                g.mul_(grad_logprobs[s:e, None].neg())        # d logp / d l = onehot - p
            g.scatter_add_(-1, safe_target[s:e, None], picked[s:e, None])
            if temperature != 1.0:
                g.div_(temperature)
            grad[s:e, :nreal].copy_(g)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    compute_entropy: bool = True,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``target`` and the entropy of the sampling distribution.

    Args:
        logits: ``[..., V/k]`` this rank's vocabulary shard (any float dtype); not modified.
        target: ``[...]`` global token ids whose log-probs are wanted.
        temperature: the rollout's sampling temperature (> 0).
        tp_group: the tensor-parallel group the vocabulary is split over (None = unsplit).
        vocab_size: the real vocabulary size; padded entries beyond it are excluded (-inf).
        compute_entropy: also return the per-token entropy (one more fused reduction).
        chunk_size: tokens per fp32 chunk; bounds the extra memory to ``chunk_size x V/k`` floats.

    Returns:
        ``(logprobs [...], entropy [...] or None)`` in fp32 (fp64 for fp64 logits); both
        differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: leading dims differ")
    lead = target.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1).long()
    logprobs, entropy = _VocabParallelLogProbs.apply(
        flat_logits, flat_target, float(temperature), tp_group, vocab_size, compute_entropy,
        int(chunk_size))
    return logprobs.view(lead), (entropy.view(lead) if compute_entropy else None)
