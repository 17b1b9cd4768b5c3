"""Packed microbatches (``trainer.max_tokens_per_microbatch``): the layout (pure torch) and, on a
tiny Megatron MoE in one process, packed vs padded log-probs, losses and gradients for every loss
variant, with R2 and R3 routing replay. The layouts TP=2+SP / EP=2 / PP=2 / DP=2 are in
tests/distributed/test_parallel_invariance.py (``test_packed_microbatches_match_padded...``)."""

import pytest
import torch

from gspo_megatron.layout import (PackedRows, RankBalance, balance_across_ranks,
                                  pack_into_microbatches)


# ----------------------------------------------------------------------------- layout (fast)

def test_pack_and_unpack_round_trip_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n, t = int(torch.randint(1, 7, (1,), generator=gen)), 12
        lengths = torch.randint(1, t + 1, (n,), generator=gen)
        multiple = int(torch.randint(1, 5, (1,), generator=gen))
        p = PackedRows.of(lengths, multiple)
        x = torch.randn(n, t, generator=gen)
        real = torch.arange(t)[None, :] < lengths[:, None]
        packed = p.pack(x, pad_value=7.0)
        assert packed.shape == (1, p.total) and p.total % multiple == 0
        assert p.total - int(lengths.sum()) < multiple
        assert torch.equal(packed[0, : p.real_tokens], x[real])  # row by row, in order
        assert (packed[0, p.real_tokens:] == 7.0).all()
        assert torch.equal(p.unpack(packed, t), torch.where(real, x, 0.0))


def test_positions_segments_and_padding_mask():
    p = PackedRows.of(torch.tensor([3, 1, 2]), pad_to_multiple_of=4)  # 6 real + 2 pad
    assert p.total == 8 and p.pad_tokens == 2
    assert p.cu_seqlens().tolist() == [0, 3, 4, 6, 8]  # the pad is a segment of its own
    assert p.cu_seqlens().dtype == torch.int32
    assert p.position_ids().tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert p.padding_mask().tolist() == [[False] * 6 + [True] * 2]
    assert p.max_seqlen() == 3
    exact = PackedRows.of(torch.tensor([3, 1]))
    assert exact.padding_mask() is None and exact.cu_seqlens().tolist() == [0, 3, 4]


def test_unpack_is_differentiable_and_drops_the_pad():
    p = PackedRows.of(torch.tensor([2, 3]), pad_to_multiple_of=3)
    y = torch.randn(1, p.total, requires_grad=True)
    p.unpack(y, 4).sum().backward()
    assert y.grad[0].tolist() == [1.0] * 5 + [0.0]


@pytest.mark.parametrize("seed", range(5))
def test_microbatches_hold_every_sequence_once_within_the_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (40,), generator=gen).tolist()
    budget, multiple = 128, 2
    bins = pack_into_microbatches(lengths, budget, multiple)
    assert sorted(i for b in bins for i in b) == list(range(40))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(-(-load // multiple) * multiple <= budget for load in loads)
    assert all(b == sorted(b) for b in bins)
    # First-fit decreasing wastes little: within one bin of the tokens' lower bound.
    assert len(bins) <= -(-sum(lengths) // budget) + 1
    more = pack_into_microbatches(lengths, budget, multiple, min_microbatches=len(bins) + 3)
    assert len(more) == len(bins) + 3
    assert sorted(i for b in more for i in b) == list(range(40))
    assert pack_into_microbatches(lengths, budget, multiple) == bins  # deterministic


def test_microbatch_refusals_name_the_budget():
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than "
                                         "max_tokens_per_microbatch=8"):
        pack_into_microbatches([3, 9], 8)
    with pytest.raises(ValueError, match="more than max_tokens_per_microbatch=8"):
        pack_into_microbatches([8], 8, pad_to_multiple_of=3)  # 8 rounds up to 9
    with pytest.raises(ValueError, match="3 microbatches asked for 2 sequences"):
        pack_into_microbatches([1, 2], 8, min_microbatches=3)


@pytest.mark.parametrize("seed", range(40))
def test_rank_balance_keeps_minibatches_and_evens_tokens(seed):
    """Every sequence trained exactly once, in its own minibatch, each rank as many per
    minibatch as before; no rank above the mean by more than the minibatch's longest sequence,
    on long-tailed (log-normal) lengths at 2-8 ranks."""
    gen = torch.Generator().manual_seed(seed)
    ranks, minibatches, per = (int(torch.randint(lo, hi, (1,), generator=gen))
                               for lo, hi in ((2, 9), (1, 4), (1, 9)))
    lengths = torch.distributions.LogNormal(5.0, 1.2).sample((ranks, minibatches * per))
    lengths = lengths.long().clamp(1, 16_000).tolist()
    plan = balance_across_ranks(lengths, minibatches)
    placed = sorted((src, pos) for r in range(ranks) for mb in plan.sources[r] for src, pos in mb)
    assert placed == [(r, p) for r in range(ranks) for p in range(minibatches * per)]
    for r in range(ranks):
        assert plan.sizes(r) == [per] * minibatches
        for m, mb in enumerate(plan.sources[r]):
            assert all(m * per <= pos < (m + 1) * per for _, pos in mb)
            assert plan.tokens_after[r][m] == sum(lengths[src][pos] for src, pos in mb)
            assert plan.tokens_before[r][m] == sum(lengths[r][m * per:(m + 1) * per])
    for m in range(minibatches):
        loads = [plan.tokens_after[r][m] for r in range(ranks)]
        longest = max(lengths[r][p] for r in range(ranks) for p in range(m * per, (m + 1) * per))
        assert max(loads) - sum(loads) / ranks <= longest
        assert max(loads) <= max(plan.tokens_before[r][m] for r in range(ranks))  # never worse
    assert balance_across_ranks(lengths, minibatches) == plan  # deterministic


def test_rank_balance_moves_only_what_it_must():
    # Rank 0 sampled every long response: 4 x 100 vs 4 x 10 tokens (imbalance 1.82).
    plan = balance_across_ranks([[100] * 4, [10] * 4], 1)
    assert RankBalance.imbalance(plan.tokens_before) == pytest.approx(400 / 220)
    assert plan.tokens_after == [[220], [220]]
    assert RankBalance.imbalance(plan.tokens_after) == 1.0
    # Already even: nothing moves (greedy would make 11 / 13 of 12 / 12 here).
    even = balance_across_ranks([[6, 5, 1], [4, 4, 4]], 1)
    assert even.sources == [[[(0, 0), (0, 1), (0, 2)]], [[(1, 0), (1, 1), (1, 2)]]]
    assert even.tokens_after == even.tokens_before == [[12], [12]]
    with pytest.raises(ValueError, match="do not split into 3 minibatches"):
        balance_across_ranks([[1, 2], [3, 4]], 3)
    with pytest.raises(ValueError, match="as many sequences"):
        balance_across_ranks([[1, 2], [3]], 1)


def test_packed_attention_groups_by_length_and_matches_each_sequence_alone():
    """The CPU kernel for packed rows (``row_attention.packed_sdpa``) on a long-tailed row
    (lengths 1..40, GQA): every sequence's output and the gradients of q/k/v equal causal SDPA on
    that sequence alone (float64); the sequences are padded in groups of similar length (each
    within 2x of its group's longest), not all to the longest."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from gspo_megatron.backends.megatron.kernels.row_attention import length_groups, packed_sdpa

    gen = torch.Generator().manual_seed(3)
    lens = [3, 40, 5, 17, 1, 9, 33, 2, 11]
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert all(max(lens[i] for i in g) <= 2 * min(lens[i] for i in g) for g in groups)
    assert all(g == sorted(g) for g in groups) and len(groups) == 4  # 40 33 | 17 11 9 | 5 3 | 2 1
    assert length_groups([4, 4, 3]) == [[0, 1, 2]]  # one group: the packed order as it is
    total = sum(lens)
    q = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(total, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    params = SimpleNamespace(cu_seqlens_q=cu, max_seqlen_q=max(lens))
    out = packed_sdpa(q, k, v, params, scale=0.3)
    ref = torch.cat([F.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=0.3,
        enable_gqa=True)[0].transpose(0, 1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    cotangent = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), cotangent)
    want = torch.autograd.grad(ref, (q, k, v), cotangent)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_context_shards_are_megatrons_load_balanced_chunks(size):
    """``ContextShard``: rank r holds chunks r and 2 size - 1 - r of 2 size; the ranks' shards
    cover every position once, put back in order by ``unshard``; a row that does not split is
    refused."""
    from gspo_megatron.layout import ContextShard

    t = 4 * size * 3
    shards = [ContextShard(r, size) for r in range(size)]
    chunk = t // (2 * size)
    assert shards[0].positions(t).tolist() == [*range(chunk), *range(t - chunk, t)]
    assert sorted(torch.cat([s.positions(t) for s in shards]).tolist()) == list(range(t))
    x = torch.randn(3, t, 5, generator=torch.Generator().manual_seed(size))
    parts = [s.shard(x, t) for s in shards]
    assert all(p.shape == (3, t // size, 5) for p in parts)
    assert torch.equal(shards[0].unshard(parts), x)
    with pytest.raises(ValueError, match="does not split into 2 x context_parallel_size"):
        ContextShard(0, 2).positions(6)


@pytest.mark.parametrize("size, sp", [(2, 1), (3, 1), (2, 2)])
def test_packed_context_shards_split_every_sequence(size, sp):
    """A packed row under context parallelism (``segment_multiple`` 2 x CP): each sequence's
    segment is rounded up to 2 CP (its pads after its tokens), the row to 2 CP x SP; rank r holds
    chunks r and 2 CP - 1 - r of every segment (Megatron / TE's thd split), the ranks' shares
    cover the row once; values go to a share and back (``gather_rows`` / ``scatter_rows``) and
    the positions a rank holds of each sequence are ``ContextShard.segment_held``'s, whatever the
    packing."""
    from gspo_megatron.layout import ContextShard

    gen = torch.Generator().manual_seed(size * 10 + sp)
    for _ in range(10):
        n, t = int(torch.randint(1, 6, (1,), generator=gen)), 23
        lengths = torch.randint(1, t + 1, (n,), generator=gen)
        p = PackedRows.of(lengths, 2 * size * sp, 2 * size)
        seg = p.segment_lengths()
        assert (seg % (2 * size) == 0).all() and p.total % (2 * size * sp) == 0
        assert (seg[:n] - lengths).lt(2 * size).all() and (seg[:n] >= lengths).all()
        cu = p.cu_seqlens().long()
        assert torch.equal(cu[1:] - cu[:-1], seg)
        real_cu = p.cu_seqlens_real().long()
        assert torch.equal((real_cu[1:] - real_cu[:-1])[:n], lengths)
        x = torch.randn(n, t, generator=gen)
        real = torch.arange(t)[None, :] < lengths[:, None]
        packed = p.pack(x, pad_value=7.0)[0]
        for i in range(n):  # sequence i at the start of its segment, its pads after it
            a, length = int(cu[i]), int(lengths[i])
            assert torch.equal(packed[a:a + length], x[i, :length])
            assert (packed[a + length:int(cu[i + 1])] == 7.0).all()
        assert torch.equal(p.padding_mask()[0], packed == 7.0)
        assert torch.equal(p.unpack(packed[None], t), torch.where(real, x, 0.0))
        shards = [ContextShard(r, size) for r in range(size)]
        index = [p.context_index(s) for s in shards]
        assert sorted(torch.cat(index).tolist()) == list(range(p.total))
        within = p.position_ids()[0]
        chunk = torch.repeat_interleave(seg // (2 * size), seg)
        total_held = torch.zeros(n, t)
        for s, idx in zip(shards, index):
            assert idx.numel() == p.total // size and torch.equal(idx, idx.sort().values)
            part = within[idx] // chunk[idx]
            assert ((part == s.rank) | (part == 2 * size - 1 - s.rank)).all()
            held = p.held(s, t)
            assert torch.equal(held, s.segment_held(lengths, t))
            total_held += held
            share = p.gather_rows(x, 7.0, s)
            assert torch.equal(share, packed[idx])
            back = p.scatter_rows(share, t, s)
            assert torch.equal(back, torch.where(held, x, 0.0))
        assert torch.equal(total_held, real.float())  # every real position on exactly one rank


# ----------------------------------------------------------------------------- on Megatron (slow)

VARIANTS = {
    "gspo": dict(variant="gspo", clip_low=0.01, clip_high=0.01),
    "gspo_token": dict(variant="gspo_token", clip_low=0.005, clip_high=0.01),
    "grpo_seq_mean": dict(variant="grpo", clip_low=0.1, clip_high=0.2),
    "grpo_token_mean": dict(variant="grpo", clip_low=0.1, clip_high=0.2, aggregation="token_mean"),
}
BUDGET = 48  # several microbatches of the 8 sequences (5-30 tokens), rows out of batch order


@pytest.fixture(scope="module")
def setup():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.config.model import (ParallelConfig, PrecisionConfig,
                                            model_config_from_preset)
    from gspo_megatron.policy import make_policy_batch

    # Aux loss off: it is per microbatch and packing changes which sequences share one.
    model = model_config_from_preset("tiny", num_layers=3, moe_layer_freq=[1, 0, 1], seq_length=32,
                                     moe_aux_loss_coeff=0.0)
    groups = initialize_distributed(ParallelConfig(), model, seed=5)
    policy = build_policy(model, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False,
                          micro_batch_size=4)
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(5, 31, (8,), generator=gen)
    seqs = [torch.randint(1, 100, (int(n),), generator=gen).tolist() for n in lengths]
    batch = make_policy_batch(seqs, torch.randint(2, 5, (8,), generator=gen).tolist(), pad_id=0)
    batch.advantages = torch.randn(8, generator=gen, dtype=torch.float64).float()
    lp = policy.logprobs(batch)
    # pi_old = pi + per-token noise + a per-sequence shift, so sequence ratios clip too.
    shift = 0.02 * torch.randn(8, 1, generator=gen)
    batch.old_logprobs = lp + (0.2 * torch.randn(lp.shape, generator=gen) + shift) * batch.response_mask
    state = {k: v.clone() for k, v in policy.unwrapped().state_dict().items() if torch.is_tensor(v)}
    yield policy, groups, batch, state
    destroy_distributed()


def _batching(policy, packed: bool):
    from gspo_megatron.backends.megatron.schedule import Microbatching

    return Microbatching(micro_batch_size=4, max_tokens=BUDGET if packed else None)


def _update(policy, batch, loss_kwargs, packed, routing=None):
    """``(loss, [every parameter's gradient])`` of one minibatch update, packed or padded."""
    from gspo_megatron.algorithms import PolicyGradientObjective, PolicyLossConfig

    policy.batching = _batching(policy, packed)
    policy.zero_grad()
    metrics = policy.train_minibatch(
        batch, PolicyGradientObjective(PolicyLossConfig(**loss_kwargs)), routing=routing)
    return metrics, [p.main_grad.clone() for p in policy.unwrapped().parameters()]


def _assert_close(padded, packed):
    (m1, g1), (m2, g2) = padded, packed
    scale = max(float(g.abs().max()) for g in g1)
    worst = max(float((a - b).abs().max()) for a, b in zip(g1, g2))
    assert scale > 0 and len(g1) > 20
    # fp32, another summation order: the measured worst is ~1e-8 of a ~0.1 gradient scale
    assert worst <= 1e-5 * scale, (worst, scale)
    assert m2["loss/policy"] == pytest.approx(m1["loss/policy"], rel=1e-5, abs=1e-7)
    return worst, scale


@pytest.mark.slow
def test_packed_logprobs_equal_padded(setup):
    from gspo_megatron.backends.megatron.schedule import make_microbatches

    policy, groups, batch, _ = setup
    policy.batching = _batching(policy, packed=True)
    micro = make_microbatches(batch, policy.batching, groups)
    assert len(micro) >= 3 and all(mb.packing.total <= BUDGET for mb in micro)
    assert torch.cat([mb.rows for mb in micro]).tolist() != list(range(8))  # out of order
    packed = policy.logprobs(batch)
    policy.batching = _batching(policy, packed=False)
    padded = policy.logprobs(batch)
    m = batch.response_mask
    assert torch.allclose(packed[m], padded[m], atol=2e-6, rtol=0), (packed - padded)[m].abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_update_equals_padded(setup, name):
    """Loss and every parameter's gradient: packed within fp32 tolerance of padded, for GSPO,
    GSPO-token and GRPO with both aggregations."""
    policy, _, batch, _ = setup
    padded = _update(policy, batch, VARIANTS[name], packed=False)
    packed = _update(policy, batch, VARIANTS[name], packed=True)
    assert padded[0]["clip/fraction"] > 0  # the batch clips: the clip rule is exercised
    _assert_close(padded, packed)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_packed_routing_replay_equals_padded(setup, mode):
    """Routes recorded by one layout replay in the other: R2 (the old pass's routes, recorded
    packed, replayed padded and packed after the weights moved) and R3 (a partial store, as the
    rollout engine's covers all but the last token, replayed with free routing elsewhere). The
    replayed update's loss and gradients are the same packed and padded, and differ from free
    routing (the replay is not a no-op)."""
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting, RouteStore

    policy, groups, batch, state = setup
    routing = ModelRouting(policy.model, groups)
    policy.batching = _batching(policy, packed=True)
    rec = routing.recorder()
    policy.logprobs(batch, routing=rec)  # old pass, packed
    store = rec.store()
    policy.batching = _batching(policy, packed=False)
    rec_padded = routing.recorder()
    policy.logprobs(batch, routing=rec_padded)
    routes = batch.response_mask.clone()
    routes[:, 0] = True  # positions whose routes both layouts computed
    assert torch.equal(store.indices[:, routes], rec_padded.store().indices[:, routes])
    if mode == "r3":  # the engine covers every token but the last of each sequence
        lengths = batch.layout.lengths
        store.known = torch.arange(batch.seq_length)[None, :] < (lengths - 1)[:, None]
    try:
        with torch.no_grad():  # the policy moved since the old pass: routes change
            gen = torch.Generator().manual_seed(2)
            for p in policy.unwrapped().parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
        loss = VARIANTS["gspo"]
        free = _update(policy, batch, loss, packed=True)
        padded = _update(policy, batch, loss, packed=False,
                         routing=routing.replayer(store, 4, capture_natural=True))
        hooks = routing.replayer(store, 4, capture_natural=True)
        packed = _update(policy, batch, loss, packed=True, routing=hooks)
        worst, _ = _assert_close(padded, packed)
        assert max(float((a - b).abs().max()) for a, b in zip(free[1], packed[1])) > 1e3 * worst
        natural = hooks.natural_store()  # free routing's choices, put back in batch order
        assert natural.indices.shape == store.indices.shape
        changed = (natural.indices != store.indices).any(-1)[:, batch.response_mask]
        assert changed.any()  # the moved policy would route some tokens elsewhere
        if mode == "r3":
            used = hooks.replayed_store()
            assert torch.equal(used.indices[:, store.known], store.indices[:, store.known])
            assert isinstance(used, RouteStore)
    finally:
        policy.unwrapped().load_state_dict(state, strict=False)
