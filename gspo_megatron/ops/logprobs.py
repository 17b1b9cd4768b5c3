"""Per-token log-probabilities and entropy from vocab-parallel logits.

The LM head of a TP=k model leaves each rank with logits for V/k vocabulary entries. The log-prob of
the sampled token needs the global log-sum-exp, which costs two scalar all-reduces per token (max,
sum of exp) plus one for the target logit; the vocabulary is never gathered on one rank.

Memory: the logits are read in row chunks of ``chunk_size`` tokens and up-cast to fp32 one chunk at
a time, so the extra memory is ``chunk_size x V/k`` fp32 values plus per-token scalars, never a
full fp32 ``log_softmax`` copy of ``[B, T, V/k]``. Backward recomputes the softmax chunk by chunk from
the saved per-token max and log-sum-exp and writes the gradient (same dtype as the logits) in place
of nothing else; it needs no communication.

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


def _scaled_chunk(logits: torch.Tensor, start: int, end: int, temperature: float,
                  vocab_start: int, vocab_size: int | None) -> torch.Tensor:
    """``logits[start:end]`` in fp32 (fp64 if given fp64) divided by temperature, padded vocabulary
    set to -inf. [C, V/k]"""
    chunk = logits[start:end].to(_compute_dtype(logits))
    if temperature != 1.0:
        chunk = chunk / temperature
    if vocab_size is not None and vocab_start + chunk.shape[-1] > vocab_size:
        chunk[:, max(vocab_size - vocab_start, 0):] = float("-inf")
    return chunk


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, tp_group, vocab_size, compute_entropy, chunk_size):
        # logits [N, V/k] (N = flattened tokens), target [N] global token ids.
        n, local_vocab = logits.shape
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        vocab_start = rank * local_vocab
        dtype = _compute_dtype(logits)
        row_max = torch.empty(n, dtype=dtype, device=logits.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            row_max[s:e] = _scaled_chunk(logits, s, e, temperature, vocab_start, vocab_size).amax(-1)
        _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)

        # [3, N]: sum exp(l - max), target logit (on the owning rank, else 0), sum exp(l - max) * l
        sums = torch.zeros(3, n, dtype=dtype, device=logits.device)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < local_vocab)
        safe_target = local_target.clamp(0, local_vocab - 1)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            chunk = _scaled_chunk(logits, s, e, temperature, vocab_start, vocab_size)
            exp = torch.exp(chunk - row_max[s:e, None])
            sums[0, s:e] = exp.sum(-1)
            picked = chunk.gather(-1, safe_target[s:e, None]).squeeze(-1)
            sums[1, s:e] = torch.where(owned[s:e], picked, torch.zeros_like(picked))
            if compute_entropy:
                # exp is 0 where chunk is -inf; avoid 0 * -inf = nan.
                sums[2, s:e] = torch.where(exp > 0, exp * chunk, torch.zeros_like(exp)).sum(-1)
        _all_reduce(sums, dist.ReduceOp.SUM, tp_group)

        logsumexp = row_max + torch.log(sums[0])
        logprobs = sums[1] - logsumexp
        entropy = logsumexp - sums[2] / sums[0] if compute_entropy else None

        ctx.save_for_backward(logits, target, logsumexp, entropy if compute_entropy else logsumexp)
        ctx.params = (temperature, vocab_start, vocab_size, compute_entropy, chunk_size)
        if compute_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros_like(logprobs)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, target, logsumexp, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size, compute_entropy, chunk_size = ctx.params
        n, local_vocab = logits.shape
        grad = torch.empty_like(logits)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < local_vocab)
        safe_target = local_target.clamp(0, local_vocab - 1)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            chunk = _scaled_chunk(logits, s, e, temperature, vocab_start, vocab_size)
            logp = chunk - logsumexp[s:e, None]          # [C, V/k], -inf on padded vocab
            p = torch.exp(logp)
            g = -p * grad_logprobs[s:e, None]            # d logp / d l = onehot - p
            g.scatter_add_(-1, safe_target[s:e, None],
                           torch.where(owned[s:e], grad_logprobs[s:e], 0.0)[:, None])
            if compute_entropy and grad_entropy is not None:
                # d H / d l_j = -p_j (log p_j + H); p_j log p_j := 0 where p_j = 0
                plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
                g -= (plogp + p * entropy[s:e, None]) * grad_entropy[s:e, None]
            if temperature != 1.0:
                g /= temperature
            grad[s:e] = g.to(grad.dtype)
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
