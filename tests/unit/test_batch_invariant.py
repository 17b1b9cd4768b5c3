"""gspo_megatron.backends.megatron.kernels.batch_invariant: each op's per-token value is bitwise the
same whatever the batch around it (row counts, order, padding, packing, the decoding step's layout
vs the packed training row), and close to a float64 reference; then the trainer's log-probs of the
same sequences under random batch compositions (packing budgets, padded rows, order, fillers) on
the tiny model with ``precision.batch_invariant``.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import torch.nn.functional as F

from gspo_megatron.backends.megatron.kernels import batch_invariant as bi

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["cpu", "tiles"])
def forms(request, monkeypatch):
    """Each kernel test twice: the CPU forms, and the fixed-tile forms a GPU runs (forced)."""
    if request.param == "tiles":
        monkeypatch.setattr(bi, "cpu_forms", lambda t: False)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 192), (128, 64), (16, 40)])
def test_linear_rows_do_not_depend_on_the_batch(dtype, k, n, forms):
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(200, k, generator=g).to(dtype)
    full = bi.linear(x, w)
    for m in range(1, 201):  # every row count: X[:m] W == (X W)[:m]
        assert torch.equal(bi.linear(x[:m], w), full[:m]), m
    for shift in (1, 5, 31, 33):  # the same rows at other places in their tiles
        other = torch.randn(shift, k, generator=g).to(dtype)
        assert torch.equal(bi.linear(torch.cat((other, x)), w)[shift:], full)
    ref = x.double() @ w.double().t()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(full.double(), ref, rtol=tol, atol=tol * k ** 0.5)
    assert bi.linear(x[:0], w).shape == (0, n)


def test_cpu_gemm_values_do_not_depend_on_the_shape():
    """What the CPU kernels rest on, on the machine and at the thread count running this, all in
    ``F.linear``'s layout: a GEMM's row values do not depend on the row count from
    :data:`bi.ROW_TILE` rows up (``F.linear``, any contraction length: with several threads a
    call's rows are split among them, and a block of 1-3 rows takes another kernel) or from
    :data:`bi.CPU_QUERY_TILE` up (the attention's ``bmm``), nor on the key columns beside them
    (multiples of :data:`bi.CPU_KEY_CHUNK`), nor on the other matrices of a ``bmm``, nor on a
    row's place; ``torch._grouped_mm``'s groups and a ``bmm`` over an expanded input give the
    rows of the same ``F.linear`` (the experts' grouped and dense forms)."""
    g = torch.Generator().manual_seed(17)
    for dtype in DTYPES:
        for k in (16, 64, 2048):
            x = torch.randn(96, k, generator=g).to(dtype)
            w = torch.randn(24, k, generator=g).to(dtype)
            full = F.linear(x, w)
            for m in range(bi.ROW_TILE, 97):
                assert torch.equal(F.linear(x[:m], w), full[:m]), (dtype, k, m)
                assert torch.equal(F.linear(x[96 - m:], w), full[96 - m:]), (dtype, k, m)
        e, n, h, o = 3, 80, 32, 40
        x = torch.randn(n, h, generator=g).to(dtype)
        w = torch.randn(e, o, h, generator=g).to(dtype)
        per_expert = [F.linear(x, w[i]) for i in range(e)]
        dense = torch.bmm(x.expand(e, n, h), w.transpose(1, 2))
        for i in range(e):
            assert torch.equal(dense[i], per_expert[i])
        for sizes in ([32, 0, 48], [40, 40, 0], [80, 0, 0]):
            offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            start = 0
            for i, c in enumerate(sizes):
                assert torch.equal(got[start:start + c], per_expert[i][start:start + c])
                start += c
    for hn in (8, 16, 128):  # attention's GEMMs (fp32), in F.linear's layout (B transposed):
        chunk = bi.CPU_KEY_CHUNK
        q = torch.randn(3, 40, hn, generator=g)  # the scores: queries x keys
        keys = torch.randn(3, 3 * chunk, hn, generator=g).transpose(1, 2)
        p = torch.rand(3, 40, chunk, generator=g)  # p v per key chunk
        v = torch.randn(3, hn, chunk, generator=g).transpose(1, 2)
        scores, pv = torch.bmm(q, keys), torch.bmm(p, v)
        for m in range(bi.CPU_QUERY_TILE, 41, 3):
            for cols in range(chunk, 3 * chunk + 1, chunk):
                assert torch.equal(torch.bmm(q[1:, :m], keys[1:, :, :cols]),
                                   scores[1:, :m, :cols]), (hn, m, cols)
            assert torch.equal(torch.bmm(p[:2, :m], v[:2]), pv[:2, :m]), (hn, m)
            shift = 40 - m  # the same rows at other places
            assert torch.equal(torch.bmm(q[:, shift:], keys), scores[:, shift:]), (hn, m)
            assert torch.equal(torch.bmm(p[:, shift:], v), pv[:, shift:]), (hn, m)


def test_cpu_softmax_values_do_not_depend_on_the_masked_chunks():
    """What the CPU attention's softmax rests on, on the machine and thread count running this:
    a row's weights over its keys are the same bits whatever number of masked key chunks
    (the most negative float) follow them, whatever the other rows, and each masked weight is
    an exact zero (the decoding step's window and the packed training row's differ)."""
    g = torch.Generator().manual_seed(5)
    low = torch.finfo(torch.float32).min
    chunk = bi.CPU_KEY_CHUNK
    for n in (1, 7, 31, 32, 33, 100, 250):
        x = torch.randn(1, n, generator=g) * 4
        first = None
        for width in range(-(-n // chunk) * chunk, 16 * chunk + 1, chunk):
            row = torch.cat((x, torch.full((1, width - n), low)), 1)
            others = torch.randn(int(torch.randint(0, 9, (1,), generator=g)), width,
                                 generator=g)
            p = torch.softmax(torch.cat((others, row)), -1)[-1]
            assert torch.equal(p[n:], torch.zeros(width - n)), (n, width)
            first = p[:n] if first is None else first
            assert torch.equal(p[:n], first), (n, width)


def reference_attention(q, k, v, scale):
    """float64 causal-free attention of one query ``[np, hn]`` over ``k, v [L, ng, hn]``."""
    r = q.shape[0] // k.shape[1]
    kk, vv = k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), kk) * scale, -1)
    return torch.einsum("hl,lhd->hd", p, vv)


@pytest.mark.parametrize("dtype,hn,window", [(torch.float32, 16, 40), (torch.bfloat16, 16, 40),
                                             (torch.float32, 8, 40), (torch.float32, 16, 64)])
def test_attention_decode_layout_equals_packed_row(dtype, hn, window, forms):
    """A token's attention output is the same bits in the decoding step's layout (one query over
    its cached keys, beside other requests, the key window padded with finite junk) and in a
    packed training row (its sequence among others, in another order). ``window`` 64 and the
    32-token sequence: key windows of whole chunks (no padding), which once failed on CPU."""
    g = torch.Generator().manual_seed(3)
    np_, ng, scale = 4, 2, 0.25
    lens = [5, 17, 1, 33, 9] if window == 40 else [5, 32, 1, 33, 9]
    seqs = [(torch.randn(L, np_, hn, generator=g).to(dtype),
             torch.randn(L, ng, hn, generator=g).to(dtype),
             torch.randn(L, ng, hn, generator=g).to(dtype)) for L in lens]
    order = [3, 0, 4, 1, 2]
    q = torch.cat([seqs[i][0] for i in order])
    k = torch.cat([seqs[i][1] for i in order])
    v = torch.cat([seqs[i][2] for i in order])
    starts = [0]
    for i in order:
        starts.append(starts[-1] + lens[i])
    packed = bi.packed_attention(q, k, v, starts, scale)  # [S, np, hn]
    at = {i: starts[j] for j, i in enumerate(order)}
    for i, (qs, ks, vs) in enumerate(seqs):
        for t in range(lens[i]):
            junk_k = torch.randn(3, window, ng, hn, generator=g).to(dtype)
            junk_v = torch.randn(3, window, ng, hn, generator=g).to(dtype)
            junk_k[1, :t + 1], junk_v[1, :t + 1] = ks[:t + 1], vs[:t + 1]
            allowed = torch.rand(3, 1, window, generator=g) < 0.5
            allowed[1] = torch.arange(window) <= t
            queries = torch.randn(3, np_, 1, hn, generator=g).to(dtype)
            queries[1, :, 0] = qs[t]
            step = bi.attention(queries, junk_k, junk_v, allowed, scale)[1, :, 0]
            assert torch.equal(step, packed[at[i] + t]), (i, t)
            ref = reference_attention(qs[t], ks[:t + 1], vs[:t + 1], scale)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(step.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_do_not_depend_on_the_batch_or_padded_columns(dtype):
    g = torch.Generator().manual_seed(5)
    vocab = 300
    logits = (torch.randn(64, vocab, generator=g) * 4).to(dtype)
    target = torch.randint(0, vocab, (64,), generator=g)
    lp, ent = bi.token_logprobs(logits, target, vocab, 0.7, compute_entropy=True)
    ref = torch.log_softmax(logits.double() / 0.7, -1)
    assert torch.allclose(lp.double(), ref.gather(1, target[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5)
    # the engine's logits: the padded vocabulary's columns -inf, divided by the temperature first
    padded = torch.cat((logits.float() / 0.7, torch.full((64, 84), float("-inf"))), 1)
    for m in (1, 3, 17, 64):
        assert torch.equal(bi.token_logprobs(padded[:m], target[:m])[0], lp[:m])
        assert torch.equal(bi.token_logprobs(logits[-m:], target[-m:], vocab, 0.7)[0], lp[-m:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_linear_rows_do_not_depend_on_the_counts(dtype, forms):
    """A row's value through its expert is the same whatever the other experts' counts and its
    own (its place in its tiles): every expert's rows in one ``bmm`` of fixed tiles."""
    g = torch.Generator().manual_seed(11)
    E, K, O = 4, 48, 40
    w = torch.randn(E, O, K, generator=g).to(dtype)
    x = torch.randn(100, K, generator=g).to(dtype)
    ref = torch.cat([bi.expert_linear(x[i:i + 1], [0, 0, 1, 0], w) for i in range(100)])
    for counts in ([100, 0, 0, 0], [1, 33, 0, 66], [31, 32, 33, 4], [0, 0, 0, 100]):
        got = bi.expert_linear(x, counts, w)
        starts = [sum(counts[:e]) for e in range(E)]
        for e in range(E):  # rows of expert e against expert 2 alone: compare via expert e's own
            rows = slice(starts[e], starts[e] + counts[e])
            alone = torch.cat([bi.expert_linear(x[i:i + 1], [1], w[e:e + 1])
                               for i in range(rows.start, rows.stop)] or [got[:0]])
            assert torch.equal(got[rows], alone), (counts, e)
    assert torch.equal(ref, torch.cat([bi.expert_linear(x[i:i + 1], [1], w[2:3])
                                       for i in range(100)]))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(ref.double(), x.double() @ w[2].double().t(), rtol=tol,
                          atol=tol * K ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,k", [(6, 3), (8, 2)])  # on CPU: every expert (dense) / routed rows
def test_experts_per_token_values_and_fixed_order(dtype, E, k, forms):
    """A token's expert output does not depend on the other tokens routed with it; the k outputs
    are added in ascending expert index (top-k given in any order)."""
    g = torch.Generator().manual_seed(7)
    H, Fh, T = 32, 24, 40
    fc1 = torch.randn(E, 2 * Fh, H, generator=g).to(dtype)
    fc2 = torch.randn(E, H, Fh, generator=g).to(dtype)
    tokens = torch.randn(T, H, generator=g).to(dtype)
    top = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g)

    def act(h, p):
        return bi.scaled_activation(h, p, F.silu, True, 0.0, dtype)

    full = bi.experts(tokens, top, probs, fc1, fc2, act)
    perm = torch.randperm(T, generator=g)
    for m in (1, 2, 7, T):
        rows = perm[:m]
        got = bi.experts(tokens[rows], top[rows].flip(1), probs[rows].flip(1), fc1, fc2, act)
        assert torch.equal(got, full[rows]), m
    # the order of addition: ascending expert index, starting from zero; with EP (this rank's
    # experts from `first`) the other ranks' routes skipped
    for first in (0, 2):
        here = bi.experts(tokens, top, probs, fc1[first:], fc2[first:], act, first)
        for t in (0, 5, T - 1):
            acc = torch.zeros(1, H, dtype=dtype)
            for j in torch.argsort(top[t]):
                e = int(top[t, j])
                if e >= first:
                    h = act(bi.expert_linear(tokens[t:t + 1], [1], fc1[e:e + 1]),
                            probs[t, j:j + 1])
                    acc = acc + bi.expert_linear(h, [1], fc2[e:e + 1])
            assert torch.equal(here[t:t + 1], acc), (first, t)
    # float64 reference
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(top[t, j])
            h = tokens[t].double() @ fc1[e].double().t()
            a = F.silu(h[:Fh]) * h[Fh:] * probs[t, j].double()
            ref[t] += a @ fc2[e].double().t()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(full.double(), ref, rtol=tol, atol=tol * ref.abs().max())


@pytest.mark.slow
def test_trainer_logprobs_bitwise_under_random_batch_compositions():
    """The tiny model with ``precision.batch_invariant``: the log-probs of the same sequences,
    scored in random batches (other sequences beside them, shuffled, packed under random token
    budgets or padded in random micro-batch sizes), are bitwise equal; without the mode they are
    not (on this machine's CPU: the row-count-dependent GEMMs)."""
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.config.model import (ParallelConfig, PrecisionConfig,
                                            model_config_from_preset)
    from gspo_megatron.policy import make_policy_batch

    os.environ.setdefault("TQDM_DISABLE", "1")
    model = model_config_from_preset("tiny", vocab_size=32, seq_length=48,
                                     moe_aux_loss_coeff=0.0)
    groups = initialize_distributed(ParallelConfig(), model, seed=21)
    try:
        rng = random.Random(0)
        pool = [[rng.randrange(3, 32) for _ in range(rng.randrange(3, 40))] for _ in range(24)]
        watched = pool[:6]
        differ = {}
        for invariant in (True, False):
            policy = build_policy(model, ParallelConfig(), PrecisionConfig(
                transformer_impl="local", batch_invariant=invariant), OptimConfig(), groups,
                total_steps=1, with_optimizer=False, vocab_size=32,
                max_tokens_per_microbatch=64)
            seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(watched))}
            for trial in range(6):
                fillers = rng.sample(pool[6:], rng.randrange(0, 12))
                seqs = watched + fillers
                rng.shuffle(seqs)
                packed = trial % 3 != 2
                policy.logprob_batching = dataclasses.replace(
                    policy.logprob_batching, micro_batch_size=rng.choice([1, 2, 3, 5]),
                    max_tokens=rng.choice([48, 64, 100, 160]) if packed else None)
                batch = make_policy_batch(seqs, [2] * len(seqs), pad_id=0)
                lp = policy.logprobs(batch)
                for i, s in enumerate(watched):
                    row = next(j for j, t in enumerate(seqs) if t is s)
                    seen[i].append(lp[row, 1:len(s) - 1].clone())
            differ[invariant] = sum(not torch.equal(v[0], other) for v in seen.values()
                                    for other in v[1:])
            if invariant:
                for v in seen.values():
                    assert all(torch.equal(v[0], other) for other in v[1:])
        print(f"MEASURED sequences scored differently across compositions: mode on "
              f"{differ[True]}, off {differ[False]} (of {len(watched) * 5})")
    finally:
        destroy_distributed()


def test_tokens_differ_counts_the_stale_prefix_apart():
    """``mismatch/tokens_differ`` over the response tokens; a partial rollout's carried prefix
    (``extra["stale_tokens"]``) counted in ``mismatch/tokens_differ_stale`` instead."""
    from gspo_megatron.algorithms.objectives import stale_mask, tokens_differ
    from gspo_megatron.policy import STALE_TOKENS_KEY, RolloutSample

    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    train = torch.zeros(2, 5)
    rollout = torch.tensor([[9.0, 1.0, 0.0, 1.0, 9.0], [0.0, 0.0, 1.0, 1.0, -0.0]])
    assert tokens_differ(train, rollout, mask) == {"mismatch/tokens_differ": 4.0}  # (-0.0 == 0.0)
    plain = [RolloutSample([1], [2], [0.0], "eos") for _ in range(2)]
    assert stale_mask(plain, mask) is None
    samples = [RolloutSample([1], [2, 3, 4], [0.0] * 3, "eos", {STALE_TOKENS_KEY: 2}),
               RolloutSample([1], [2, 3, 4], [0.0] * 3, "eos", {STALE_TOKENS_KEY: 0})]
    stale = stale_mask(samples, mask)
    assert stale.tolist() == [[False, True, True, False, False], [False] * 5]
    assert tokens_differ(train, rollout, mask, stale) == {
        "mismatch/tokens_differ": 3.0, "mismatch/tokens_differ_stale": 1.0}


def test_gradients_are_the_functions_gradients(forms):
    """The training forward differentiates through :func:`bi.linear` and :func:`bi.attention`
    (their backward: ``F.linear``'s and SDPA's on the same inputs): gradients equal a float64
    autograd reference's."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(37, 24, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    up = torch.randn(37, 40, generator=g)
    gx, gw = torch.autograd.grad((bi.linear(x, w) * up).sum(), (x, w))
    rx, rw = torch.autograd.grad((F.linear(x.double(), w.double()) * up.double()).sum(),
                                 (x, w))
    assert torch.allclose(gx, rx, atol=1e-4) and torch.allclose(gw, rw, atol=1e-4)

    B, np_, ng, L, hn = 3, 4, 2, 20, 8
    q = torch.randn(B, np_, L, hn, generator=g, requires_grad=True)
    k = torch.randn(B, L, ng, hn, generator=g, requires_grad=True)
    v = torch.randn(B, L, ng, hn, generator=g, requires_grad=True)
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L)
    up = torch.randn(B, np_, L, hn, generator=g)
    got = torch.autograd.grad((bi.attention(q, k, v, causal, 0.3) * up).sum(), (q, k, v))
    qd, kd, vd = (t.double() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(np_ // ng, 2).transpose(1, 2) for t in (kd, vd))
    s = (qd @ kk.transpose(-1, -2) * 0.3).masked_fill(~causal[:, None], float("-inf"))
    ref = torch.autograd.grad((torch.softmax(s, -1) @ vv * up.double()).sum(), (q, k, v))
    for a, b in zip(got, ref):  # (gradients of float leaves: float, from a float64 graph)
        assert torch.allclose(a, b, atol=1e-5)
