"""Rollout/training mismatch correction vs. independent float64 references.

Weights (each mode x level), their metrics, the corrected loss and its gradient for every variant
(loops over rows and tokens in plain Python), the no-op cases (mode none, w == 1), the
normaliser contract (masked tokens stay in it: microbatch split invariance), the config errors,
and a 2-process gloo context-parallel check.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_gloo
from gspo_megatron.algorithms import (PolicyGradientObjective, PolicyLossConfig,
                                      RolloutCorrectionConfig, correction_weights, policy_loss)
from gspo_megatron.sections import FieldError

F64 = torch.float64
SEEDS = (0, 1, 2)
MODES = ("truncate", "mask", "reject")
LEVELS = ("token", "sequence")


# --------------------------------------------------------------------------- inputs
def _inputs(seed: int, B: int = 7, T: int = 9, noise: float = 0.2, spread: float = 0.6):
    """float64 ``logp, old, rollout, adv [B], adv_tok [B, T], mask``; ragged mask, row 2 empty,
    NaN / -inf junk in the padding of ``old`` and ``rollout``."""
    g = np.random.default_rng(seed)
    mask = g.random((B, T)) > 0.3
    mask[:, 0] = True
    mask[2] = False  # empty response
    mask[4, 1:] = False  # a one-token response
    logp = -g.random((B, T)) * 2
    old = logp + noise * g.standard_normal((B, T))
    # per-row offsets put whole sequences on both sides of a band, noise spreads the tokens
    rollout = old - (0.4 * g.standard_normal((B, 1)) + spread * g.standard_normal((B, T)))
    adv = g.standard_normal(B)
    adv_tok = g.standard_normal((B, T))
    t = lambda a: torch.tensor(a, dtype=F64)  # noqa: E731
    old_t, rollout_t, m = t(old), t(rollout), torch.tensor(mask)
    old_t = torch.where(m, old_t, torch.full_like(old_t, float("nan")))
    rollout_t = torch.where(m, rollout_t, torch.full_like(rollout_t, -math.inf))
    return t(logp), old_t, rollout_t, t(adv), t(adv_tok), m


def _config(mode: str, level: str) -> RolloutCorrectionConfig:
    if level == "sequence":  # geometric means stay close to 1: a narrow band / small cap
        return RolloutCorrectionConfig(mode=mode, level=level, cap=1.2,
                                       **({} if mode == "truncate" else {"band_low": 0.85}))
    return RolloutCorrectionConfig(mode=mode, level=level)


# --------------------------------------------------------------------------- references
def _ref_bound(w: float, cfg: RolloutCorrectionConfig) -> tuple[float, bool, bool]:
    """(w', truncated, masked) of one raw weight."""
    if cfg.mode == "none":
        return 1.0, False, False
    if cfg.mode == "truncate":
        return min(w, cfg.cap), w > cfg.cap, False
    high = cfg.cap if cfg.band_high is None else cfg.band_high
    low = 1.0 / high if cfg.band_low is None else cfg.band_low
    kept = low <= w <= high
    if cfg.mode == "mask":
        return (w if kept else 0.0), False, not kept
    return (1.0 if kept else 0.0), False, not kept


def _ref_weights(old, rollout, mask, cfg):
    """Loops over rows: (weights [B][T], seq weights [B] or None, metrics dict)."""
    old, rollout, mask = old.tolist(), rollout.tolist(), mask.tolist()
    B, T = len(mask), len(mask[0])
    W = [[0.0] * T for _ in range(B)]
    seq_w = [0.0] * B
    trunc_tok = mask_tok = 0
    rows, trunc_rows, mask_rows = 0, 0, 0
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        if not toks:
            continue
        rows += 1
        if cfg.level == "token":
            for t in toks:
                d = min(max(old[i][t] - rollout[i][t], -20.0), 20.0)
                W[i][t], tr, ma = _ref_bound(math.exp(d), cfg)
                trunc_tok += tr
                mask_tok += ma
        else:
            d = sum(old[i][t] - rollout[i][t] for t in toks) / len(toks)
            w, tr, ma = _ref_bound(math.exp(min(max(d, -20.0), 20.0)), cfg)
            seq_w[i] = w
            for t in toks:
                W[i][t] = w
            trunc_tok += tr * len(toks)
            mask_tok += ma * len(toks)
            trunc_rows += tr
            mask_rows += ma
    vals = [W[i][t] for i in range(B) for t in range(T) if mask[i][t]]
    n = len(vals)
    metrics = {
        "correction/weight_mean": sum(vals) / n,
        "correction/weight_max": max(vals),
        "correction/weight_min": min(vals),
        "correction/truncated_fraction": trunc_tok / n,
        "correction/masked_fraction": mask_tok / n,
    }
    if cfg.level == "sequence":
        metrics["correction/seq_truncated_fraction"] = trunc_rows / rows
        metrics["correction/seq_masked_fraction"] = mask_rows / rows
    return W, (seq_w if cfg.level == "sequence" else None), metrics


def _clipped_min(ratio: float, adv: float, lo: float, hi: float) -> tuple[float, float]:
    """(min(rA, clip(r)A), its derivative in r)."""
    clipped = min(max(ratio, 1.0 - lo), 1.0 + hi) * adv
    return (clipped, 0.0) if clipped < ratio * adv else (ratio * adv, adv)


def _ref_loss(variant, logp, old, adv, mask, lo, hi, tok_w=None, seq_w=None,
              aggregation="seq_mean_token_mean", normalizer=None):
    """The weighted objective by loops: (loss, d loss / d logp [B][T]). ``tok_w`` [B][T] multiply
    each token's term, ``seq_w`` [B] each sequence's objective; ``adv`` [B] or [B][T]."""
    logp, old, mask = logp.tolist(), old.tolist(), mask.tolist()
    adv = adv.tolist()
    B, T = len(mask), len(mask[0])
    lens = [sum(row) for row in mask]
    if normalizer is None:
        normalizer = sum(lens) if aggregation == "token_mean" else B
    grad = [[0.0] * T for _ in range(B)]
    total = 0.0
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        L = len(toks)
        if L == 0:
            continue
        a = {t: (adv[i][t] if isinstance(adv[i], list) else adv[i]) for t in toks}
        s = math.exp(sum(logp[i][t] - old[i][t] for t in toks) / L)  # Eq. 7
        wi = 1.0 if seq_w is None else seq_w[i]
        if variant == "gspo" and tok_w is None:  # w_i J_i, J_i of Eq. 5
            j, dj = _clipped_min(s, a[toks[0]], lo, hi)
            total += wi * j
            for t in toks:
                grad[i][t] += wi * dj * s / L
        elif variant in ("gspo", "gspo_token"):  # (1/L) sum_t w_it min(s_it A, clip(s_it) A)
            for t in toks:
                wt = wi if tok_w is None else tok_w[i][t]
                j, dj = _clipped_min(s, a[t], lo, hi)
                total += wt * j / L
                grad[i][t] += wt * dj * s / L
        else:
            scale = 1.0 if aggregation == "token_mean" else 1.0 / L
            for t in toks:
                wt = wi if tok_w is None else tok_w[i][t]
                r = math.exp(logp[i][t] - old[i][t])
                j, dj = _clipped_min(r, a[t], lo, hi)
                total += wt * j * scale
                grad[i][t] += wt * dj * r * scale
    return -total / normalizer, [[-g / normalizer for g in row] for row in grad]


# --------------------------------------------------------------------------- weights
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES + ("none",))
def test_weights_and_metrics_match_reference(mode, level, seed):
    _, old, rollout, _, _, mask = _inputs(seed)
    cfg = _config(mode, level)
    res = correction_weights(old, rollout, mask, cfg)
    ref_w, ref_seq, ref_m = _ref_weights(old, rollout, mask, cfg)
    assert res.weights.dtype == F64 and res.weights.shape == mask.shape
    assert not res.weights.requires_grad
    torch.testing.assert_close(res.weights, torch.tensor(ref_w, dtype=F64), rtol=1e-12, atol=0)
    assert torch.all(res.weights[~mask] == 0)
    if level == "sequence":
        torch.testing.assert_close(res.seq_weights, torch.tensor(ref_seq, dtype=F64), rtol=1e-12, atol=0)
    else:
        assert res.seq_weights is None
    assert set(res.metrics) == set(ref_m)
    for key, value in ref_m.items():
        assert res.metrics[key].item() == pytest.approx(value, rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_inputs_exercise_every_branch(mode, level):
    """The fixtures do truncate / mask something (else the reference tests prove little)."""
    hit = 0.0
    for seed in SEEDS:
        _, old, rollout, _, _, mask = _inputs(seed)
        m = correction_weights(old, rollout, mask, _config(mode, level)).metrics
        hit += (m["correction/truncated_fraction"] if mode == "truncate"
                else m["correction/masked_fraction"]).item()
        assert m["correction/masked_fraction"] < 1  # something survives
    assert hit > 0


def test_weights_are_float32_for_float32_inputs_and_sequence_level_is_the_geometric_mean():
    _, old, rollout, _, _, mask = _inputs(0)
    res = correction_weights(old.float(), rollout.float(), mask,
                             RolloutCorrectionConfig(mode="truncate", level="sequence", cap=100.0))
    assert res.weights.dtype == torch.float32
    d = torch.where(mask, old - rollout, torch.zeros((), dtype=F64))
    geo = torch.exp(d.sum(-1) / mask.sum(-1).clamp(min=1))  # exp(mean_t log(pi_old / pi_rollout))
    torch.testing.assert_close(res.seq_weights.double(), torch.where(mask.any(-1), geo, 0.0),
                               rtol=1e-5, atol=0)


def test_nan_at_a_response_position_raises():
    _, old, rollout, _, _, mask = _inputs(0)
    bad = rollout.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_logprobs contains NaN"):
        correction_weights(old, bad, mask, RolloutCorrectionConfig(mode="truncate"))
    inf = rollout.clone()
    inf[0, 0] = -math.inf  # a log-ratio of +inf clamps, then truncates to the cap
    w = correction_weights(old, inf, mask, RolloutCorrectionConfig(mode="truncate")).weights
    assert w[0, 0] == 2.0


# --------------------------------------------------------------------------- loss
LOSS_CASES = [  # (config, noise of logp vs old, per-token advantages)
    (PolicyLossConfig(variant="gspo", clip_low=0.004, clip_high=0.006), 0.01, False),
    (PolicyLossConfig(variant="gspo_token", clip_low=0.004, clip_high=0.006), 0.01, True),
    (PolicyLossConfig(variant="grpo"), 0.3, True),
    (PolicyLossConfig(variant="grpo", aggregation="token_mean"), 0.3, False),
]
LOSS_IDS = ["gspo", "gspo_token", "grpo", "grpo_token_mean"]


def _loss_inputs(seed, noise, per_tok):
    logp, old, rollout, adv, adv_tok, mask = _inputs(seed, noise=noise)
    old = torch.where(mask, old, logp)  # policy_loss wants finite old_logprobs (rollout keeps junk)
    return logp, old, rollout, (adv_tok if per_tok else adv), mask


def _run(cfg, logp, old, adv, mask, **kw):
    x = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, cfg, **kw)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_weighted_loss_and_gradient_match_reference(case, mode, level, seed):
    cfg, noise, per_tok = case
    logp, old, rollout, adv, mask = _loss_inputs(seed, noise, per_tok)
    res = correction_weights(old, rollout, mask, _config(mode, level))
    # [B, T] weights (token or sequence level) act per token; [B] weights per sequence
    passes = [(res.weights, dict(tok_w=res.weights.tolist()))]
    if res.seq_weights is not None:
        passes.append((res.seq_weights, dict(seq_w=res.seq_weights.tolist())))
    for weights, ref_kw in passes:
        loss, grad, _ = _run(cfg, logp, old, adv, mask, correction_weights=weights)
        ref_loss, ref_grad = _ref_loss(cfg.variant, logp, old, adv, mask, cfg.eps_low, cfg.eps_high,
                                       aggregation=cfg.aggregation, **ref_kw)
        assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-13)
        torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=F64), rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_reference_is_not_vacuous(case):
    """Clipped and unclipped tokens both occur, and the weights change the loss."""
    cfg, noise, per_tok = case
    logp, old, rollout, adv, mask = _loss_inputs(0, noise, per_tok)
    w = correction_weights(old, rollout, mask, _config("mask", "token")).weights
    loss_w, grad_w, m = _run(cfg, logp, old, adv, mask, correction_weights=w)
    loss, grad, _ = _run(cfg, logp, old, adv, mask)
    assert 0 < m["clip/token_fraction"] < 1
    assert not torch.allclose(loss_w, loss) and not torch.allclose(grad_w, grad)


@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_gspo_token_weights_equal_sequence_weights_when_constant(case):
    """A [B, T] weight constant over each row gives the [B] weight's loss and gradient (for gspo:
    the GSPO-token form equals w_i * J_i), and the same clip metrics as no weights."""
    cfg, noise, per_tok = case
    logp, old, rollout, adv, mask = _loss_inputs(1, noise, per_tok)
    seq_w = correction_weights(old, rollout, mask, _config("mask", "sequence")).seq_weights
    tok_w = torch.where(mask, seq_w[:, None].expand_as(logp), 0.0)
    loss_s, grad_s, m_s = _run(cfg, logp, old, adv, mask, correction_weights=seq_w)
    loss_t, grad_t, m_t = _run(cfg, logp, old, adv, mask, correction_weights=tok_w)
    _, _, m_0 = _run(cfg, logp, old, adv, mask)
    torch.testing.assert_close(loss_t, loss_s, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_t, grad_s, rtol=1e-12, atol=1e-15)
    for key in m_0:
        if key.startswith(("clip/", "ratio/", "kl/", "response/")):
            assert torch.equal(m_s[key], m_0[key]) and torch.equal(m_t[key], m_0[key]), key


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_masked_tokens_get_zero_gradient(case, level):
    cfg, noise, per_tok = case
    logp, old, rollout, adv, mask = _loss_inputs(2, noise, per_tok)
    res = correction_weights(old, rollout, mask, _config("reject", level))
    dropped = mask & (res.weights == 0)
    assert dropped.any() and (mask & ~dropped).any()
    for weights in filter(lambda w: w is not None, (res.weights, res.seq_weights)):
        _, grad, _ = _run(cfg, logp, old, adv, mask, correction_weights=weights)
        assert torch.all(grad[dropped] == 0)
        assert torch.count_nonzero(grad[mask & ~dropped]) > 0


@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_masked_tokens_stay_in_the_normaliser(case):
    """Dropping tokens by weight 0 is not dropping them from the mask: |y_i|, B and the token
    total keep counting them, so the loss is the reference's with the full layout."""
    cfg, noise, per_tok = case
    logp, old, rollout, adv, mask = _loss_inputs(0, noise, per_tok)
    w = correction_weights(old, rollout, mask, _config("reject", "token")).weights
    loss, _, _ = _run(cfg, logp, old, adv, mask, correction_weights=w)
    shrunk, _, _ = _run(cfg, logp, old, adv, mask & (w > 0))  # verl-style: rejected leave the mask
    ref, _ = _ref_loss(cfg.variant, logp, old, adv, mask, cfg.eps_low, cfg.eps_high,
                       tok_w=w.tolist(), aggregation=cfg.aggregation)
    assert loss.item() == pytest.approx(ref, rel=1e-10)
    assert not torch.allclose(loss, shrunk)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_microbatch_split_invariance_with_correction(case, mode, level):
    cfg, noise, per_tok = case
    logp, old, rollout, adv, mask = _loss_inputs(1, noise, per_tok)
    corr = _config(mode, level)
    total = float(mask.sum()) if cfg.aggregation == "token_mean" else float(mask.shape[0])

    def part(rows):
        res = correction_weights(old[rows], rollout[rows], mask[rows], corr)
        w = res.seq_weights if res.seq_weights is not None else res.weights
        return _run(cfg, logp[rows], old[rows], adv[rows], mask[rows], loss_normalizer=total,
                    correction_weights=w)

    whole_loss, whole_grad, _ = part(slice(None))
    a_loss, a_grad, _ = part(slice(0, 3))
    b_loss, b_grad, _ = part(slice(3, None))
    torch.testing.assert_close(a_loss + b_loss, whole_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.cat([a_grad, b_grad]), whole_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_unit_weights_leave_the_loss_unchanged(case):
    cfg, noise, per_tok = case
    logp, old, _, adv, mask = _loss_inputs(0, noise, per_tok)
    base_loss, base_grad, base_m = _run(cfg, logp, old, adv, mask)
    ones_seq = torch.ones(mask.shape[0], dtype=F64)
    loss, grad, m = _run(cfg, logp, old, adv, mask, correction_weights=ones_seq)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    assert all(torch.equal(m[k], base_m[k]) for k in base_m)
    loss, grad, _ = _run(cfg, logp, old, adv, mask, correction_weights=torch.ones_like(logp))
    if cfg.variant == "gspo":  # the GSPO-token form: equal up to rounding
        torch.testing.assert_close(loss, base_loss, rtol=1e-14, atol=1e-16)
        torch.testing.assert_close(grad, base_grad, rtol=1e-13, atol=1e-16)
    else:
        assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)


def test_bad_weights_are_rejected():
    logp, old, _, adv, mask = _loss_inputs(0, 0.01, False)
    cfg = PolicyLossConfig()
    with pytest.raises(ValueError, match=r"correction_weights must be \[B\]"):
        policy_loss(logp, old, adv, mask, cfg, correction_weights=torch.ones(3, dtype=F64))
    neg = torch.ones_like(logp)
    neg[0, 0] = -1.0
    with pytest.raises(ValueError, match="correction_weights must be finite and >= 0"):
        policy_loss(logp, old, adv, mask, cfg, correction_weights=neg)
    pad_junk = torch.where(mask, torch.ones_like(logp), torch.full_like(logp, float("nan")))
    policy_loss(logp, old, adv, mask, cfg, correction_weights=pad_junk)  # padding is ignored


# --------------------------------------------------------------------------- objective
def _mb(seed, noise, per_tok, rollout_is_old=False):
    logp, old, rollout, adv, mask = _loss_inputs(seed, noise, per_tok)
    rollout = old.clone() if rollout_is_old else rollout
    return logp, SimpleNamespace(response_mask=mask, old_logprobs=old, rollout_logprobs=rollout,
                                 advantages=adv, ref_logprobs=None)


def _objective(obj, logp, mb, normalizer):
    x = logp.clone().requires_grad_(True)
    loss, metrics = obj(x, None, mb, normalizer)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_objective_mode_none_is_todays_loss_bitwise(case):
    cfg, noise, per_tok = case
    logp, mb = _mb(0, noise, per_tok)
    base = _objective(PolicyGradientObjective(cfg), logp, mb, 7.0)
    off = _objective(PolicyGradientObjective(cfg, correction=RolloutCorrectionConfig()), logp, mb, 7.0)
    assert torch.equal(off[0], base[0]) and torch.equal(off[1], base[1])
    assert off[2].keys() == base[2].keys()
    assert not any(k.startswith("correction/") for k in off[2])
    direct = _run(cfg, logp, mb.old_logprobs, mb.advantages, mb.response_mask, loss_normalizer=7.0,
                  correction_weights=None)
    assert torch.equal(direct[0], base[0]) and torch.equal(direct[1], base[1])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_objective_applies_the_correction(case, mode, level):
    cfg, noise, per_tok = case
    logp, mb = _mb(1, noise, per_tok)
    corr = _config(mode, level)
    loss, grad, metrics = _objective(PolicyGradientObjective(cfg, correction=corr), logp, mb, 7.0)
    res = correction_weights(mb.old_logprobs, mb.rollout_logprobs, mb.response_mask, corr)
    ref_kw = dict(seq_w=res.seq_weights.tolist()) if level == "sequence" else dict(tok_w=res.weights.tolist())
    ref_loss, ref_grad = _ref_loss(cfg.variant, logp, mb.old_logprobs, mb.advantages, mb.response_mask,
                                   cfg.eps_low, cfg.eps_high, aggregation=cfg.aggregation,
                                   normalizer=7.0, **ref_kw)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-13)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=F64), rtol=1e-9, atol=1e-13)
    for key, value in res.metrics.items():
        assert torch.equal(metrics[key], value), key
    assert metrics["loss/total"] == loss


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", LOSS_CASES, ids=LOSS_IDS)
def test_objective_with_rollout_old_logprobs_is_a_bitwise_noop(case, mode, level):
    """``trainer.old_logprobs: rollout``: old == rollout, every w == 1, loss and gradient are the
    uncorrected ones bit for bit (the metrics say weight 1, nothing truncated or masked)."""
    cfg, noise, per_tok = case
    logp, mb = _mb(2, noise, per_tok, rollout_is_old=True)
    base = _objective(PolicyGradientObjective(cfg), logp, mb, 7.0)
    corr = _objective(PolicyGradientObjective(cfg, correction=_config(mode, level)), logp, mb, 7.0)
    assert torch.equal(corr[0], base[0]) and torch.equal(corr[1], base[1])
    m = corr[2]
    assert m["correction/weight_mean"] == 1 and m["correction/weight_min"] == 1
    assert m["correction/weight_max"] == 1
    assert m["correction/truncated_fraction"] == 0 and m["correction/masked_fraction"] == 0


def test_objective_needs_rollout_logprobs():
    logp, mb = _mb(0, 0.01, False)
    mb.rollout_logprobs = None
    obj = PolicyGradientObjective(PolicyLossConfig(), correction=RolloutCorrectionConfig(mode="truncate"))
    with pytest.raises(ValueError, match="rollout_correction.mode='truncate' needs the rollout"):
        obj(logp, None, mb, 7.0)


# --------------------------------------------------------------------------- config
def test_config_defaults_and_band():
    cfg = RolloutCorrectionConfig()
    assert (cfg.mode, cfg.level, cfg.cap, cfg.band_low, cfg.band_high) == ("none", "token", 2.0, None, None)
    assert not cfg.enabled and cfg.band() == (0.5, 2.0)
    assert RolloutCorrectionConfig(mode="mask", cap=4.0).band() == (0.25, 4.0)
    assert RolloutCorrectionConfig(mode="mask", band_high=1.001).band() == (1 / 1.001, 1.001)
    assert RolloutCorrectionConfig(mode="reject", band_low=0.9).band() == (0.9, 2.0)
    # a band with mode none is ignored (switching the correction off needs no other edit)
    assert not RolloutCorrectionConfig(mode="none", band_low=0.9).enabled


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="clip"),
     "rollout_correction.mode must be one of 'none', 'truncate', 'mask', 'reject', got 'clip'"),
    (dict(level="geometric"), "rollout_correction.level must be one of 'token', 'sequence', got 'geometric'"),
    (dict(mode="truncate", cap=1.0),
     "rollout_correction.cap must be > 1 (the truncation cap C; TIS uses 2), got 1.0"),
    (dict(cap=0.5), "rollout_correction.cap must be > 1"),
    (dict(cap=float("nan")), "rollout_correction.cap must be a finite number > 1, got nan"),
    (dict(cap="2"), "rollout_correction.cap must be a finite number > 1, got '2'"),
    (dict(mode="mask", band_low=1.5, band_high=1.2),
     "rollout_correction.band_low must be < band_high: the band [1.5, 1.2] is empty"),
    (dict(mode="reject", band_low=0.9, band_high=0.9),
     "rollout_correction.band_low must be < band_high: the band [0.9, 0.9] is empty"),
    (dict(mode="mask", band_low=1.1, band_high=1.5), "rollout_correction.band_low must be <= 1"),
    (dict(mode="mask", band_low=0.5, band_high=0.9), "rollout_correction.band_high must be >= 1"),
    (dict(mode="mask", band_low=-0.1),
     "rollout_correction.band_low must be a finite number > 0 or null, got -0.1"),
    (dict(mode="truncate", band_high=3.0),
     "rollout_correction.band_high only applies to rollout_correction.mode 'mask' or 'reject'"),
])
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(FieldError) as err:
        RolloutCorrectionConfig(**kwargs)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError) and err.value.section == "rollout_correction"


# --------------------------------------------------------------------------- context parallel
WORLD = 2


def _cp_worker(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    group = dist.new_group(list(range(WORLD)))
    logp, old, rollout, adv, mask = _loss_inputs(0, 0.01, False)
    T = mask.shape[1] - 1  # even T; row 1 gets all its tokens on rank 1
    logp, old, rollout, mask = logp[:, :T], old[:, :T], rollout[:, :T], mask[:, :T].clone()
    mask[1] = False
    mask[1, T - 1] = True
    rollout = torch.where(torch.isfinite(rollout), rollout, old - 0.1)
    sl = slice(rank * T // WORLD, (rank + 1) * T // WORLD)
    cfg = PolicyLossConfig(variant="gspo", clip_low=0.004, clip_high=0.006)
    for mode in MODES:
        for level in LEVELS:
            corr = _config(mode, level)
            full = correction_weights(old, rollout, mask, corr)
            shard = correction_weights(old[:, sl], rollout[:, sl], mask[:, sl], corr, cp_group=group)
            torch.testing.assert_close(shard.weights, full.weights[:, sl], rtol=1e-12, atol=0)
            for key, value in full.metrics.items():
                torch.testing.assert_close(shard.metrics[key], value, rtol=1e-12, atol=1e-15)
            for fw, sw in ((full.weights, shard.weights), (full.seq_weights, shard.seq_weights)):
                if fw is None:
                    continue
                f_loss, f_grad, _ = _run(cfg, logp, old, adv, mask, correction_weights=fw)
                s_loss, s_grad, _ = _run(cfg, logp[:, sl], old[:, sl], adv, mask[:, sl],
                                         cp_group=group, correction_weights=sw)
                torch.testing.assert_close(s_loss, f_loss, rtol=1e-12, atol=1e-15)
                torch.testing.assert_close(s_grad, f_grad[:, sl], rtol=1e-12, atol=1e-15)
    bad = rollout[:, sl].clone()
    if rank == 0:
        bad[0, 0] = float("nan")  # NaN on one rank: both raise, nobody deadlocks
    try:
        correction_weights(old[:, sl], bad, mask[:, sl], _config("truncate", "sequence"), cp_group=group)
    except ValueError as e:
        assert "rollout_logprobs contains NaN" in str(e)
    else:
        raise AssertionError(f"rank {rank}: NaN on rank 0 did not raise")


@pytest.mark.distributed
def test_context_parallel_weights_metrics_and_loss_match_single_process():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo backend not available")
    run_gloo(_cp_worker, WORLD)
