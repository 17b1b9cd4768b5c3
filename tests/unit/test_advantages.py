"""group_advantages vs. a float64 loop reference of paper Eq. 6 (population std)."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms import GroupAdvantageResult, group_advantages


def reference(rewards: list[float], G: int, normalize_std: bool, eps: float) -> list[float]:
    out = []
    for g in range(len(rewards) // G):
        grp = rewards[g * G : (g + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / G)  # population std
        for r in grp:
            if max(grp) == min(grp):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_reference(seed, G, normalize_std):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(5 * G, generator=g, dtype=torch.float64) * 3
    rewards[:G] = 0.7  # one zero-variance group
    res = group_advantages(rewards, G, normalize_std=normalize_std, eps=1e-6)
    assert isinstance(res, GroupAdvantageResult)
    exp = torch.tensor(reference(rewards.tolist(), G, normalize_std, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(res.advantages, exp, rtol=1e-12, atol=1e-12)
    assert res.advantages.shape == (5 * G,) and res.advantages.dtype == torch.float64
    grp = rewards.view(5, G)
    torch.testing.assert_close(res.group_mean, grp.mean(1))
    torch.testing.assert_close(res.group_std, grp.std(1, unbiased=False))
    expected_zero = 5 if G == 1 else 1
    assert res.num_zero_variance_groups == expected_zero
    assert res.metrics["reward/zero_variance_groups"].item() == expected_zero
    assert res.metrics["reward/zero_variance_group_fraction"].item() == pytest.approx(expected_zero / 5)


def test_population_std_is_documented_choice():
    # rewards {0, 1}: mean 0.5, population std 0.5 (sample std would be 0.707)
    res = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2, eps=0.0)
    torch.testing.assert_close(res.advantages, torch.tensor([-1.0, 1.0], dtype=torch.float64))
    res = group_advantages(torch.tensor([0.0, 1.0, 5.0]), 3, eps=0.0)
    assert res.advantages.pow(2).mean().item() == pytest.approx(1.0, rel=1e-6)  # unit population variance


def test_eps_is_added_to_std():
    res = group_advantages(torch.tensor([0.0, 2.0], dtype=torch.float64), 2, eps=1.0)
    torch.testing.assert_close(res.advantages, torch.tensor([-0.5, 0.5], dtype=torch.float64))


def test_all_equal_rewards_give_exact_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point; advantages must still be exactly 0
    for value in (0.1, -3.3, 1e20, 0.0):
        for dtype in (torch.float32, torch.float64):
            res = group_advantages(torch.full((6,), value, dtype=dtype), 3)
            assert torch.equal(res.advantages, torch.zeros(6, dtype=dtype))
            assert res.zero_variance_mask.tolist() == [True, True]
            assert res.num_zero_variance_groups == 2
            assert all(torch.isfinite(v) for v in res.metrics.values())


def test_group_size_one_is_all_zero_variance():
    res = group_advantages(torch.tensor([1.0, 5.0, -2.0]), 1)
    assert torch.equal(res.advantages, torch.zeros(3))
    assert res.zero_variance_mask.all() and res.metrics["reward/zero_variance_group_fraction"].item() == 1.0


def test_near_equal_rewards_are_not_zero_variance():
    res = group_advantages(torch.tensor([1.0, 1.0 + 1e-9], dtype=torch.float64), 2)
    assert res.num_zero_variance_groups == 0
    assert torch.isfinite(res.advantages).all()


def test_metrics_namespace_and_values():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    m = group_advantages(r, 3).metrics
    assert set(m) >= {"reward/mean", "reward/std", "reward/min", "reward/max",
                      "reward/zero_variance_group_fraction"}
    assert all(k.startswith("reward/") for k in m)
    assert m["reward/mean"].item() == pytest.approx(6.0)
    assert m["reward/std"].item() == pytest.approx(r.double().std(unbiased=False).item())
    assert (m["reward/min"].item(), m["reward/max"].item()) == (1.0, 10.0)
    assert m["reward/zero_variance_group_fraction"].item() == 0.5


def test_integer_and_bool_rewards():
    res = group_advantages(torch.tensor([0, 1, 1, 1]), 2)
    assert res.advantages.dtype == torch.get_default_dtype()
    torch.testing.assert_close(res.advantages, torch.tensor([-1.0, 1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    res = group_advantages(torch.tensor([True, False]), 2)
    assert res.advantages[0] > 0 > res.advantages[1]


def test_advantages_are_detached():
    r = torch.tensor([0.0, 1.0], requires_grad=True)
    assert not group_advantages(r, 2).advantages.requires_grad


@pytest.mark.parametrize(
    "rewards,G,match",
    [
        (torch.zeros(5), 2, "rewards has N=5 .*not divisible by group_size=2"),
        (torch.zeros(4), 0, "group_size"),
        (torch.zeros(4), -2, "group_size"),
        (torch.zeros(2, 2), 2, "rewards must be 1-D"),
        (torch.zeros(0), 2, "rewards is empty"),
        (torch.tensor([0.0, math.nan]), 2, "rewards contains NaN or Inf"),
        (torch.tensor([0.0, math.inf]), 2, "rewards contains NaN or Inf"),
        (torch.zeros(4), 2.0, "group_size"),
    ],
)
def test_bad_inputs_raise_naming_field(rewards, G, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, G)


def test_bad_eps_and_type():
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2), 2, eps=-1.0)
    with pytest.raises(TypeError, match="rewards"):
        group_advantages([0.0, 1.0], 2)  # type: ignore[arg-type]


def test_overflow_raises_clear_error():
    # r - mean = 4e38 does not fit float32 (max 3.4e38) without std normalisation
    r = torch.tensor([3e38, -3e38, -3e38], dtype=torch.float32)
    with pytest.raises(ValueError, match="rewards: advantages overflow"):
        group_advantages(r, 3, normalize_std=False)
    res = group_advantages(r, 3)  # normalised advantages are bounded by sqrt(G)
    assert torch.isfinite(res.advantages).all()
    expected = torch.tensor(reference([3.0, -3.0, -3.0], 3, True, 0.0), dtype=torch.float32)
    torch.testing.assert_close(res.advantages, expected)
    big = torch.tensor([1.7e308, -1.7e308], dtype=torch.float64)  # float64 edge
    res = group_advantages(big, 2)
    torch.testing.assert_close(res.advantages, torch.tensor([1.0, -1.0], dtype=torch.float64))
    assert all(torch.isfinite(v) for v in res.metrics.values())
