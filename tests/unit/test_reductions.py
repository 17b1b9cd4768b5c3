"""Masked reductions (single process; the CP path is in tests/distributed)."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms import all_reduce_no_grad, all_reduce_sum, masked_mean, masked_sum


def _inputs():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=g) > 0.4
    mask[2] = False
    mask[0, 0] = True
    return values, mask


def test_masked_sum_and_mean_match_loops():
    values, mask = _inputs()
    s = masked_sum(values, mask)
    m = masked_mean(values, mask, empty_value=-7.0)
    for i in range(4):
        sel = [values[i, t].item() for t in range(5) if mask[i, t]]
        assert s[i].item() == pytest.approx(sum(sel), abs=1e-15)
        assert m[i].item() == pytest.approx(sum(sel) / len(sel) if sel else -7.0, abs=1e-15)
    assert masked_sum(values, mask, dim=0).shape == (5,)
    assert masked_mean(values, mask.to(torch.int64), dim=0).shape == (5,)


def test_padding_garbage_does_not_leak_into_value_or_grad():
    values, mask = _inputs()
    values = torch.where(mask, values, torch.full_like(values, math.nan)).requires_grad_(True)
    out = masked_mean(values, mask).sum() + masked_sum(values * 2.0, mask).sum()
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(values.grad).all()
    assert torch.count_nonzero(values.grad[~mask]) == 0
    # gradient: 1/|row| (mean) + 2 (sum of 2x) per masked element
    n = mask.sum(-1, keepdim=True).clamp(min=1).double()
    expected = torch.where(mask, 1.0 / n + 2.0, torch.zeros_like(values))
    torch.testing.assert_close(values.grad, expected)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="mask shape"):
        masked_sum(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(torch.zeros(2, 3), torch.ones(3, dtype=torch.bool))


def test_all_reduce_without_group_is_identity():
    x = torch.randn(3, requires_grad=True)
    assert all_reduce_sum(x, None) is x
    y = all_reduce_no_grad(x, None)
    assert not y.requires_grad and torch.equal(y, x.detach())
    y.add_(1)  # a copy, not a view of the input
    assert not torch.equal(y, x.detach())


def test_group_without_init_raises():
    with pytest.raises(RuntimeError, match="not initialized"):
        all_reduce_sum(torch.zeros(1), group=object())
