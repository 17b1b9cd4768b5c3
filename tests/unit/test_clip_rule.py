"""One clip rule and one k3 for the loss and the routing diagnostics (``algorithms``).

``clipped_positions`` is what the routing diagnostics count as clipped; it must be exactly the set
behind the loss's ``clip/*`` metrics, for every variant and both advantage shapes, and it must
match a float64 reference written from the paper's equations."""

import math

import pytest
import torch

from gspo_megatron.algorithms import PolicyLossConfig, clipped_positions, k3, policy_loss


def _inputs(seed: int, per_token_adv: bool, b: int = 12, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = False  # an empty response
    mask[1, :3] = True
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # log-ratios spread across every clip boundary used below (1e-4 .. 0.5)
    scale = torch.tensor([1e-4, 1e-3, 0.05, 0.3, 0.6, 2e-4] * 2, dtype=torch.float64)[:b, None]
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(b, t if per_token_adv else 1, generator=g, dtype=torch.float64)
    adv = adv if per_token_adv else adv[:, 0]
    return logp, old, adv, mask


def _reference(logp, old, adv, mask, variant, eps_low, eps_high):
    """Float64 reference: Eq. 7 sequence ratio (gspo, gspo_token) or Eq. 2 token ratio (grpo)."""
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        if not idx:
            continue
        lr = [float(logp[i, t] - old[i, t]) for t in idx]
        s = math.exp(sum(lr) / len(lr))
        for t, r_log in zip(idx, lr):
            ratio = s if variant != "grpo" else math.exp(r_log)
            if variant == "gspo":
                a = float(adv[i]) if adv.dim() == 1 else float(adv[i, idx].mean())
            else:
                a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            out[i, t] = (a > 0 and ratio > 1 + eps_high) or (a < 0 and ratio < 1 - eps_low)
    return out


@pytest.mark.parametrize("variant", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diagnostics_clip_set_equals_the_loss(variant, per_token_adv, seed):
    logp, old, adv, mask = _inputs(seed, per_token_adv)
    if variant == "gspo" and per_token_adv:  # gspo needs one advantage per sequence
        adv = adv.mean(-1, keepdim=True).expand_as(adv).clone()
    eps = (3e-4, 4e-4) if variant != "grpo" else (0.2, 0.27)
    # Rows 2 and 3 put every ratio between the two bounds of one side (1 +- (eps_low +
    # eps_high) / 2), with the advantage sign that can clip there: a rule that swapped eps_low
    # and eps_high would clip row 2 and spare row 3.
    mid = (eps[0] + eps[1]) / 2
    logp, adv = logp.clone(), adv.clone()
    logp[2], logp[3] = old[2] + math.log(1 + mid), old[3] + math.log(1 - mid)
    adv[2], adv[3] = adv[2].abs() + 0.1, -(adv[3].abs() + 0.1)
    cfg = PolicyLossConfig(variant=variant, clip_low=eps[0], clip_high=eps[1])
    clipped = clipped_positions(logp, old, adv, mask, cfg)
    assert clipped.dtype == torch.bool and not (clipped & ~mask).any()
    assert torch.equal(clipped, _reference(logp, old, adv, mask, variant, *eps))
    # the loss's own counts are of the same set
    _, m = policy_loss(logp.clone().requires_grad_(), old, adv, mask, cfg)
    assert float(m["clip/token_fraction"]) == pytest.approx(
        float(clipped.sum()) / float(mask.sum()), abs=1e-12)
    assert clipped.any()  # the inputs do exercise the rule
    # ...and tell the two sides apart: with eps_low and eps_high swapped the set changes, so a
    # rule that mixed them up would fail the reference comparison above.
    swapped = PolicyLossConfig(variant=variant, clip_low=eps[1], clip_high=eps[0])
    assert not torch.equal(clipped_positions(logp, old, adv, mask, swapped), clipped)


def test_clip_rule_hand_computed():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    lr = torch.tensor([[0.5, -0.5, 9.0], [0.01, 0.01, 0.01]], dtype=torch.float64)
    zeros = torch.zeros_like(lr)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    # grpo: token ratios; A>0 clips above 1+eps only, A<0 below 1-eps only; padding never counts
    g = clipped_positions(lr, zeros, adv, mask, PolicyLossConfig(variant="grpo", clip_low=0.2, clip_high=0.2))
    assert g.tolist() == [[True, False, False], [False, False, False]]
    # gspo: the sequence ratio exp(mean) decides for every response token of the sequence
    gspo = PolicyLossConfig(variant="gspo", clip_low=3e-4, clip_high=4e-4)
    assert not clipped_positions(lr, zeros, adv, mask, gspo).any()  # row 0: mean 0
    s = clipped_positions(lr, zeros, torch.tensor([1.0, 1.0], dtype=torch.float64), mask, gspo)
    assert s.tolist() == [[False, False, False], [True, True, True]]
    # gspo_token with per-token advantages: the sequence ratio, each token's own advantage
    adv_t = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 1.0]], dtype=torch.float64)
    t = clipped_positions(lr, zeros, adv_t, mask, PolicyLossConfig(variant="gspo_token", clip_low=3e-4, clip_high=4e-4))
    assert t.tolist() == [[False, False, False], [True, False, True]]


def test_k3():
    assert k3(torch.zeros(3)).tolist() == [0, 0, 0]
    assert k3(torch.tensor([0.1], dtype=torch.float64)).item() == pytest.approx(math.exp(0.1) - 1.1)
    assert torch.isfinite(k3(torch.tensor([1e4, -1e4]))).all()  # clamped before exp
