"""Pieces of tensors packed into buckets of bounded size (``gspo_megatron.weight_pieces``), what
the trainer ranks of ``rollout.placement: separate`` send: the round trip is exact in mixed
dtypes for buckets smaller than a tensor (split into blocks that fit: never a bucket over the
bound), as large as one, and larger than all; pieces of one layout land in the windows of
another's; a replica whose tensors the pieces do not cover is refused naming the tensor."""

import pytest
import torch

from gspo_megatron.weight_pieces import PieceBox, PieceLoader, WeightPiece, pack


def _whole(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of three dtypes (bf16, float64, float32), one with a leading size-1 axis."""
    gen = torch.Generator().manual_seed(seed)
    return {"embedding": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
            "layers.0.w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
            "layers.0.norm": torch.randn(7, generator=gen),
            "experts.w": torch.randn(1, 4, 2, generator=gen, dtype=torch.float64)}


def _pieces(tensors: dict[str, torch.Tensor]) -> list[WeightPiece]:
    return [WeightPiece(k, tuple(t.shape), (0,) * t.dim(), t) for k, t in tensors.items()]


def _send(pieces: list[WeightPiece], bucket_bytes: int):
    """What a rollout rank's loader is given: each bucket received into one reused buffer
    (cleared in between, so a view read late would be caught)."""
    layout = pack([p.box for p in pieces], bucket_bytes)
    snapshot = torch.empty(layout.total, dtype=torch.uint8)
    layout.fill(pieces, snapshot)
    inbox = torch.empty(layout.largest, dtype=torch.uint8)
    for b, size in enumerate(layout.sizes):
        inbox.fill_(0xFF)
        inbox[:size].copy_(layout.bucket(b, snapshot))
        yield from layout.views(b, inbox[:size])


@pytest.mark.parametrize("bucket_bytes, buckets", [
    (32, 10),    # smaller than every tensor but the norm (28 B): each split into blocks that fit
    (120, 3),    # exactly layers.0.w (5 x 3 float64): it fills a bucket of its own
    (1 << 20, 1),  # larger than all of them together
])
def test_mixed_dtypes_round_trip_exactly_in_buckets_of_any_size(bucket_bytes, buckets):
    sent = _whole(0)
    layout = pack([p.box for p in _pieces(sent)], bucket_bytes)
    assert len(layout.sizes) == buckets and max(layout.sizes) <= bucket_bytes
    received = {k: torch.zeros_like(t) for k, t in sent.items()}
    PieceLoader().load(_pieces(received), _send(_pieces(sent), bucket_bytes))
    for key, t in sent.items():
        assert received[key].dtype == t.dtype and torch.equal(received[key], t), key
    if bucket_bytes == 120:
        assert [p.box.key for p in layout.buckets[1]] == ["layers.0.w"]
        assert layout.sizes[1] == 120


def test_a_tensor_larger_than_a_bucket_is_cut_into_contiguous_blocks():
    box = PieceBox("w", (5, 3), (0, 0), (5, 3), "float64")  # rows of 24 bytes
    assert [(b.start, b.shape) for b in box.split(48)] == [
        ((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (1, 3))]
    # a row longer than the bucket: the row cut along the next axis
    assert [(b.start, b.shape) for b in box.split(16)][:3] == [
        ((0, 0), (1, 2)), ((0, 2), (1, 1)), ((1, 0), (1, 2))]
    assert sum(b.nbytes for b in box.split(16)) == box.nbytes
    with pytest.raises(ValueError, match="a bucket of 4 bytes holds no element of 'w'"):
        box.split(4)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        pack([box], 8)


def test_pieces_of_one_layout_land_in_the_windows_of_another():
    """A tensor sent as two halves along each axis (a TP=2 trainer: column- and row-parallel)
    and a stacked-experts tensor as one piece per expert, into a TP=1 replica's whole tensors;
    and back, whole tensors into a TP=2 rank's halves."""
    gen = torch.Generator().manual_seed(1)
    col, row = torch.randn(4, 6, generator=gen), torch.randn(3, 8, generator=gen)
    experts = torch.randn(2, 3, 2, generator=gen).to(torch.bfloat16)
    sent = [WeightPiece("col", (4, 6), (0, 0), col[:2]), WeightPiece("col", (4, 6), (2, 0), col[2:]),
            WeightPiece("row", (3, 8), (0, 4), row[:, 4:]), WeightPiece("row", (3, 8), (0, 0), row[:, :4]),
            WeightPiece("experts", (2, 3, 2), (1, 0, 0), experts[1:]),
            WeightPiece("experts", (2, 3, 2), (0, 0, 0), experts[:1])]
    whole = {"col": torch.zeros(4, 6), "row": torch.zeros(3, 8),
             "experts": torch.zeros(2, 3, 2, dtype=torch.bfloat16)}
    PieceLoader().load(_pieces(whole), _send(sent, 40))
    assert torch.equal(whole["col"], col) and torch.equal(whole["row"], row)
    assert torch.equal(whole["experts"], experts)
    half = torch.zeros(4, 3)  # one rank's half of "col" along axis 1
    loader = PieceLoader()
    loader.load([WeightPiece("col", (4, 6), (0, 3), half)], _send(_pieces({"col": col}), 40))
    assert torch.equal(half, col[:, 3:])


def test_a_replica_the_pieces_do_not_cover_is_refused_naming_the_tensor():
    sent = _pieces(_whole(2))
    target = _pieces({k: torch.zeros_like(t) for k, t in _whole(2).items()})
    missing = target + [WeightPiece("output_layer", (3,), (0,), torch.zeros(3))]
    with pytest.raises(KeyError, match="the weights sent hold no 'output_layer'"):
        PieceLoader().load(missing, _send(sent, 64))
    with pytest.raises(ValueError, match="write 9 of the 15 elements of 'layers.0.w'"):
        PieceLoader().load(target, _send([p if p.key != "layers.0.w" else WeightPiece(
            p.key, p.global_shape, (0, 0), p.tensor[:3]) for p in sent], 64))
    other = [WeightPiece("layers.0.norm", (8,), (0,), torch.zeros(8))]
    with pytest.raises(ValueError, match=r"of shape \(7,\), this model's of \(8,\)"):
        PieceLoader().load(other, _send(sent, 64))
