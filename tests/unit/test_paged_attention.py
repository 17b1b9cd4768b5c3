"""The PyTorch fallback for flash-attn's paged kernels against a plain per-request loop (float64)."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from gspo_megatron.compat import paged_attention as pa

BLOCK = 4  # lengths below are deliberately not multiples of it
H, HK, D = 4, 2, 8  # GQA: two query heads per kv head


def _caches(num_blocks, gen, dtype=torch.float64):
    shape = (num_blocks, BLOCK, HK, D)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)


def _block_table(kv_lens, num_blocks, max_blocks, gen):
    """Shuffled, non-contiguous block ids; -1 for unused slots and for padded (kv 0) requests."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(kv_lens), max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(kv_lens):
        for slot in range(math.ceil(n / BLOCK)):
            table[b, slot] = free.pop()
    return table


def _reference(q, k_cache, v_cache, q_lens, kv_lens, table, scale, causal):
    """Per request: keys materialised from the block table by Python indexing, full softmax."""
    out = torch.zeros_like(q)
    start = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        if ql == 0 or kl == 0:
            start += ql
            continue
        keys = torch.stack([k_cache[int(table[b, j // BLOCK]), j % BLOCK] for j in range(kl)])
        vals = torch.stack([v_cache[int(table[b, j // BLOCK]), j % BLOCK] for j in range(kl)])
        for h in range(q.shape[1]):
            hk = h // (q.shape[1] // keys.shape[1])
            scores = q[start:start + ql, h] @ keys[:, hk].T * scale  # [ql, kl]
            if causal:  # bottom-right: query i at position kl - ql + i
                for i in range(ql):
                    scores[i, kl - ql + i + 1:] = -math.inf
            out[start:start + ql, h] = torch.softmax(scores, dim=-1) @ vals[:, hk]
        start += ql
    return out


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_matches_per_request_loop(causal, scale):
    gen = torch.Generator().manual_seed(1234)
    # fresh prefill, chunked prefill over a cached prefix, a decode token, a padded request
    q_lens, kv_lens = [5, 3, 1, 6, 0], [5, 11, 7, 9, 0]
    pad_tail = 3
    k_cache, v_cache = _caches(num_blocks=20, gen=gen)
    table = _block_table(kv_lens, num_blocks=20, max_blocks=5, gen=gen)
    q = torch.randn(sum(q_lens) + pad_tail, H, D, generator=gen, dtype=torch.float64)

    out = pa.flash_attn_varlen_func(q, k_cache, v_cache, _cu(q_lens), _cu(kv_lens),
                                    max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens),
                                    softmax_scale=scale, causal=causal, block_table=table)

    ref = _reference(q, k_cache, v_cache, q_lens, kv_lens, table,
                     D ** -0.5 if scale is None else scale, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert torch.all(out[sum(q_lens):] == 0)  # padded tail tokens


@pytest.mark.parametrize("sq", [1, 2])
def test_kvcache_decode_matches_per_request_loop(sq):
    gen = torch.Generator().manual_seed(99)
    kv_lens = [7, 1 + sq, 0, 13]  # third row: a padded request
    k_cache, v_cache = _caches(num_blocks=16, gen=gen)
    table = _block_table(kv_lens, num_blocks=16, max_blocks=4, gen=gen)
    q = torch.randn(len(kv_lens), sq, H, D, generator=gen, dtype=torch.float64)

    out = pa.flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache,
                                     cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32),
                                     causal=True, block_table=table, num_splits=0)

    q_lens = [sq if n else 0 for n in kv_lens]
    flat = q.reshape(-1, H, D)[torch.tensor([n > 0 for n in kv_lens]).repeat_interleave(sq)]
    ref = _reference(flat, k_cache, v_cache, q_lens, kv_lens, table, D ** -0.5, True)
    assert out.shape == q.shape
    torch.testing.assert_close(out[torch.tensor(kv_lens) > 0].reshape(-1, H, D), ref,
                               rtol=0, atol=1e-12)
    assert torch.all(out[2] == 0)


def test_single_query_plan_is_the_general_plan():
    """A decoding step's plan (``_Plan.single_query``) holds exactly what the general plan
    builds for one query per request: key rows, mask, live queries, key count (random lengths,
    empty requests, one or several blocks, unused -1 slots)."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        B = int(torch.randint(1, 20, (1,), generator=gen))
        max_blocks = int(torch.randint(1, 5, (1,), generator=gen))
        kv = torch.randint(0, max_blocks * BLOCK + 1, (B,), generator=gen)
        if trial % 3 == 0:
            kv = kv.clamp(min=1)
        table = torch.randint(-1, 30, (B, max_blocks), generator=gen).int()
        most = int(kv.max())
        general = pa._Plan(torch.ones(B, dtype=torch.long), kv, most, 1, table, BLOCK, True)
        fast = pa._Plan.single_query(kv, most, int(kv.min()), table, BLOCK)
        for name in ("blocks", "rows", "mask", "live"):
            a, b = getattr(general, name), getattr(fast, name)
            assert (a is None and b is None) or torch.equal(a, b), (trial, name)
        assert (general.unwritten is None) == (fast.unwritten is None), trial
        if general.unwritten is not None:
            assert torch.equal(general.unwritten, fast.unwritten), trial
        assert (general.all_live, general.Lk, general.B) == (fast.all_live, fast.Lk, fast.B)


def test_megatron_decode_layout_s_b_h_d():
    """Megatron's decode branch passes q as [s, b=1, h, d]: batch = padded token count, Sq = 1."""
    gen = torch.Generator().manual_seed(5)
    kv_lens = [3, 9, 0, 0]  # two real decode requests, two padded
    k_cache, v_cache = _caches(num_blocks=8, gen=gen)
    table = _block_table(kv_lens, num_blocks=8, max_blocks=3, gen=gen)
    q = torch.randn(4, 1, H, D, generator=gen, dtype=torch.float64)
    out = pa.flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache,
                                     cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32),
                                     causal=True, block_table=table, num_splits=0)
    # the same step seen as a varlen batch of 1-token requests
    same = pa.flash_attn_varlen_func(q[:, 0], k_cache, v_cache, _cu([1, 1, 0, 0]), _cu(kv_lens),
                                     1, 9, causal=True, block_table=table)
    torch.testing.assert_close(out[:, 0], same, rtol=0, atol=1e-12)
    assert torch.all(out[2:] == 0)


def test_contiguous_single_request_matches_plain_causal_sdpa():
    gen = torch.Generator().manual_seed(7)
    L = 10
    k_cache, v_cache = _caches(num_blocks=3, gen=gen, dtype=torch.float32)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    q = torch.randn(L, H, D, generator=gen)
    out = pa.flash_attn_varlen_func(q, k_cache, v_cache, _cu([L]), _cu([L]), L, L,
                                    causal=True, block_table=table)
    k = k_cache.reshape(-1, HK, D)[:L].transpose(0, 1).repeat_interleave(H // HK, dim=0)
    v = v_cache.reshape(-1, HK, D)[:L].transpose(0, 1).repeat_interleave(H // HK, dim=0)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True)
    torch.testing.assert_close(out, ref[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_unsupported_forms_raise():
    k_cache, v_cache = torch.zeros(2, BLOCK, HK, D), torch.zeros(2, BLOCK, HK, D)
    with pytest.raises(NotImplementedError, match="paged"):
        pa.flash_attn_varlen_func(torch.zeros(3, H, D), k_cache, v_cache, _cu([3]), _cu([3]), 3, 3)
    with pytest.raises(NotImplementedError, match="'k'"):  # static engine's flash_decode form
        pa.flash_attn_with_kvcache(torch.zeros(1, 1, H, D), k_cache, v_cache,
                                   cache_seqlens=torch.tensor([1], dtype=torch.int32),
                                   block_table=torch.zeros(1, 1, dtype=torch.int32),
                                   k=torch.zeros(1, 1, HK, D))


def test_install_leaves_real_flash_attn_alone():
    import types

    def real(*a, **k):
        return None

    for fake in (types.SimpleNamespace(flash_attn_varlen_func=real, HAVE_FA3=False, is_fa_min_version=real),
                 types.SimpleNamespace(flash_attn_varlen_func=None, HAVE_FA3=True, is_fa_min_version=real)):
        before = dict(vars(fake))
        assert pa.install(fake) is False
        assert vars(fake) == before


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn present")
def test_install_into_megatron_attention(monkeypatch, caplog):
    """install() returns True once, then False (already installed); installed() stays True."""
    import megatron.core.transformer.attention as attention

    if attention.HAVE_FA3:
        pytest.skip("flash-attn 3 present")
    # start from Megatron's own state (apply_compat in another test may have installed already);
    # monkeypatch restores whatever was there at teardown
    original = getattr(attention.is_fa_min_version, "__wrapped__", attention.is_fa_min_version)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", None)
    monkeypatch.setattr(attention, "is_fa_min_version", original)

    with caplog.at_level("INFO", logger=pa.__name__):
        assert pa.install() is True
    assert len([r for r in caplog.records if r.name == pa.__name__]) == 1
    paged = attention.flash_attn_varlen_func.__self__  # one object, one plan cache, both calls
    assert isinstance(paged, pa.PagedAttention)
    assert attention.flash_attn_varlen_func == paged.varlen
    assert attention.flash_attn_with_kvcache == paged.with_kvcache
    assert attention.is_fa_min_version("2.7.3") is True
    assert pa.installed()
    wrapped = attention.is_fa_min_version

    assert pa.install() is False  # idempotent: nothing new installed
    assert pa.installed() and attention.is_fa_min_version is wrapped


@pytest.mark.parametrize("kv_lens", [[5, 9, 0, 2], [3, 1, 0, 4], [2, 3, 1, 4]])
def test_unwritten_cache_slots_never_reach_the_output(kv_lens):
    """Megatron allocates the paged cache with torch.empty: slots past a request's keys (the rest
    of its last block, unused table entries reading block 0) can hold NaN bit patterns. A masked
    score does not cancel a NaN key, nor a zero weight a NaN value: the output must still equal
    the reference computed on clean caches. Several blocks per request, and one (the keys read
    block by block: each request's first Lk slots, past its own keys too)."""
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = _caches(num_blocks=12, gen=gen)
    table = _block_table(kv_lens, num_blocks=12, max_blocks=4, gen=gen)
    dirty_k, dirty_v = k_cache.clone(), v_cache.clone()
    written = torch.zeros(12, BLOCK, dtype=torch.bool)
    for b, n in enumerate(kv_lens):
        for j in range(n):
            written[int(table[b, j // BLOCK]), j % BLOCK] = True
    dirty_k[~written], dirty_v[~written] = math.nan, math.nan
    q = torch.randn(len(kv_lens), 1, H, D, generator=gen, dtype=torch.float64)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    clean = pa.flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lens,
                                       causal=True, block_table=table)
    dirty = pa.flash_attn_with_kvcache(q=q, k_cache=dirty_k, v_cache=dirty_v, cache_seqlens=lens,
                                       causal=True, block_table=table)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_step_plans_are_made_once_per_step_and_dropped_with_it():
    """The layers of one step share its plans; a changed length tensor or a new step's table
    plans again (a stale plan would attend to the wrong keys)."""
    plans, calls = pa.StepPlans(), []
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 5])

    def build():
        calls.append(1)
        return len(calls)

    assert plans.get(table, ("decode",), (lens,), build) == 1
    assert plans.get(table, ("decode",), (lens,), build) == 1  # the next layer: no new plan
    lens += 1  # the engine wrote the lengths in place: a new plan
    assert plans.get(table, ("decode",), (lens,), build) == 2
    assert plans.get(table.clone(), ("decode",), (lens,), build) == 3  # the next step's table
