"""Vocab-parallel log-probs and entropy against a float64 full-vocabulary reference."""

import pytest
import torch

from gspo_megatron.backends.megatron.logprobs import vocab_parallel_logprobs
from tests.helpers.dist import run_gloo


def reference(logits, target, temperature, vocab_size):
    scaled = logits.double() / temperature
    if vocab_size is not None:
        scaled[..., vocab_size:] = float("-inf")
    logp_all = torch.log_softmax(scaled, -1)
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("vocab_size", [None, 83])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_reference_value_and_grad(seed, temperature, vocab_size, dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(4, 7, 96, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab_size or 96, (4, 7), generator=gen)
    w_lp, w_h = torch.randn(4, 7, generator=gen, dtype=torch.float64), torch.randn(4, 7, generator=gen, dtype=torch.float64)

    lp, ent = vocab_parallel_logprobs(logits, target, temperature=temperature, vocab_size=vocab_size, chunk_size=5)
    grad = torch.autograd.grad((lp.double() * w_lp).sum() + (ent.double() * w_h).sum(), logits)[0]

    ref_logits = logits.detach().double().requires_grad_()
    rlp, rent = reference(ref_logits, target, temperature, vocab_size)
    rgrad = torch.autograd.grad((rlp * w_lp).sum() + (rent * w_h).sum(), ref_logits)[0]

    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(lp.double(), rlp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent.double(), rent, atol=tol, rtol=tol)
    torch.testing.assert_close(grad.double(), rgrad, atol=tol, rtol=tol)
    if vocab_size is not None:
        assert grad[..., vocab_size:].abs().max() == 0  # padded vocabulary gets no gradient


def test_does_not_modify_logits_and_bf16_grad_dtype():
    logits = torch.randn(3, 50, dtype=torch.bfloat16, requires_grad=True)
    before = logits.detach().clone()
    lp, _ = vocab_parallel_logprobs(logits, torch.randint(0, 50, (3,)))
    lp.sum().backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad.dtype == torch.bfloat16 and lp.dtype == torch.float32


def test_bad_input():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="leading dims"):
        vocab_parallel_logprobs(torch.randn(2, 5), torch.zeros(3, dtype=torch.long))


def _tp_worker(rank, world_size, full_logits, target, vocab_size):
    import torch.distributed as dist

    shard = full_logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(shard, target, temperature=0.8, tp_group=dist.group.WORLD,
                                      vocab_size=vocab_size, chunk_size=3)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), shard.grad


@pytest.mark.distributed
def test_tensor_parallel_shards_match_unsplit():
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 5, 64, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 60, (2, 5), generator=gen)
    results = run_gloo(_tp_worker, 2, full, target, 60)

    ref_logits = full.clone().requires_grad_()
    rlp, rent = reference(ref_logits, target, 0.8, 60)
    (rlp.sum() + 0.5 * rent.sum()).backward()
    for rank, (lp, ent, grad) in enumerate(results):
        torch.testing.assert_close(lp, rlp.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(ent, rent.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grad, ref_logits.grad.chunk(2, dim=-1)[rank], atol=1e-12, rtol=1e-12)


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(scale=st.sampled_from([1e-6, 1.0, 1e2, 1e4]), vocab=st.integers(2, 40),
       temperature=st.sampled_from([0.05, 1.0, 3.0]), seed=st.integers(0, 2**16),
       constant=st.booleans())
def test_extreme_logits_stay_finite(scale, vocab, temperature, seed, constant):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.full((3, vocab + 5), 7.0) if constant else scale * torch.randn(3, vocab + 5, generator=gen)
    logits.requires_grad_()
    target = torch.randint(0, vocab, (3,), generator=gen)
    lp, ent = vocab_parallel_logprobs(logits, target, temperature=temperature, vocab_size=vocab)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    assert torch.isfinite(ent).all() and (ent >= -1e-5).all() and (ent <= torch.log(torch.tensor(float(vocab))) + 1e-4).all()
    assert torch.isfinite(logits.grad).all()
    if constant:  # uniform over the real vocabulary
        torch.testing.assert_close(lp, torch.full((3,), -float(torch.log(torch.tensor(float(vocab))))))
