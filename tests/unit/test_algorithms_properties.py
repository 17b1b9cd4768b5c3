"""Hypothesis property tests: extreme inputs give finite results or a clear ValueError."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_megatron.algorithms import PolicyLossConfig, group_advantages, policy_loss

SETTINGS = settings(max_examples=50, deadline=None, database=None)  # no .hypothesis/ dir in the repo
VARIANTS = ["gspo", "gspo_token", "grpo"]


# --------------------------------------------------------------------------- advantages
@st.composite
def reward_batches(draw, allow_non_finite=False):
    G = draw(st.integers(1, 5))
    n_groups = draw(st.integers(1, 4))
    value = st.one_of(
        st.floats(-1e3, 1e3, allow_nan=False),
        st.sampled_from([0.0, 1.0, -1.0, 3e38, -3e38, 1e-30, 1e30]),
        st.floats(allow_nan=allow_non_finite, allow_infinity=allow_non_finite, width=32),
    )
    rewards = draw(st.lists(value, min_size=G * n_groups, max_size=G * n_groups))
    if draw(st.booleans()):  # force some exactly-equal groups
        rewards[:G] = [rewards[0]] * G
    return torch.tensor(rewards, dtype=torch.float32), G


@SETTINGS
@given(batch=reward_batches(), normalize_std=st.booleans())
def test_group_advantages_finite_or_clear_error(batch, normalize_std):
    rewards, G = batch
    try:
        res = group_advantages(rewards, G, normalize_std=normalize_std)
    except ValueError as e:
        assert "rewards" in str(e)
        assert not normalize_std  # normalised advantages never overflow
        return
    adv = res.advantages
    assert adv.shape == rewards.shape and torch.isfinite(adv).all()
    assert all(torch.isfinite(v) for v in res.metrics.values())
    groups = rewards.double().view(-1, G)
    zero = groups.amax(1) == groups.amin(1)
    assert torch.equal(res.zero_variance_mask, zero)
    assert torch.equal(adv.view(-1, G)[zero], torch.zeros_like(adv.view(-1, G)[zero]))
    if G == 1:
        assert torch.equal(adv, torch.zeros_like(adv)) and res.num_zero_variance_groups == rewards.numel()
    if normalize_std:
        # |(r - mean) / std| <= sqrt(G - 1) for the population std
        assert adv.abs().max().item() <= math.sqrt(max(G - 1, 0)) + 1e-3
        # advantages of each group sum to ~0
        assert adv.double().view(-1, G).sum(1).abs().max().item() <= 1e-3 * G


@SETTINGS
@given(batch=reward_batches(allow_non_finite=True))
def test_group_advantages_non_finite_rewards_rejected(batch):
    rewards, G = batch
    if torch.isfinite(rewards).all():
        return
    with pytest.raises(ValueError, match="rewards contains NaN or Inf"):
        group_advantages(rewards, G)


# --------------------------------------------------------------------------- policy loss
@st.composite
def loss_batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    log_ratio = st.one_of(st.floats(-1e4, 1e4), st.sampled_from([1e4, -1e4, 0.0, 1e-3, -1e-3, 50.0, -50.0]))
    lr = torch.tensor(draw(st.lists(log_ratio, min_size=B * T, max_size=B * T)), dtype=torch.float32)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    adv = torch.tensor(draw(st.lists(st.floats(-1e3, 1e3), min_size=B, max_size=B)), dtype=torch.float32)
    old = torch.full((B, T), -2.0)
    return old + lr.view(B, T), old, adv, mask


@SETTINGS
@given(batch=loss_batches(), variant=st.sampled_from(VARIANTS), kl=st.sampled_from([0.0, 0.1]),
       token_mean=st.booleans())
def test_policy_loss_finite_or_clear_error(batch, variant, kl, token_mean):
    logp, old, adv, mask = batch
    agg = "token_mean" if token_mean and variant == "grpo" else "seq_mean_token_mean"
    cfg = PolicyLossConfig(variant=variant, kl_coef=kl, aggregation=agg)
    lp = logp.clone().requires_grad_(True)
    kwargs = dict(ref_logprobs=old - 1e4 * (mask.float() - 0.5)) if kl else {}
    if not mask.any():
        with pytest.raises(ValueError, match="response_mask"):
            policy_loss(lp, old, adv, mask, cfg, **kwargs)
        return
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, **kwargs)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()
    assert torch.count_nonzero(lp.grad[~mask]) == 0  # padding and empty rows get no gradient
    for key, value in metrics.items():
        assert torch.isfinite(value), key
    for key in ("clip/fraction", "clip/fraction_low", "clip/fraction_high", "clip/token_fraction",
                "response/empty_fraction"):
        assert -1e-6 <= metrics[key].item() <= 1 + 1e-6, key
    assert metrics["ratio/min"].item() <= metrics["ratio/max"].item()
    empty = ~mask.any(-1)
    assert metrics["response/empty_fraction"].item() == pytest.approx(empty.float().mean().item())


@SETTINGS
@given(
    seed=st.integers(0, 2**16), B=st.integers(1, 4), T=st.integers(1, 8),
    scale=st.sampled_from([1e-4, 1e-3, 1e-2]),
)
def test_gspo_token_equals_gspo_property(seed, B, T, scale):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    out = []
    for variant in ("gspo", "gspo_token"):
        lp = logp.clone().requires_grad_(True)
        loss, m = policy_loss(lp, old, adv, mask, PolicyLossConfig(variant=variant))
        loss.backward()
        out.append((loss.detach(), lp.grad, m["clip/fraction"], m["clip/token_fraction"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
