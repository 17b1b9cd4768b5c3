"""``FlatWeights`` (what the weight channel of ``rollout.placement: separate`` broadcasts): a
model's tensors as one flat buffer per dtype, with the layout a receiver allocates from."""

import torch

from gspo_megatron.policy import FlatWeights


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"layers.1.w": torch.randn(3, 4, generator=gen, dtype=torch.float64),
            "embedding": torch.randn(5, 2, generator=gen).to(torch.bfloat16),
            "layers.0.w": torch.randn(7, generator=gen),
            "experts": torch.randn(2, 3, 2, generator=gen)}


def test_of_keeps_every_tensor_in_key_order_one_buffer_per_dtype():
    tensors = _tensors(0)
    flat = FlatWeights.of(tensors)
    assert [key for key, _, _ in flat.layout] == sorted(tensors)
    assert {d: b.numel() for d, b in flat.buffers.items()} == {"float64": 12, "bfloat16": 10,
                                                                 "float32": 19}
    out = flat.tensors()
    for key, t in tensors.items():
        assert out[key].dtype == t.dtype and torch.equal(out[key], t)
        assert out[key].untyped_storage().data_ptr() == flat.buffers[str(t.dtype)[6:]] \
            .untyped_storage().data_ptr()  # a view: no copy


def test_a_receiver_allocates_from_the_layout_and_reads_what_was_sent():
    sent = FlatWeights.of(_tensors(1))
    inbox = FlatWeights.empty(sent.layout)
    assert all(torch.count_nonzero(b) == 0 for b in inbox.buffers.values())
    for dtype, buf in inbox.buffers.items():  # what a broadcast into the inbox does
        buf.copy_(sent.buffers[dtype])
    assert all(torch.equal(inbox.tensors()[k], t) for k, t in _tensors(1).items())
