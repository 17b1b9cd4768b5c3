"""A model's weights as pieces of whole tensors, packed into buckets of bounded size: what each
trainer rank of ``rollout.placement: separate`` sends the rollout ranks after every optimizer step
(:mod:`gspo_megatron.rollouts.weight_channel`). Framework-free: the backend names the pieces.

Every tensor of the model has a key that does not depend on the parallel layout, and a global
shape; a rank holds a window of it (its TP / EP / PP shard): a :class:`WeightPiece`. Over the
ranks that hold the main replica of each piece, the pieces cover every tensor once.

:func:`pack` cuts each piece into :class:`PieceBox` es of at most a bucket's bytes and packs the
boxes, in order, into buckets of at most ``bucket_bytes``: a :class:`BucketLayout`, fixed for a
run (the receiver gets it once). A tensor larger than a bucket is split, never given an oversized
bucket of its own, so no bucket exceeds ``bucket_bytes``: a box is whole rows of the piece's first
axis longer than one, and a row that alone is too large is cut along the next axis (so each box
is one contiguous block of the piece). A bucket is one flat ``uint8`` buffer: the sender copies
its boxes into a snapshot of all its buckets (:meth:`BucketLayout.fill`), the receiver reads a
received bucket's boxes as views (:meth:`BucketLayout.views`) and copies each into the windows of
its own tensors it overlaps (:class:`PieceLoader`; any layout to any layout, e.g. a TP=2 trainer's
halves into a TP=1 replica's whole tensors).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

ALIGN = 16
"""Every box starts at a multiple of this many bytes in its bucket, and every bucket in a
snapshot: reading a ``uint8`` slice as another dtype needs an offset that is a multiple of the
element size (16: complex128 included)."""


def dtype_named(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class PieceBox:
    """A block of a tensor: ``shape`` elements from ``start`` in its global shape."""

    key: str
    """The tensor's layout-independent name (Megatron's sharded-state-dict key)."""
    global_shape: tuple[int, ...]
    """The whole tensor's shape."""
    start: tuple[int, ...]
    """The block's offset in the whole tensor, one entry per axis."""
    shape: tuple[int, ...]
    """The block's shape (as many axes as ``global_shape``)."""
    dtype: str
    """torch dtype name (``"bfloat16"``)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_named(self.dtype).itemsize

    def split(self, max_bytes: int) -> list["PieceBox"]:
        """This box as consecutive boxes of at most ``max_bytes`` each (itself if it fits): whole
        rows of its first axis longer than one, a row too large for ``max_bytes`` cut along the
        next axis in turn. ``ValueError`` when one element does not fit."""
        if self.nbytes <= max_bytes:
            return [self]
        size = dtype_named(self.dtype).itemsize
        if size > max_bytes:
            raise ValueError(f"a bucket of {max_bytes} bytes holds no element of {self.key!r} "
                             f"({self.dtype})")
        axis = next(i for i, n in enumerate(self.shape) if n > 1)
        row = math.prod(self.shape[axis + 1:]) * size
        rows = max(1, max_bytes // row)  # 1: each row cut further along the next axis
        out = []
        for r in range(0, self.shape[axis], rows):
            n = min(rows, self.shape[axis] - r)
            part = dataclasses.replace(
                self, start=self.start[:axis] + (self.start[axis] + r,) + self.start[axis + 1:],
                shape=self.shape[:axis] + (n,) + self.shape[axis + 1:])
            out += part.split(max_bytes)
        return out


@dataclass
class WeightPiece:
    """A rank's window of one tensor of the model: ``tensor`` (a view of the parameter, the
    window's shape) at ``start`` in the whole tensor of ``global_shape`` under ``key``."""

    key: str
    global_shape: tuple[int, ...]
    start: tuple[int, ...]
    tensor: torch.Tensor
    """``[*window]``: as many axes as ``global_shape`` (size-1 axes prepended where the
    parameter has fewer, e.g. one expert's weight in the stacked experts' tensor)."""

    def __post_init__(self):
        if not len(self.global_shape) == len(self.start) == self.tensor.dim():
            raise ValueError(f"{self.key!r}: global shape {self.global_shape}, start "
                             f"{self.start} and a tensor of shape {tuple(self.tensor.shape)} "
                             f"have different numbers of axes")

    @property
    def box(self) -> PieceBox:
        """The whole piece as a box."""
        return PieceBox(self.key, tuple(self.global_shape), tuple(self.start),
                        tuple(self.tensor.shape), str(self.tensor.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Placed:
    """A box in a bucket."""

    box: PieceBox
    piece: int
    """Its piece's index in the sender's list (the sender's business only)."""
    offset: int
    """Bytes from the bucket's start (a multiple of :data:`ALIGN`)."""


def _view(buffer: torch.Tensor, offset: int, box: PieceBox) -> torch.Tensor:
    """``box``'s bytes at ``offset`` of the flat ``uint8`` ``buffer``, as a ``[*box.shape]``
    tensor of its dtype (a view)."""
    return buffer[offset:offset + box.nbytes].view(dtype_named(box.dtype)).view(box.shape)


@dataclass
class BucketLayout:
    """Where each box of a sender's pieces lies in its buckets (:func:`pack`)."""

    buckets: list[list[Placed]]
    sizes: list[int]
    """Bytes of each bucket (at most the ``bucket_bytes`` it was packed for)."""

    @property
    def starts(self) -> list[int]:
        """Where each bucket begins in a snapshot of all of them."""
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at = _aligned(at + size)
        return out

    @property
    def total(self) -> int:
        """Bytes of a snapshot of every bucket (the pieces' bytes plus alignment)."""
        return self.starts[-1] + self.sizes[-1] if self.sizes else 0

    @property
    def largest(self) -> int:
        """Bytes of the largest bucket: what a receiver's buffer must hold."""
        return max(self.sizes, default=0)

    def bucket(self, b: int, snapshot: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s bytes in ``snapshot`` (a view)."""
        start = self.starts[b]
        return snapshot[start:start + self.sizes[b]]

    @torch.no_grad()
    def fill(self, pieces: Sequence[WeightPiece], snapshot: torch.Tensor) -> None:
        """Copy every box out of ``pieces`` (the list packed) into ``snapshot`` (``[total]``
        ``uint8``). From CUDA into pinned memory the copies are asynchronous: synchronise before
        reading ``snapshot``."""
        for b, start in enumerate(self.starts):
            for p in self.buckets[b]:
                piece, box = pieces[p.piece], p.box
                src = piece.tensor[tuple(slice(s - o, s - o + n) for s, o, n in
                                         zip(box.start, piece.start, box.shape))]
                _view(snapshot, start + p.offset, box).copy_(src, non_blocking=True)

    def views(self, b: int, buffer: torch.Tensor) -> list[tuple[PieceBox, torch.Tensor]]:
        """Bucket ``b``'s boxes, read from ``buffer`` (its bytes from 0), as views."""
        return [(p.box, _view(buffer, p.offset, p.box)) for p in self.buckets[b]]


def pack(boxes: Sequence[PieceBox], bucket_bytes: int) -> BucketLayout:
    """Lay ``boxes`` (one per piece, in order) out in buckets of at most ``bucket_bytes``: each
    box split to fit (:meth:`PieceBox.split`), a new bucket begun when the next one does not fit
    in the current one."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"a bucket must hold at least {ALIGN} bytes, got {bucket_bytes}")
    buckets: list[list[Placed]] = []
    sizes: list[int] = []
    current: list[Placed] = []
    used = 0
    for i, whole in enumerate(boxes):
        for box in whole.split(bucket_bytes):
            if not box.nbytes:  # an empty tensor: nothing to send
                continue
            offset = _aligned(used)
            if current and offset + box.nbytes > bucket_bytes:
                buckets.append(current)
                sizes.append(used)
                current, offset = [], 0
            current.append(Placed(box, i, offset))
            used = offset + box.nbytes
    if current:
        buckets.append(current)
        sizes.append(used)
    return BucketLayout(buckets, sizes)


def _overlap(box: PieceBox, piece: WeightPiece):
    """``(slices of the box, slices of the piece's tensor)`` of what they share; None if
    nothing."""
    src, dst = [], []
    for b0, bn, p0, pn in zip(box.start, box.shape, piece.start, piece.tensor.shape):
        lo, hi = max(b0, p0), min(b0 + bn, p0 + pn)
        if lo >= hi:
            return None
        src.append(slice(lo - b0, hi - b0))
        dst.append(slice(lo - p0, hi - p0))
    return tuple(src), tuple(dst)


class PieceLoader:
    """Copies boxes into the windows of a replica's pieces they overlap. Which windows a box
    overlaps is worked out the first time the box is seen (the layout is fixed for a run), and
    the first load of a layout checks that it writes every element of every piece exactly once
    (``KeyError`` naming a tensor the boxes lack, ``ValueError`` for one covered in part)."""

    def __init__(self):
        self._copies: dict[PieceBox, list[tuple[int, tuple, tuple]]] = {}
        self._covered: list[int] = []

    @torch.no_grad()
    def load(self, targets: Sequence[WeightPiece], boxes: Iterable[tuple[PieceBox, torch.Tensor]]
             ) -> None:
        """Copy every ``(box, data)`` of ``boxes`` (``data``: ``[*box.shape]``, read once, before
        the next is asked for: a receiver reuses its buffer) into ``targets``, the replica's
        pieces (the same list, in the same order, on every call)."""
        if len(self._covered) != len(targets):
            self._copies, self._covered = {}, [0] * len(targets)
        by_key: dict[str, list[int]] | None = None
        for box, data in boxes:
            copies = self._copies.get(box)
            if copies is None:
                if by_key is None:
                    by_key = {}
                    for i, t in enumerate(targets):
                        by_key.setdefault(t.key, []).append(i)
                copies = self._copies[box] = self._plan(box, targets, by_key.get(box.key, ()))
            for i, src, dst in copies:
                targets[i].tensor[dst].copy_(data[src])
        if by_key is not None:  # new boxes: check the coverage
            for t, covered in zip(targets, self._covered):
                if covered == 0 and t.tensor.numel():
                    raise KeyError(f"the weights sent hold no {t.key!r}")
                if covered != t.tensor.numel():
                    raise ValueError(f"the weights sent write {covered} of the {t.tensor.numel()}"
                                     f" elements of {t.key!r} at {t.start}")

    def _plan(self, box: PieceBox, targets: Sequence[WeightPiece], candidates) -> list:
        out = []
        for i in candidates:
            t = targets[i]
            if tuple(t.global_shape) != box.global_shape:
                raise ValueError(f"{box.key!r}: the weights sent are of shape {box.global_shape}, "
                                 f"this model's of {tuple(t.global_shape)}")
            hit = _overlap(box, t)
            if hit is not None:
                out.append((i, *hit))
                self._covered[i] += math.prod(s.stop - s.start for s in hit[1])
        return out


def pieces_as_boxes(pieces: Iterable[WeightPiece]) -> Iterable[tuple[PieceBox, torch.Tensor]]:
    """``(box, data)`` of whole pieces, for :meth:`PieceLoader.load` in one process (a frozen
    copy of the policy, a test), no buckets involved."""
    return ((p.box, p.tensor) for p in pieces)
