"""The weights from the trainer ranks to the rollout ranks of ``rollout.placement: separate``,
shard by shard in buckets of bounded size, over the gloo bridge (:class:`WeightChannel`).

Who sends what: every trainer rank sends its own main-replica pieces
(:meth:`~gspo_megatron.policy.Policy.weight_pieces`: over the trainer ranks, each tensor once) to
every rollout rank, packed into buckets of at most ``rollout.weight_bucket_mb``
(:mod:`gspo_megatron.weight_pieces`); a rollout rank copies each bucket's pieces straight into
its replica's tensors (:meth:`~gspo_megatron.policy.Policy.load_weight_pieces`). No rank holds
the whole model but the replica, nothing is gathered, and nothing is pickled but the layout
(keys, shapes, windows, dtypes, offsets), which each trainer rank sends once, at its first
publish.

The rule that makes the order safe on NCCL machines: **nothing of a weight transfer is ever
posted on a trainer GPU.** A rollout rank receives version ``v`` only right before the rollout
that needs it (rollout ``v + k``, ``k = rollout.max_staleness``), up to ``k + 1`` optimizer steps
after the trainer published it. An NCCL send posted at publish would sit in the trainer GPU's
queue that long, waiting for a receiver busy decoding, beside the trainer's TP / DP / EP
collectives: a stall, or a deadlock once a collective queues behind it. So at publish each
trainer rank copies its pieces into a host snapshot (pinned memory on CUDA; the copy is
synchronised before publish returns, so the next optimizer step cannot change what is sent) and
posts gloo sends of its buckets, slices of that snapshot, which gloo's own threads complete when
the receiver asks for them. The trainer's GPU streams never wait on a rollout rank; a rollout
rank receives a bucket into one host buffer and copies it into its replica (host to device on
its own stream, nothing posted for a peer). gloo can do this on any machine; NCCL would be safe
only with the sender posting after the receiver asked (a round trip per version) and would
still hold a GPU copy of the buckets.

Costs: per publish, one device-to-host copy of each trainer rank's shard (the trainer waits for
it). Host memory per trainer rank: its main-replica shard (boxes aligned to 16 bytes) times the
versions still pending, at most ``k + 1``: when version ``v`` is published the trainer has the
samples of step ``v - 1``, rolled out with version ``v - 1 - k``, so every version before ``v -
k`` was received; the oldest snapshot is reused (no staging bucket: the buckets are slices of
it). Per rollout rank: one bucket (the largest sent). ``gspo-plan --config`` reports both.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

import torch

from gspo_megatron.weight_pieces import BucketLayout, PieceBox, WeightPiece, pack


class PeerLost(RuntimeError):
    """The other side of the bridge is gone (its process died, or its node did): raised, with
    which rank and what this rank was waiting for, instead of gloo's connection error."""


def first_sentence(exc: BaseException) -> str:
    """gloo's ``[.../pair.cc:537] Read error [127.0.0.1]:1931: Connection reset by peer. This is
    typically ...`` -> ``Read error [127.0.0.1]:1931: Connection reset by peer``."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".")


class WeightChannel:
    """This rank's end of the weight transfer over the bridge's gloo group (tag :data:`TAG`;
    the bridge's pickled messages use tag 0). A trainer rank :meth:`send` s its pieces; a
    rollout rank :meth:`receive` s every trainer rank's, given their layouts."""

    TAG = 1

    def __init__(self, group):
        self.group = group
        self.layout: BucketLayout | None = None
        """(trainer end) How this rank's pieces lie in its buckets, packed at the first send."""
        self._boxes: list[PieceBox] = []
        self._pending: deque = deque()  # (snapshot, sends) of the versions not known received
        self._free: list[torch.Tensor] = []
        self._inbox: torch.Tensor | None = None  # (rollout end) the one bucket's buffer

    # ------------------------------------------------------------------------- trainer's end
    def prepare(self, pieces: Sequence[WeightPiece], bucket_bytes: int) -> BucketLayout:
        """This rank's layout for ``pieces`` in buckets of at most ``bucket_bytes``: packed on
        the first call, the same afterwards (for the receivers, once per run); ``ValueError``
        if the pieces are not those it was packed for (the layout is fixed for a run)."""
        boxes = [p.box for p in pieces]
        if self.layout is None:
            self.layout, self._boxes = pack(boxes, bucket_bytes), boxes
        elif boxes != self._boxes:
            raise ValueError("the weight pieces changed during the run (keys, shapes, windows "
                             "or dtypes): the rollout ranks hold the layout of the first publish")
        return self.layout

    def send(self, pieces: Sequence[WeightPiece], dsts: Sequence[int], max_pending: int) -> None:
        """Snapshot ``pieces`` (after :meth:`prepare`) into host memory and send every bucket
        to each job rank of ``dsts`` without waiting; at most ``max_pending`` snapshots are kept
        (the oldest reused: by the protocol above it has been received). Nothing stays posted on
        a GPU: returns once the device-to-host copy is done."""
        if self.layout is None:
            raise RuntimeError("WeightChannel.send before prepare")
        self.prepare(pieces, 0)
        if not self.layout.sizes or not dsts:
            return
        snapshot = self._snapshot(max_pending, pin=any(p.tensor.is_cuda for p in pieces))
        self.layout.fill(pieces, snapshot)
        if snapshot.is_pinned():  # the asynchronous device-to-host copies, done
            torch.cuda.current_stream().synchronize()
        sends = [(self.group.send([self.layout.bucket(b, snapshot)], dst, self.TAG), dst)
                 for b in range(len(self.layout.sizes)) for dst in dsts]
        self._pending.append((snapshot, sends))

    def _snapshot(self, max_pending: int, pin: bool) -> torch.Tensor:
        """A snapshot buffer: a free one, a new one while fewer than ``max_pending`` exist, else
        the oldest pending one once its sends are done."""
        still = deque()
        for snapshot, sends in self._pending:
            (self._free.append(snapshot) if all(w.is_completed() for w, _ in sends)
             else still.append((snapshot, sends)))
        self._pending = still
        if not self._free and len(self._pending) >= max_pending:
            snapshot, sends = self._pending.popleft()
            for work, dst in sends:  # received before the rollout that needed it: at once
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise PeerLost(f"job rank {dst} is gone (waiting for it to take an earlier "
                                   f"version's weights): {first_sentence(exc)}") from None
            self._free.append(snapshot)
        if self._free:
            return self._free.pop()
        return torch.empty(self.layout.total, dtype=torch.uint8, pin_memory=pin)

    def take_sends(self) -> list:
        """The sends not yet waited for, with their snapshots (for ``Bridge.flush``)."""
        out = [(work, snapshot) for snapshot, sends in self._pending for work, _ in sends]
        self._free += [snapshot for snapshot, _ in self._pending]
        self._pending = deque()
        return out

    @property
    def host_bytes(self) -> int:
        """Host memory this end holds now: the trainer's snapshots, the rollout rank's bucket."""
        held = [s for s, _ in self._pending] + self._free
        if self._inbox is not None:
            held.append(self._inbox)
        return sum(t.numel() for t in held)

    # ------------------------------------------------------------------------- rollout's end
    def receive(self, layouts: Sequence[tuple[int, BucketLayout]], version: int
                ) -> Iterator[tuple[PieceBox, torch.Tensor]]:
        """Every ``(box, data)`` of version ``version``, bucket by bucket from each ``(job
        rank, its layout)`` of ``layouts`` in turn, ``data`` a view of the one receiving buffer:
        read each before asking for the next. :class:`PeerLost` if a sender is gone."""
        largest = max((layout.largest for _, layout in layouts), default=0)
        if self._inbox is None or self._inbox.numel() < largest:
            self._inbox = torch.empty(largest, dtype=torch.uint8,
                                      pin_memory=torch.cuda.is_available())
        for src, layout in layouts:
            for b, size in enumerate(layout.sizes):
                buffer = self._inbox[:size]
                try:
                    self.group.recv([buffer], src, self.TAG).wait()
                except RuntimeError as exc:
                    raise PeerLost(f"job rank {src} is gone (waiting for weights version "
                                   f"{version}'s bucket {b + 1} of {len(layout.sizes)}): "
                                   f"{first_sentence(exc)}") from None
                yield from layout.views(b, buffer)
