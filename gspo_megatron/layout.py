"""Where each token of a batch sits: :class:`TokenLayout`, the one description that masks, rollout
log-probs, MoE routes and position ids all read.

A batch holds ``N`` sequences (prompt + response token lists). The layout says, for sequence
``i``, which row of the ``[B, T]`` tensors holds it and which positions of that row its tokens and
its scored labels occupy. Every per-sequence value that has to land in the batch (the rollout
engine's log-probs of the response, the routes the engine recorded for every forwarded token) is
placed through :meth:`TokenLayout.token_span` / :meth:`TokenLayout.label_span`, so a new layout
(packed rows, context-parallel shards) changes this module, not its readers.

Today's layout is **right padding**: sequence ``i`` is row ``i``, its tokens at positions
``0 .. len_i - 1``, pads after (causal attention: a pad never affects a real token, no attention
mask needed); its position ids are the positions themselves.

Label alignment (the convention of :mod:`gspo_megatron.policy`): position ``t`` scores token
``t + 1``, so a response occupying tokens ``p .. len - 1`` is scored at label positions
``p - 1 .. len - 2``::

    tokens         = [p0 p1 p2 r0 r1 r2 pad pad]      prompt_length 3, length 6, T 8
    token_span     = (row i, 0:6)
    label_span     = (row i, 2:5)                     the labels r0 r1 r2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLayout:
    """Right-padded sequences in a ``[B, T]`` batch (sequence ``i`` in row ``i``)."""

    lengths: torch.Tensor
    """[N] int64: prompt + response tokens of each sequence."""
    prompt_lengths: torch.Tensor
    """[N] int64: prompt tokens of each sequence."""
    seq_length: int
    """T, the batch's positions per row (>= the longest sequence; padded for TP x 2CP or PP)."""

    @classmethod
    def right_padded(cls, lengths: Sequence[int], prompt_lengths: Sequence[int],
                     pad_to_multiple_of: int = 1, seq_length: int | None = None) -> "TokenLayout":
        """Rows of ``T`` positions: ``seq_length`` if given (one activation shape for every
        pipeline-parallel microbatch), else the longest sequence, rounded up to
        ``pad_to_multiple_of`` (TP x 2CP for sequence / context sharding)."""
        if len(lengths) != len(prompt_lengths):
            raise ValueError(f"{len(lengths)} sequences but {len(prompt_lengths)} prompt_lengths")
        longest = max(lengths)
        t = seq_length if seq_length is not None else longest
        if longest > t:
            raise ValueError(f"a sequence has {longest} tokens, more than seq_length={t}")
        t = -(-t // pad_to_multiple_of) * pad_to_multiple_of
        return cls(torch.tensor(list(lengths), dtype=torch.long),
                   torch.tensor(list(prompt_lengths), dtype=torch.long), t)

    @property
    def num_sequences(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_rows(self) -> int:
        """B: rows of the batch tensors (one per sequence when right-padded)."""
        return self.num_sequences

    @property
    def real_tokens(self) -> int:
        """Tokens that are not padding (what the batch really computes on)."""
        return int(self.lengths.sum())

    def token_span(self, i: int) -> tuple[int, slice]:
        """``(row, positions)`` of sequence ``i``'s tokens (prompt and response)."""
        return i, slice(0, int(self.lengths[i]))

    def label_span(self, i: int) -> tuple[int, slice]:
        """``(row, positions)`` whose labels are sequence ``i``'s response tokens."""
        p, n = int(self.prompt_lengths[i]), int(self.lengths[i])
        return i, slice(max(p - 1, 0), n - 1)

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, True where the label is a response token: row ``i``'s
        :meth:`label_span`, from two whole-batch comparisons (no per-sequence write)."""
        positions = torch.arange(self.seq_length)
        start = (self.prompt_lengths - 1).clamp(min=0)
        return (positions >= start[:, None]) & (positions < (self.lengths - 1)[:, None])

    def place_labels(self, values: Sequence[Sequence[float]]) -> torch.Tensor:
        """``[B, T]`` float32 with sequence ``i``'s per-response-token ``values[i]`` at its
        :meth:`label_span` (the rollout engine's log-probs), zeros elsewhere. Right padding puts
        the spans in row order, so one masked write does it; a sequence whose value count does
        not fill its span is refused by the per-sequence write (its shape error)."""
        out = torch.zeros(self.num_rows, self.seq_length, dtype=torch.float32)
        mask = self.response_mask()
        flat = [float(x) for v in values for x in v]
        if int(mask.sum()) == len(flat):
            out[mask] = torch.tensor(flat, dtype=torch.float32)
            return out
        for i, v in enumerate(values):
            row, span = self.label_span(i)
            out[row, span] = torch.tensor(v, dtype=torch.float32)
        return out

    def position_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """``[B, T]`` rotary positions: right padding keeps tokens at their true positions."""
        return torch.arange(self.seq_length, device=device).expand(self.num_rows, -1)

    def select(self, rows: slice | torch.Tensor) -> "TokenLayout":
        """The layout of rows ``rows`` (as :meth:`PolicyBatch.select` takes them)."""
        return TokenLayout(self.lengths[rows], self.prompt_lengths[rows], self.seq_length)
