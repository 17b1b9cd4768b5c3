"""Pure routing statistics (gspo_megatron.routing.stats) against hand-computed cases."""

import math

import pytest
import torch

from gspo_megatron.routing import stats


def test_route_dtype_is_compact():
    assert stats.route_dtype(4) == torch.uint8 and stats.route_dtype(256) == torch.uint8
    assert stats.route_dtype(257) == torch.uint16 and stats.route_dtype(65536) == torch.uint16
    assert stats.route_dtype(70000) == torch.int32


def test_change_and_jaccard_hand_computed():
    # 2 layers, 4 positions, top-2 of 4 experts; order inside a top-k does not matter.
    old = torch.tensor([[[0, 1], [2, 3], [0, 2], [1, 3]],
                        [[0, 1], [0, 1], [0, 1], [0, 1]]], dtype=torch.uint8)
    new = torch.tensor([[[1, 0], [2, 1], [3, 1], [1, 3]],
                        [[0, 1], [0, 2], [0, 1], [0, 1]]], dtype=torch.uint8)
    changed, jac = stats.route_change(old, new, 4)
    assert changed.tolist() == [[False, True, True, False], [False, True, False, False]]
    assert jac.flatten().tolist() == pytest.approx([1, 1 / 3, 0, 1, 1, 1 / 3, 1, 1])

    mask = torch.tensor([True, True, True, False])  # the last position is padding
    s = stats.layer_sums(old, new, mask, 4)
    assert s.tokens.tolist() == [3, 3] and s.changed.tolist() == [2, 1]
    m = s.metrics(with_entropy=False)
    assert m["routing/change_rate"] == pytest.approx(3 / 6)
    assert m["routing/change_rate/layer_0"] == pytest.approx(2 / 3)
    assert m["routing/change_rate/layer_1"] == pytest.approx(1 / 3)
    assert m["routing/jaccard/layer_0"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    # load of the new routes over the 3 counted positions: layer 0 -> e0:1 e1:3 e2:1 e3:1
    assert s.load[0].tolist() == [1, 3, 1, 1]
    assert m["routing/load_imbalance/layer_0"] == pytest.approx(3 / 1.5)
    assert m["routing/load/layer_0/expert_1"] == pytest.approx(3 / 6)
    # layer 1: e0:3 e1:2 e2:1 e3:0 -> max/mean = 3/1.5
    assert m["routing/load_imbalance/layer_1"] == pytest.approx(2.0)


def test_nothing_changed_gives_zero_change_rate():
    r = torch.randint(0, 8, (3, 50, 2))
    r[..., 1] = (r[..., 0] + 1) % 8  # distinct ids per position
    m = stats.layer_sums(r, r.flip(-1), torch.ones(50, dtype=torch.bool), 8).metrics(with_entropy=False)
    assert m["routing/change_rate"] == 0.0 and m["routing/jaccard"] == 1.0


def test_sums_add_and_round_trip_through_flat():
    a = stats.layer_sums(torch.tensor([[[0, 1]]]), torch.tensor([[[0, 2]]]), torch.tensor([True]), 3)
    b = stats.layer_sums(torch.tensor([[[0, 1]]]), torch.tensor([[[1, 0]]]), torch.tensor([True]), 3)
    c = a + b
    assert c.with_flat(c.flat()).changed.tolist() == [1.0] and c.tokens.tolist() == [2.0]
    assert c.metrics(with_entropy=False)["routing/change_rate"] == 0.5


def test_entropy():
    assert stats.entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert stats.entropy_from_probs(torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(0.0)
    assert stats.entropy_from_probs(torch.tensor([2.0, 2.0])).item() == pytest.approx(math.log(2))


def test_imbalance():
    assert stats.imbalance(torch.tensor([[2.0, 2, 2, 2], [8.0, 0, 0, 0]])).tolist() == [1.0, 4.0]
    assert stats.imbalance(torch.zeros(3)).item() == 0.0


def test_alignment_hand_computed():
    changed = torch.tensor([[True, False, True], [False, False, True]])
    lr = torch.tensor([[0.4, -0.1, 7.0], [0.2, 0.0, -0.6]])
    clipped = torch.tensor([[True, False, False], [False, False, True]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    m = stats.alignment_sums(changed, lr, clipped, mask).metrics()
    # counted: changed = {0.4 (clipped), -0.6 (clipped)}, unchanged = {-0.1, 0.2, 0.0}
    assert m["routing/token_change_rate"] == pytest.approx(2 / 5)
    assert m["routing/abs_log_ratio_changed"] == pytest.approx(0.5)
    assert m["routing/abs_log_ratio_unchanged"] == pytest.approx(0.1)
    assert m["routing/clipfrac_changed"] == 1.0 and m["routing/clipfrac_unchanged"] == 0.0


def _topk_sets(gen, shape, num_experts, k):
    """Random top-k expert ids ``[*shape, k]`` (distinct within a position)."""
    n = math.prod(shape)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(n)])
    return ids.reshape(*shape, k).to(torch.uint8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routes_changed_at_prompt_and_padding_positions_are_not_counted(seed):
    """Every prompt and padding position of a real label-aligned batch gets a different route; at
    response positions a random share changes. Change rate, Jaccard, load and the alignment split
    must equal a float64 reference over the response positions only (a mask leak of prompt or
    padding positions, however mild, changes them)."""
    from gspo_megatron.policy import make_policy_batch

    gen = torch.Generator().manual_seed(seed)
    b, layers, experts, k = 6, 3, 8, 2
    prompt_lens = torch.randint(2, 6, (b,), generator=gen).tolist()
    seqs = [list(range(2, 2 + p + int(torch.randint(1, 8, (1,), generator=gen))))
            for p in prompt_lens]
    batch = make_policy_batch(seqs, prompt_lens, pad_id=0)
    mask = batch.response_mask  # [B, T]: False at prompt and padding positions
    assert (~mask).any(dim=1).all() and mask.any()
    t = mask.shape[1]
    old = _topk_sets(gen, (layers, b * t), experts, k)
    flip = torch.rand(layers, b * t, generator=gen) < 0.3
    new = torch.where((flip | ~mask.reshape(1, -1)).unsqueeze(-1),
                      (old + 1) % experts, old)  # a shifted set always differs
    s = stats.layer_sums(old, new, mask.reshape(-1), experts)

    keep = mask.reshape(-1).tolist()
    for layer in range(layers):
        ch = jac = 0.0
        load = [0] * experts
        for pos, counted in enumerate(keep):
            if not counted:
                continue
            a, c = set(old[layer, pos].tolist()), set(new[layer, pos].tolist())
            ch += a != c
            jac += len(a & c) / len(a | c)
            for e in c:
                load[e] += 1
        assert s.tokens[layer] == sum(keep)
        assert s.changed[layer] == ch and float(s.jaccard[layer]) == pytest.approx(jac, abs=1e-5)  # fp32 per position
        assert s.load[layer].tolist() == load
    assert stats.layer_sums(old, new, mask.reshape(-1), experts).metrics(
        with_entropy=False)["routing/change_rate"] == pytest.approx(float(s.changed.sum()) / (
            layers * sum(keep)))

    # The alignment split: a position counts as changed if any layer changed it, response only.
    changed_any = (flip | ~mask.reshape(1, -1)).any(0).reshape(b, t)
    log_ratio = torch.randn(b, t, generator=gen, dtype=torch.float64)
    clipped = torch.rand(b, t, generator=gen) < 0.5
    a = stats.alignment_sums(changed_any, log_ratio, clipped, mask)
    resp = mask.reshape(-1).tolist()
    ch_pos = [i for i, (c, r) in enumerate(zip(changed_any.reshape(-1).tolist(), resp)) if c and r]
    un_pos = [i for i, (c, r) in enumerate(zip(changed_any.reshape(-1).tolist(), resp)) if r and not c]
    assert a.count.tolist() == [len(un_pos), len(ch_pos)]
    flat_lr, flat_clip = log_ratio.reshape(-1), clipped.reshape(-1)
    assert float(a.abs_log_ratio[1]) == pytest.approx(sum(abs(float(flat_lr[i])) for i in ch_pos))
    assert float(a.clipped[0]) == sum(bool(flat_clip[i]) for i in un_pos)
