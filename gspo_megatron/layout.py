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

from dataclasses import dataclass, field
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
        the spans in row order, so one masked write does it, once every sequence's value count is
        its span's (counts that are wrong but cancel in total would shift values between
        sequences silently): a ``ValueError`` names the first sequence that differs."""
        if len(values) != self.num_rows:
            raise ValueError(f"place_labels: {len(values)} value lists for {self.num_rows} sequences")
        mask = self.response_mask()
        spans = mask.sum(1).tolist()
        for i, (v, n) in enumerate(zip(values, spans)):
            if len(v) != n:
                raise ValueError(f"place_labels: sequence {i} has {len(v)} values for its {n} "
                                 f"response tokens")
        out = torch.zeros(self.num_rows, self.seq_length, dtype=torch.float32)
        out[mask] = torch.tensor([float(x) for v in values for x in v], dtype=torch.float32)
        return out

    def position_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """``[B, T]`` rotary positions: right padding keeps tokens at their true positions."""
        return torch.arange(self.seq_length, device=device).expand(self.num_rows, -1)

    def select(self, rows: slice | torch.Tensor) -> "TokenLayout":
        """The layout of rows ``rows`` (as :meth:`PolicyBatch.select` takes them)."""
        return TokenLayout(self.lengths[rows], self.prompt_lengths[rows], self.seq_length)


# ----------------------------------------------------------------------------- packed microbatches

@dataclass(frozen=True)
class PackedRows:
    """Sequences of a microbatch concatenated into one row of ``S`` tokens (Megatron's ``thd``
    format, ``PackedSeqParams``): attention and rotary positions restart at each sequence. The
    microbatch's ``[n, T]`` tensors stay right-padded (sequence ``i`` in row ``i``, positions
    ``0 .. len_i - 1``); :meth:`pack` / :meth:`unpack` move label-aligned values between that
    form and the packed row::

        [n, T] rows      a0 a1 a2 .  .        packed [1, S]   a0 a1 a2 b0 b1 b2 b3 | pad
                         b0 b1 b2 b3 .        cu_seqlens      [0, 3, 7, 8]

    ``S`` is the real tokens rounded up to ``pad_to_multiple_of`` (TP under sequence parallel):
    the tail pad is one more segment of ``cu_seqlens`` (it attends only to itself). Under context
    parallelism each sequence's *segment* is also rounded up to ``segment_multiple`` (2 x CP: every
    CP rank holds two chunks of every sequence, :meth:`context_index`), so pads sit inside
    segments too, after their sequence's tokens (causal attention: no real token sees them)::

        segment_multiple 4   a0 a1 a2 .  b0 b1 b2 b3 | pad pad pad pad     cu_seqlens [0, 4, 8, 12]

    Every pad is marked in :meth:`padding_mask`, so the MoE routers give it no expert and no
    load-balancing weight. A label sits where its token sits (position ``t`` of a sequence scores
    token ``t + 1``), so the last token of each sequence scores a pad label, as in the padded
    layout."""

    lengths: torch.Tensor
    """[n] int64: tokens of each packed sequence."""
    total: int
    """S: positions of the packed row (real tokens, in-segment pads, the tail pad)."""
    segment_multiple: int = 1
    """Each sequence's segment is rounded up to a multiple of this (2 x CP; 1: no pad between
    sequences)."""
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Index tensors by key (:meth:`flat_index` per ``seq_length``, :meth:`token_index`,
    :meth:`context_index` per shard): tokens, labels, log-probs and routes of one microbatch all
    move through the same ones."""

    @classmethod
    def of(cls, lengths: torch.Tensor, pad_to_multiple_of: int = 1,
           segment_multiple: int = 1) -> "PackedRows":
        segments = int(_round_up(lengths.long(), segment_multiple).sum())
        return cls(lengths.long(), _round_up(max(segments, 1), pad_to_multiple_of),
                   segment_multiple)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def pad_tokens(self) -> int:
        """Positions that hold no token of a sequence (in-segment pads and the tail pad)."""
        return self.total - self.real_tokens

    def segment_lengths(self) -> torch.Tensor:
        """``[n]`` (``[n + 1]`` with a tail pad) int64: each sequence's segment of the row, the
        tail pad last."""
        seg = _round_up(self.lengths, self.segment_multiple)
        tail = self.total - int(seg.sum())
        return seg if tail == 0 else torch.cat([seg, torch.tensor([tail])])

    def cu_seqlens(self) -> torch.Tensor:
        """``[n + 1]`` (``[n + 2]`` with a tail pad) int32 segment starts, the pad its own
        segment (Megatron's ``cu_seqlens_q_padded``; the same as :meth:`cu_seqlens_real` when
        ``segment_multiple`` is 1)."""
        return _starts(self.segment_lengths())

    def cu_seqlens_real(self) -> torch.Tensor:
        """``[n + 1]`` (``[n + 2]``) int32: the sequences' real lengths accumulated, the tail
        pad one more (Megatron's ``cu_seqlens_q``: what attention covers in each segment)."""
        seg = self.segment_lengths()
        return _starts(torch.cat([self.lengths, seg[self.lengths.shape[0]:]]))

    def max_seqlen(self) -> int:
        seg = self.segment_lengths()
        return int(seg.max()) if seg.numel() else 0

    def flat_index(self, seq_length: int) -> torch.Tensor:
        """``[S_real]`` int64: for each real token of the packed row, its index in the flattened
        ``[n, seq_length]`` right-padded tensors (row ``i`` position ``t`` -> ``i * T + t``)."""
        index = self._index.get(seq_length)
        if index is None:
            n = self.lengths.shape[0]
            positions = torch.arange(seq_length)
            keep = positions[None, :] < self.lengths[:, None]  # [n, T]
            index = (torch.arange(n)[:, None] * seq_length + positions[None, :])[keep]
            self._index[seq_length] = index
        return index

    def token_index(self) -> torch.Tensor | None:
        """``[S_real]`` int64: the packed-row position of each real token (in the order of
        :meth:`flat_index`); None when they are the first ``S_real`` positions in order (no pad
        between sequences)."""
        if self.segment_multiple == 1:
            return None
        index = self._index.get("tokens")
        if index is None:
            starts = _starts(self.segment_lengths()).long()[: self.lengths.shape[0]]
            index = (torch.repeat_interleave(starts, self.lengths, output_size=self.real_tokens)
                     + segment_positions(_starts(self.lengths), self.real_tokens))
            self._index["tokens"] = index
        return index

    def gather_rows(self, x: torch.Tensor, fill=0, shard: "ContextShard | None" = None
                    ) -> torch.Tensor:
        """``[n, T, ...] -> [S, ...]``: the real tokens of every row, in order, at their
        segments, ``fill`` (a scalar, or one ``[...]`` value) at every pad; with ``shard``, this
        context-parallel rank's ``[S / cp, ...]`` positions of it (:meth:`context_index`)."""
        rest = x.shape[2:]
        flat = x.reshape(-1, *rest)[self.flat_index(x.shape[1]).to(x.device)]
        where = self.token_index()
        if where is None:
            if self.pad_tokens:
                pad = torch.as_tensor(fill, dtype=x.dtype, device=x.device)
                flat = torch.cat([flat, pad.expand(self.pad_tokens, *rest)])
        else:
            pad = torch.as_tensor(fill, dtype=x.dtype, device=x.device)
            flat = pad.expand(self.total, *rest).clone().index_copy(0, where.to(x.device), flat)
        return flat if shard is None else flat[self.context_index(shard).to(x.device)]

    def scatter_rows(self, y: torch.Tensor, seq_length: int,
                     shard: "ContextShard | None" = None) -> torch.Tensor:
        """``[S, ...]`` (with ``shard``: this CP rank's ``[S / cp, ...]``) -> ``[n, T, ...]``,
        the inverse of :meth:`gather_rows`: zeros at the padding and at the positions other CP
        ranks hold (differentiable: the gradient of a padded position is dropped)."""
        rest = y.shape[1:]
        if shard is not None:
            y = y.new_zeros(self.total, *rest).index_copy(
                0, self.context_index(shard).to(y.device), y)
        where = self.token_index()
        flat = y[: self.real_tokens] if where is None else y[where.to(y.device)]
        n = self.lengths.shape[0]
        out = flat.new_zeros(n * seq_length, *rest)
        return out.index_copy(0, self.flat_index(seq_length).to(y.device), flat).view(
            n, seq_length, *rest)

    def pack(self, x: torch.Tensor, pad_value=0) -> torch.Tensor:
        """``[n, T] -> [1, S]`` (:meth:`gather_rows`)."""
        return self.gather_rows(x, pad_value)[None]

    def unpack(self, y: torch.Tensor, seq_length: int) -> torch.Tensor:
        """``[1, S] (or [S]) -> [n, T]`` (:meth:`scatter_rows`), the inverse of :meth:`pack`."""
        return self.scatter_rows(y.reshape(-1), seq_length)

    def position_ids(self, device=None) -> torch.Tensor:
        """``[1, S]`` rotary positions, restarting at 0 in every segment (the pad included)."""
        return segment_positions(self.cu_seqlens(), self.total).to(device)[None]

    def padding_mask(self, device=None) -> torch.Tensor | None:
        """``[1, S]`` bool, True at every pad (Megatron's MoE ``padding_mask``); None without
        one."""
        if self.pad_tokens == 0:
            return None
        where = self.token_index()
        if where is None:
            mask = torch.zeros(1, self.total, dtype=torch.bool, device=device)
            mask[:, self.real_tokens:] = True
            return mask
        mask = torch.ones(self.total, dtype=torch.bool)
        mask[where] = False
        return mask.to(device)[None]

    # -- context parallelism
    def context_index(self, shard: "ContextShard") -> torch.Tensor:
        """``[S / cp]`` int64: the packed-row positions context-parallel rank ``shard.rank``
        holds, ascending: of every segment (length ``L``, a multiple of ``2 cp``) chunks
        ``rank`` and ``2 cp - 1 - rank`` of ``L / (2 cp)`` tokens, Megatron's / Transformer
        Engine's ``thd`` split (``thd_get_partitioned_indices``). A sequence's chunks depend only
        on its own length, so a rank holds the same positions of it in any packing."""
        key = ("context", shard.rank, shard.size)
        index = self._index.get(key)
        if index is None:
            seg = self.segment_lengths()
            if bool((seg % (2 * shard.size)).any()):
                raise ValueError(f"packed segments {seg.tolist()} do not split into 2 x "
                                 f"context_parallel_size = {2 * shard.size} chunks")
            chunk = torch.repeat_interleave(seg // (2 * shard.size), seg, output_size=self.total)
            part = segment_positions(_starts(seg), self.total) // chunk
            held = (part == shard.rank) | (part == 2 * shard.size - 1 - shard.rank)
            index = torch.arange(self.total)[held]
            self._index[key] = index
        return index

    def unpack_context(self, y: torch.Tensor, shard: "ContextShard", seq_length: int
                       ) -> torch.Tensor:
        """``[1, S / cp]`` values at this rank's :meth:`context_index` -> ``[n, T]`` at their
        sequences' positions, zeros at every position another rank holds (differentiable)."""
        return self.scatter_rows(y.reshape(-1), seq_length, shard)

    def held(self, shard: "ContextShard", seq_length: int) -> torch.Tensor:
        """``[n, T]`` bool: the positions of the rows that rank ``shard.rank`` holds."""
        ones = torch.ones(self.total // shard.size)
        return self.unpack_context(ones, shard, seq_length) > 0


def _round_up(x, multiple: int):
    return -(-x // multiple) * multiple


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """``[m + 1]`` int32 exclusive prefix sums of ``[m]`` segment lengths (``cu_seqlens``)."""
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.long().cumsum(0)]).to(torch.int32)


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: each token's position within its segment of ``cu_seqlens`` (``[m + 1]``
    segment starts, the last one ``total``), on ``cu_seqlens``' device."""
    cu = cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def in_batch_order(parts: Sequence[torch.Tensor], rows: Sequence[torch.Tensor | None],
                   dim: int = 0) -> torch.Tensor:
    """Per-microbatch values concatenated along ``dim`` (their rows), each row put back at its
    index in the batch, ``rows[i]`` being microbatch ``i``'s batch rows. Plain concatenation when
    a microbatch has no ``rows`` or they are already in order (padded microbatches)."""
    out = torch.cat(list(parts), dim=dim)
    if any(r is None for r in rows):
        return out
    order = torch.cat([r.cpu() for r in rows])
    if torch.equal(order, torch.arange(order.numel())):
        return out
    return torch.empty_like(out).index_copy_(dim, order.to(out.device), out)


def pack_into_microbatches(lengths: Sequence[int], max_tokens: int, pad_to_multiple_of: int = 1,
                           min_microbatches: int = 1, segment_multiple: int = 1
                           ) -> list[list[int]]:
    """Sequences ``0 .. N-1`` of ``lengths`` grouped into microbatches of at most ``max_tokens``
    packed tokens each (tail pad included), no sequence split: first-fit decreasing (longest
    first, each into the first microbatch with room; deterministic, ties by index), the bins
    then taken apart until there are ``min_microbatches`` (every rank of a data-parallel group
    must run as many microbatches as the others: their expert all-to-alls pair up) by halving
    the bin of most tokens that holds two or more sequences. Each microbatch lists its sequences
    in ascending order. A sequence counts its segment (its length rounded up to
    ``segment_multiple``, :class:`PackedRows`).

    Raises ``ValueError`` for a sequence longer than ``max_tokens`` or more microbatches asked
    than there are sequences."""
    lengths = [_round_up(int(x), segment_multiple) for x in lengths]
    fit = lambda tokens: -(-tokens // pad_to_multiple_of) * pad_to_multiple_of  # noqa: E731
    too_long = [i for i, n in enumerate(lengths) if fit(n) > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than "
                         f"max_tokens_per_microbatch={max_tokens}")
    if min_microbatches > len(lengths):
        raise ValueError(f"{min_microbatches} microbatches asked for {len(lengths)} sequences")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if fit(load + lengths[i]) <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    while len(bins) < min_microbatches:
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: (loads[b], -b))
        seqs = sorted(bins[b], key=lambda i: (-lengths[i], i))
        bins[b], new = seqs[0::2], seqs[1::2]  # alternate: two halves of about equal tokens
        loads[b] = sum(lengths[i] for i in bins[b])
        bins.append(new)
        loads.append(sum(lengths[i] for i in new))
    return [sorted(b) for b in bins]


@dataclass(frozen=True)
class RankBalance:
    """Which data-parallel rank trains which sequence (:func:`balance_across_ranks`)."""

    sources: list[list[list[tuple[int, int]]]]
    """``sources[r][m]``: ``(source rank, source position)`` of each sequence rank ``r`` trains in
    minibatch ``m`` (longest first; in their order where the minibatch stays as sampled)."""
    tokens_before: list[list[int]]
    """``[R][M]`` tokens each rank held in each minibatch before the exchange."""
    tokens_after: list[list[int]]
    """``[R][M]`` the same after it."""

    def sizes(self, rank: int) -> list[int]:
        """Sequences rank ``rank`` trains in each minibatch."""
        return [len(mb) for mb in self.sources[rank]]

    @staticmethod
    def imbalance(tokens: list[list[int]]) -> float:
        """The largest rank's tokens over the ranks' mean, worst minibatch (1.0: even)."""
        worst = 1.0
        for per_rank in zip(*tokens):
            mean = sum(per_rank) / len(per_rank)
            worst = max(worst, max(per_rank) / mean if mean else 1.0)
        return worst


def balance_across_ranks(lengths: Sequence[Sequence[int]], num_minibatches: int) -> RankBalance:
    """Whole sequences spread over ``R`` data-parallel ranks so that every rank holds about the
    same tokens in every minibatch, each minibatch keeping its sequences (the gradient then does
    not change: the loss normaliser is the minibatch's count over every rank).

    ``lengths[r]``: rank ``r``'s sequence lengths in the order its minibatches take them (``n``
    per rank; minibatch ``m`` is positions ``m n / M .. (m + 1) n / M - 1``). Each minibatch's
    ``R n / M`` sequences, longest first (ties: source rank, then position), go one at a time to
    the rank with the fewest tokens so far among those holding fewer than ``n / M`` (ties: the
    sequence's own rank, so nothing moves that need not, then the lowest rank): greedy
    longest-processing-time with equal counts (verl's ``equal_size`` partitions), so every rank
    still trains ``n / M`` sequences per minibatch (as many packed microbatches can always be
    made on every rank). A minibatch whose largest rank would not get lighter stays as sampled,
    so the result is never worse than no exchange. Deterministic: every rank computes the same
    plan from the same gathered lengths."""
    num_ranks = len(lengths)
    n = len(lengths[0])
    if any(len(x) != n for x in lengths):
        raise ValueError(f"every rank must hold as many sequences, got {[len(x) for x in lengths]}")
    if num_minibatches < 1 or n % num_minibatches:
        raise ValueError(f"{n} sequences per rank do not split into {num_minibatches} minibatches")
    per = n // num_minibatches
    sources: list[list[list[tuple[int, int]]]] = [[] for _ in range(num_ranks)]
    before = [[0] * num_minibatches for _ in range(num_ranks)]
    after = [[0] * num_minibatches for _ in range(num_ranks)]
    for m in range(num_minibatches):
        members = [(int(lengths[r][p]), r, p) for r in range(num_ranks)
                   for p in range(m * per, (m + 1) * per)]
        for r in range(num_ranks):
            sources[r].append([])
        for length, src, pos in sorted(members, key=lambda x: (-x[0], x[1], x[2])):
            before[src][m] += length
            open_ranks = [r for r in range(num_ranks) if len(sources[r][m]) < per]
            low = min(after[r][m] for r in open_ranks)
            dest = src if src in open_ranks and after[src][m] == low else next(
                r for r in open_ranks if after[r][m] == low)
            sources[dest][m].append((src, pos))
            after[dest][m] += length
        if max(after[r][m] for r in range(num_ranks)) >= max(before[r][m] for r in range(num_ranks)):
            for r in range(num_ranks):  # no better than as sampled (LPT is a heuristic): keep it
                sources[r][m] = [(r, p) for p in range(m * per, (m + 1) * per)]
                after[r][m] = before[r][m]
    return RankBalance(sources, before, after)


@dataclass(frozen=True)
class ContextShard:
    """Where a context-parallel rank's tokens sit in a ``[b, T]`` row: Megatron's load-balanced
    split (``get_batch_on_this_cp_rank``) cuts ``T`` into ``2 x size`` chunks of ``T / (2 size)``
    and rank ``r`` holds chunks ``r`` and ``2 size - 1 - r``, so under causal attention every rank
    has about the same work (an early chunk and a late one). ``T`` must be a multiple of ``2 x
    size`` (the trainer pads rows to it)."""

    rank: int
    size: int

    def positions(self, seq_length: int) -> torch.Tensor:
        """``[2 T / (2 size)]`` int64: the global positions this rank holds, in its order."""
        chunk, rest = divmod(seq_length, 2 * self.size)
        if rest:
            raise ValueError(f"a row of {seq_length} tokens does not split into 2 x "
                             f"context_parallel_size = {2 * self.size} chunks")
        first, second = self.rank * chunk, (2 * self.size - 1 - self.rank) * chunk
        return torch.cat([torch.arange(first, first + chunk),
                          torch.arange(second, second + chunk)])

    def shard(self, x: torch.Tensor, seq_length: int, dim: int = 1) -> torch.Tensor:
        """This rank's positions of ``x`` along ``dim`` (of size ``seq_length``)."""
        return x.index_select(dim, self.positions(seq_length).to(x.device))

    def segment_held(self, lengths: torch.Tensor, seq_length: int) -> torch.Tensor:
        """``[B, T]`` bool: the positions of right-padded rows of ``lengths [B]`` this rank holds
        when each sequence is a segment of a packed row (rounded up to ``2 x size``, chunks
        ``rank`` and ``2 size - 1 - rank``; :meth:`PackedRows.context_index`)."""
        chunk = (-(-lengths.long() // (2 * self.size)))[:, None]  # [B, 1] tokens per chunk
        t = torch.arange(seq_length)[None, :]
        part = t // chunk
        return (t < lengths[:, None]) & ((part == self.rank) | (part == 2 * self.size - 1 - self.rank))

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The full rows from every rank's shard (``parts[r]``: rank ``r``'s, as :meth:`shard`
        gave it), positions back in order."""
        local = parts[0].shape[dim]
        seq_length = local * self.size
        order = torch.cat([ContextShard(r, self.size).positions(seq_length)
                           for r in range(self.size)])
        out = torch.cat(list(parts), dim=dim)
        return torch.empty_like(out).index_copy_(dim, order.to(out.device), out)
