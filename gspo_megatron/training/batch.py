"""The tensors a policy update consumes, and how they are split into microbatches.

Alignment convention (used everywhere in gspo_megatron): every ``[B, T]`` field is aligned with the
*labels*. Position ``t`` holds the prediction of token ``t + 1``:

    tokens         = [p0 p1 p2 r0 r1 r2 pad pad]   (prompt p, response r, right padding)
    labels         = [p1 p2 r0 r1 r2 pad pad pad]  (tokens shifted left by one)
    response_mask  = [ 0  0  1  1  1   0   0   0]  (label is a response token)

so ``logprobs[b, t] = log pi(labels[b, t] | tokens[b, :t+1])`` and the mask selects exactly the
response tokens' log-probs. Padding is on the right, so with causal attention it never affects a
real token and needs no attention mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PolicyBatch:
    """Sequences for log-prob passes and policy updates (all on this rank)."""

    tokens: torch.Tensor
    """[B, T] int64 prompt + response, right-padded."""
    labels: torch.Tensor
    """[B, T] int64 ``tokens`` shifted left by one (padding at the end)."""
    response_mask: torch.Tensor
    """[B, T] bool, True where ``labels`` is a response token."""
    advantages: torch.Tensor | None = None
    """[B] float32 group-normalised advantage A_i."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] float32 log pi_old of the labels (trainer recompute or rollout engine's)."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, T] float32 log-probs the rollout engine reported while sampling."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] float32 reference-model log-probs for the KL term."""

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def select(self, index: slice | torch.Tensor) -> "PolicyBatch":
        """Rows ``index`` of every field."""
        return dataclasses.replace(self, **{
            f.name: (getattr(self, f.name)[index] if getattr(self, f.name) is not None else None)
            for f in dataclasses.fields(self)
        })

    def split(self, size: int) -> list["PolicyBatch"]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(slice(s, s + size)) for s in range(0, self.size, size)]

    def position_ids(self) -> torch.Tensor:
        """[B, T] positions 0..T-1 (right padding keeps real tokens at their true positions)."""
        return torch.arange(self.seq_length, device=self.tokens.device).expand(self.size, -1)


def make_policy_batch(
    sequences: list[list[int]],
    prompt_lengths: list[int],
    pad_id: int,
    pad_to_multiple_of: int = 1,
    seq_length: int | None = None,
) -> PolicyBatch:
    """Pack token lists (prompt + response each) into a label-aligned :class:`PolicyBatch`.

    ``seq_length`` fixes T (pipeline parallel needs one shape for every microbatch); otherwise T is the
    longest sequence rounded up to ``pad_to_multiple_of`` (TP x 2CP for sequence/context sharding).
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt_lengths")
    longest = max(len(s) for s in sequences)
    t = seq_length if seq_length is not None else longest
    if longest > t:
        raise ValueError(f"a sequence has {longest} tokens, more than seq_length={t}")
    t = -(-t // pad_to_multiple_of) * pad_to_multiple_of
    b = len(sequences)
    tokens = torch.full((b, t), pad_id, dtype=torch.long)
    response_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        # label index t predicts token t+1: response tokens p..len-1 are labels p-1..len-2
        response_mask[i, max(p - 1, 0): len(seq) - 1] = True
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    return PolicyBatch(tokens=tokens, labels=labels, response_mask=response_mask)
