"""Loss masks by author (float64): in a multi-turn sample only the policy's own tokens carry
log-probs, advantages and loss; the environment's tokens are context. Each rule is checked
against the same sequences with the environment's tokens cut out (what the losses would see if
those tokens were not there at all): equal losses, metrics and weights, and exactly zero
gradient at every environment position, whatever values sit there."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.policy_loss import PolicyLossConfig, policy_loss
from gspo_megatron.algorithms.rollout_correction import (RolloutCorrectionConfig,
                                                          correction_weights)
from gspo_megatron.policy import POLICY_MASK_KEY, RolloutSample, make_policy_batch
from gspo_megatron.stages import batch_stage

PAD = 0


def episodes(seed=0, n=5):
    """Random samples whose responses alternate policy and environment runs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(1, 50, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        authors = []
        for turn in range(int(torch.randint(1, 4, (1,), generator=g))):
            authors += [1] * int(torch.randint(1, 6, (1,), generator=g))
            if turn < 2:
                authors += [0] * int(torch.randint(1, 5, (1,), generator=g))
        authors[0] = 1
        response = torch.randint(1, 50, (len(authors),), generator=g).tolist()
        logprobs = (-torch.rand(len(authors), generator=g)).tolist()
        out.append(RolloutSample(prompt.tolist(), response, logprobs, "eos",
                                 {POLICY_MASK_KEY: authors}))
    return out


def pack(sequences, prompt_lengths):
    return make_policy_batch(sequences, prompt_lengths, pad_id=PAD)


def compact(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` values at ``mask`` moved to the left of each row (the environment's tokens
    and the prompt cut out), right-padded: ``(values [B, T'], mask [B, T'])``."""
    counts = mask.sum(1)
    width = int(counts.max())
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    keep = torch.arange(width).expand(values.shape[0], -1) < counts[:, None]
    out[keep] = values[mask]
    return out, keep


@pytest.fixture(scope="module")
def batch():
    samples = episodes()
    return samples, batch_stage(samples, torch.randn(len(samples), dtype=torch.float64), pack)


def test_response_mask_holds_exactly_the_policy_tokens(batch):
    samples, b = batch
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        want = torch.zeros(b.seq_length, dtype=torch.bool)
        # label position t predicts token t + 1: response token j sits at label p - 1 + j
        want[p - 1:p - 1 + len(s.response_ids)] = torch.tensor(s.extra[POLICY_MASK_KEY]) > 0
        assert torch.equal(b.response_mask[i], want)
        assert int(b.response_mask[i].sum()) == sum(s.extra[POLICY_MASK_KEY])  # |y_i|
    # the engine's log-probs of the policy tokens sit at their labels
    assert torch.equal(b.rollout_logprobs[b.response_mask],
                       torch.tensor([lp for s in samples for lp, a in
                                     zip(s.response_logprobs, s.extra[POLICY_MASK_KEY]) if a],
                                    dtype=torch.float32))


def test_single_turn_samples_keep_their_mask():
    samples = episodes(1, 3)
    for s in samples:
        s.extra.pop(POLICY_MASK_KEY)
    b = batch_stage(samples, torch.zeros(3), pack)
    assert torch.equal(b.response_mask, b.layout.response_mask())


@pytest.mark.parametrize("variant,aggregation", [
    ("gspo", None), ("gspo_token", None), ("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
    ("grpo", "seq_mean_token_sum_norm"), ("cispo", None), ("sapo", None), ("geo_mean", None)])
def test_losses_see_only_policy_tokens(batch, variant, aggregation):
    """The loss, its metrics and its gradient equal those of the sequences with the
    environment's tokens cut out; environment positions get exactly zero gradient, even holding
    extreme log-probs (the ratio there would overflow if they were read)."""
    samples, b = batch
    g = torch.Generator().manual_seed(7)
    mask = b.response_mask
    shape = b.tokens.shape
    logp = (-torch.rand(shape, generator=g, dtype=torch.float64))
    old = logp + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    env = b.layout.response_mask() & ~mask
    assert bool(env.any())
    logp[env], old[env] = 30.0, -30.0  # garbage at the environment's positions
    ref = logp.detach() + 0.1
    adv = b.advantages.double()
    kw = {} if aggregation is None else {"aggregation": aggregation}
    cfg = PolicyLossConfig(variant=variant, kl_coef=0.01, **kw)

    # (Dr. GRPO's constant is the response budget, B x L, not a count of tokens: the trainer
    # passes it; both calls get the same)
    kw = {"loss_normalizer": float(mask.numel())} if aggregation == "seq_mean_token_sum_norm" else {}
    lp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, **kw)
    loss.backward()

    c_lp, keep = compact(logp, mask)
    c_lp.requires_grad_(True)
    c_old, _ = compact(old, mask)
    c_ref, _ = compact(ref, mask)
    c_loss, c_metrics = policy_loss(c_lp, c_old, adv, keep, cfg, ref_logprobs=c_ref, **kw)
    c_loss.backward()

    assert torch.allclose(loss, c_loss, rtol=0, atol=1e-12), (loss, c_loss)
    for k in c_metrics:
        assert torch.allclose(metrics[k].double(), c_metrics[k].double(), atol=1e-10), k
    assert bool((lp.grad[~mask] == 0).all())
    assert torch.allclose(lp.grad[mask], c_lp.grad[keep], rtol=0, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_per_policy_token(batch, level):
    samples, b = batch
    g = torch.Generator().manual_seed(3)
    mask = b.response_mask
    old = -torch.rand(b.tokens.shape, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(b.tokens.shape, generator=g, dtype=torch.float64)
    env = b.layout.response_mask() & ~mask
    rollout[env] = 0.0  # what the engine reports for an environment token
    cfg = RolloutCorrectionConfig(mode="truncate", level=level, cap=1.1)
    got = correction_weights(old, rollout, mask, cfg)
    c_old, keep = compact(old, mask)
    c_rollout, _ = compact(rollout, mask)
    want = correction_weights(c_old, c_rollout, keep, cfg)
    # (sequence level: w_i from the policy tokens' log-ratios alone, on each of them)
    assert torch.allclose(got.weights[mask], want.weights[keep], rtol=0, atol=1e-12)
    for k in want.metrics:
        assert torch.allclose(got.metrics[k].double(), want.metrics[k].double(), atol=1e-12), k
