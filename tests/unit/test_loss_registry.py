"""The loss registry: every registered loss through the same checks, on small float64 inputs.

Parametrized over :data:`LOSSES` (and each loss's aggregations), so a new loss module is tested
here without editing this file: its declaration, its config knobs (unread knob = error naming the
field), on-policy gradient = the policy gradient with its aggregation's weights, microbatch
splits summing to the whole minibatch, empty rows, correction weights, and its clip metrics
against :func:`clipped_positions`. Then what is particular to some losses (dual clip, SAPO's gate,
CISPO's kept gradients, GMPO's weights, Dr. GRPO's budget)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from gspo_megatron.algorithms import (AGGREGATIONS, LOSSES, PolicyGradientObjective,
                                      PolicyLossConfig, clipped_positions, policy_loss)
from gspo_megatron.algorithms.losses.base import LossParams
from gspo_megatron.config.loader import ConfigError, load_config
from gspo_megatron.sections import FieldError, field_docs

F64 = torch.float64
B, T, BUDGET = 6, 9, 11
VARIANT_AGGS = [(v, a) for v, spec in LOSSES.items() for a in spec.aggregations]


def _inputs(seed: int, noise: float = 0.3, empty_row: int | None = None):
    """``(logp, old, adv [B], mask)``: ragged rows, junk (NaN) in the padding of ``logp``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if empty_row is not None:
        mask[empty_row] = False
    logp = -torch.nn.functional.softplus(torch.randn(B, T, generator=g, dtype=F64)) - 0.05
    old = logp + noise * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    logp = torch.where(mask, logp, torch.full_like(logp, math.nan))
    return logp, torch.where(mask, old, torch.zeros_like(old)), adv, mask


class _Rows:
    def __init__(self, mask):
        self.response_mask = mask


def _config(variant: str, **kw) -> PolicyLossConfig:
    """The variant at its defaults, but GSPO's sequence eps at 0.05: these inputs' sequence
    ratios spread by ~0.1, so the paper's 3e-4 would clip every sequence (no gradient to test)."""
    if variant in ("gspo", "gspo_token"):
        kw = {"clip_low": 0.05, "clip_high": 0.05, **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (0.05 is mis-scaled for GSPO: it warns, rightly)
        return PolicyLossConfig(variant=variant, **kw)


def _normalizer(cfg, mask) -> float:
    """What the trainer's objective hands every microbatch of this minibatch."""
    return float(PolicyGradientObjective(cfg, response_budget=BUDGET).local_count(_Rows(mask)))


def _loss(cfg, logp, old, adv, mask, **kw):
    x = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, cfg, **kw)
    loss.backward()
    return loss.detach(), torch.nan_to_num(x.grad), metrics


# ------------------------------------------------------------------------ the declarations
@pytest.mark.parametrize("variant", list(LOSSES))
def test_each_loss_declares_name_knobs_defaults_and_aggregations(variant):
    spec = LOSSES[variant]
    assert spec.name == variant and spec.summary and spec.level in ("token", "sequence")
    assert spec.aggregations and set(spec.aggregations) <= set(AGGREGATIONS)
    assert issubclass(spec.params, LossParams) and spec.params.__dataclass_params__.frozen
    docs = field_docs(spec.params)
    for f in dataclasses.fields(spec.params):  # its paper named under every knob
        assert "arXiv" in docs.get(f.name, ""), (variant, f.name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the paper's defaults are valid and do not warn
        cfg = PolicyLossConfig(variant=variant)
    assert list(cfg.params.problems()) == [] and cfg.params == spec.params()
    assert cfg.resolved_aggregation == spec.aggregations[0]


@pytest.mark.parametrize("variant", list(LOSSES))
def test_a_knob_the_variant_does_not_read_is_an_error_naming_it(variant):
    reads = {f.name for f in dataclasses.fields(LOSSES[variant].params)}
    unread = [k for k in PolicyLossConfig.knobs if k not in reads]
    assert set(PolicyLossConfig.knobs) == set().union(
        *({f.name for f in dataclasses.fields(s.params)} for s in LOSSES.values()))
    for knob in unread:
        with pytest.raises(FieldError) as ei:
            PolicyLossConfig(variant=variant, **{knob: 2.0})
        assert ei.value.messages[0].startswith(f"loss.{knob} not read by variant={variant!r}")
        with pytest.raises(ConfigError, match=rf"^override '--loss.{knob}=2': loss.{knob}: not "
                                              rf"read by variant='{variant}' \(only by '"):
            load_config(None, [f"--loss.variant={variant}", f"--loss.{knob}=2"])
    for agg in set(AGGREGATIONS) - set(LOSSES[variant].aggregations):
        with pytest.raises(FieldError, match=rf"^loss.aggregation '{agg}' is not an aggregation "
                                             rf"of variant='{variant}'"):
            PolicyLossConfig(variant=variant, aggregation=agg)


def test_cli_exits_2_with_one_line_naming_the_knob(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli",
                           f"--logging.run_dir={tmp_path / 'run'}", "--loss.variant=grpo",
                           "--loss.tau_neg=1.2"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gspo-train: error: override '--loss.tau_neg=1.2': loss.tau_neg: not read by "
        "variant='grpo' (only by 'sapo'); leave it unset (null) or pick one of those"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(variant="sapo", tau_pos=0.0), "loss.tau_pos must be a finite float > 0, got 0.0"),
    (dict(variant="sapo", tau_neg=math.inf), "loss.tau_neg must be a finite float > 0, got inf"),
    (dict(variant="grpo", clip_ratio_c=1.0), "loss.clip_ratio_c must be a finite float > 1"),
    (dict(variant="cispo", clip_high=-1.0), "loss.clip_high must be >= 0, got -1.0"),
    (dict(variant="geo_mean", clip_low=-0.1), "loss.clip_low must be >= 0, got -0.1"),
    (dict(variant="gspo_token", clip_low=1.0), "loss.clip_low must be < 1"),
])
def test_values_are_checked_by_the_loss_naming_the_field(kwargs, message):
    with pytest.raises(FieldError) as ei:
        PolicyLossConfig(**kwargs)
    assert ei.value.messages[0].startswith(message)


def test_values_past_one_are_legal_where_they_mean_something():
    """CISPO's clip_low >= 1 is "no lower bound" (verl's 10); GMPO's bounds are in log space."""
    assert PolicyLossConfig(variant="cispo", clip_low=10.0).params.clip_low == 10.0
    assert PolicyLossConfig(variant="geo_mean", clip_low=1.5).params.clip_low == 1.5


@pytest.mark.parametrize("kwargs, needle", [
    (dict(variant="gspo", clip_low=0.2), "~1e-4-scale eps"),
    (dict(variant="grpo", clip_high=3e-4), "clips nearly every token (GSPO paper Sec. 5.1"),
    (dict(variant="geo_mean", clip_low=4e-4), "GMPO clips each token's log-ratio"),
    (dict(variant="cispo", clip_low=0.2), "a lower bound 0.8 on CISPO's importance weight"),
    (dict(variant="cispo", clip_high=1e-3), "CISPO caps the weight at 1 + clip_high"),
])
def test_mis_scaled_bounds_warn(kwargs, needle):
    with pytest.warns(UserWarning, match=r"PolicyLossConfig\(variant=") as rec:
        PolicyLossConfig(**kwargs)
    assert any(needle in str(r.message) for r in rec), [str(r.message) for r in rec]


def test_section_round_trips_through_the_loader():
    cfg = load_config(None, ["--loss.variant=sapo", "--loss.tau_neg=1.2",
                             "--loss.aggregation=token_mean"]).loss
    assert cfg == PolicyLossConfig(variant="sapo", tau_neg=1.2, aggregation="token_mean")
    assert (cfg.params.tau_pos, cfg.params.tau_neg) == (1.0, 1.2)
    with pytest.raises(TypeError):
        PolicyLossConfig("grpo")  # keyword-only: ten fields are not read by position


# ------------------------------------------------------------------------ shared invariants
@pytest.mark.parametrize("variant, aggregation", VARIANT_AGGS)
def test_on_policy_gradient_is_the_policy_gradient(variant, aggregation):
    """At pi = pi_old every loss is the plain policy gradient A grad log pi (gates 1, clips
    inactive), weighted by its aggregation: 1/(B |y_i|), 1/tokens, 1/B or 1/(B L)."""
    logp, _, adv, mask = _inputs(0)
    old = torch.where(mask, logp, torch.zeros_like(logp))
    cfg = _config(variant, aggregation=aggregation)
    norm = _normalizer(cfg, mask)
    _, grad, _ = _loss(cfg, logp, old, adv, mask, loss_normalizer=norm)
    agg = AGGREGATIONS[aggregation]
    length = mask.sum(-1, keepdim=True).to(F64)
    scale = 1.0 / length if agg.per_sequence == "mean" else torch.ones_like(length)
    expected = torch.where(mask, -adv[:, None] * scale / norm, torch.zeros((), dtype=F64))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    if agg.normalizer != "sequences_x_budget":  # the default normaliser is the same count
        torch.testing.assert_close(_loss(cfg, logp, old, adv, mask)[1], grad, rtol=1e-12,
                                   atol=1e-15)


@pytest.mark.parametrize("variant, aggregation", VARIANT_AGGS)
def test_microbatches_sum_to_the_minibatch(variant, aggregation):
    """Off-policy (clips and gates active): two microbatches, each divided by the minibatch's
    normaliser, sum to the minibatch's loss and gradient."""
    logp, old, adv, mask = _inputs(1)
    cfg = _config(variant, aggregation=aggregation)
    norm = _normalizer(cfg, mask)
    loss, grad, _ = _loss(cfg, logp, old, adv, mask, loss_normalizer=norm)
    parts = [_loss(cfg, logp[s], old[s], adv[s], mask[s], loss_normalizer=norm)
             for s in (slice(0, 2), slice(2, B))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), grad, rtol=1e-12,
                               atol=1e-15)
    assert grad.abs().max() > 0


@pytest.mark.parametrize("variant", list(LOSSES))
def test_empty_rows_and_correction_weights(variant):
    """An empty row adds nothing; weights of 1 (per sequence or per token) change nothing; a
    sequence weighted 0 gets no gradient but keeps its place in the normaliser."""
    logp, old, adv, mask = _inputs(2, empty_row=3)
    cfg = _config(variant)
    loss, grad, metrics = _loss(cfg, logp, old, adv, mask)
    assert grad[3].abs().max() == 0
    assert float(metrics["response/empty_fraction"]) == pytest.approx(1 / B)
    keep = torch.tensor([i != 3 for i in range(B)])
    norm = _normalizer(cfg, mask)
    sub = _loss(cfg, logp[keep], old[keep], adv[keep], mask[keep], loss_normalizer=norm)
    torch.testing.assert_close(sub[0], _loss(cfg, logp, old, adv, mask, loss_normalizer=norm)[0],
                               rtol=1e-12, atol=1e-15)
    for ones in (torch.ones(B, dtype=F64), torch.ones(B, T, dtype=F64)):
        torch.testing.assert_close(_loss(cfg, logp, old, adv, mask, correction_weights=ones)[:2],
                                   (loss, grad), rtol=1e-12, atol=1e-15)
    w = torch.rand(B, generator=torch.Generator().manual_seed(3), dtype=F64) + 0.5
    w[1] = 0.0
    wloss, wgrad, _ = _loss(cfg, logp, old, adv, mask, correction_weights=w)
    assert wgrad[1].abs().max() == 0 and wgrad[[0, 2, 4, 5]].abs().max() > 0 and wloss != loss


@pytest.mark.parametrize("variant", list(LOSSES))
def test_clip_metrics_are_the_clipped_positions(variant):
    """``clip/token_fraction`` counts exactly :func:`clipped_positions` (what the routing
    diagnostics align route flips with); a loss without a hard clip reports no ``clip/*``."""
    logp, old, adv, mask = _inputs(4, noise=0.5)
    cfg = _config(variant)
    _, _, metrics = _loss(cfg, logp, old, adv, mask)
    clipped = clipped_positions(logp, old, adv, mask, cfg)
    assert not (clipped & ~mask).any()
    assert {"ratio/mean", "ratio/min", "ratio/max", "kl/old_k3", "loss/policy"} <= set(metrics)
    if LOSSES[variant].clips:
        assert float(metrics["clip/token_fraction"]) == pytest.approx(
            float(clipped.sum()) / float(mask.sum()), abs=1e-12)
        assert float(metrics["clip/fraction"]) == pytest.approx(
            float(metrics["clip/fraction_low"] + metrics["clip/fraction_high"]), abs=1e-12)
    else:
        assert not clipped.any() and not any(k.startswith("clip/") for k in metrics)


@pytest.mark.parametrize("variant", ["gspo", "geo_mean"])
def test_sequence_losses_need_one_advantage_per_sequence(variant):
    logp, old, adv, mask = _inputs(5)
    adv_bt = adv[:, None].expand(B, T).clone()
    _loss(PolicyLossConfig(variant=variant), logp, old, adv_bt, mask)  # constant rows: fine
    adv_bt[0, 0] += 1.0
    with pytest.raises(ValueError, match=rf"constant over each sequence.*variant='{variant}'"):
        _loss(PolicyLossConfig(variant=variant), logp, old, adv_bt, mask)


# ------------------------------------------------------------------------ loss by loss
def test_dual_clip_stops_negative_tokens_past_c():
    logp, old, adv, mask = _inputs(6, noise=0.6)
    c = 1.5
    cfg = PolicyLossConfig(variant="grpo", clip_ratio_c=c)
    _, grad, m = _loss(cfg, logp, old, adv, mask)
    r = torch.exp(torch.nan_to_num(logp) - old)
    dual = mask & (adv[:, None] < 0) & (r > c)
    assert dual.any() and grad[dual].abs().max() == 0
    assert float(m["clip/fraction_dual"]) == pytest.approx(float(dual.sum() / mask.sum()))
    assert float(m["clip/fraction_low"]) >= float(m["clip/fraction_dual"]) > 0
    _, plain_grad, plain = _loss(PolicyLossConfig(variant="grpo"), logp, old, adv, mask)
    assert "clip/fraction_dual" not in plain and plain_grad[dual].abs().min() > 0
    assert torch.equal(grad[~dual], plain_grad[~dual])  # only those tokens change


def test_sapo_gradient_is_the_gated_policy_gradient():
    """d/dlogp [f(r) A] = f'(r) r A with f'(r) = sech^2(tau (r - 1) / 2); gate/weight_mean is
    the token mean of f'(r)."""
    logp, old, adv, mask = _inputs(7, noise=0.5)
    cfg = PolicyLossConfig(variant="sapo", tau_pos=0.8, tau_neg=1.6)
    _, grad, m = _loss(cfg, logp, old, adv, mask)
    r = torch.exp(torch.nan_to_num(logp) - old)
    tau = torch.where(adv[:, None] > 0, torch.tensor(0.8, dtype=F64), torch.tensor(1.6, dtype=F64))
    weight = 1.0 / torch.cosh(tau * (r - 1) / 2) ** 2
    length = mask.sum(-1, keepdim=True).to(F64)
    expected = torch.where(mask, -weight * r * adv[:, None] / (length * B), torch.zeros((), dtype=F64))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert float(m["gate/weight_mean"]) == pytest.approx(float(weight[mask].mean()), rel=1e-12)
    assert 0 < float(m["gate/weight_mean"]) < 1


def test_cispo_keeps_the_gradient_of_capped_tokens():
    """Where GRPO's clip zeroes a token's gradient, CISPO keeps sg(w) A grad log pi with w at the
    cap; clip/fraction_high counts the capped tokens whatever the advantage's sign."""
    logp, old, adv, mask = _inputs(8, noise=0.5)
    cfg = PolicyLossConfig(variant="cispo", clip_high=0.2)
    _, grad, m = _loss(cfg, logp, old, adv, mask)
    r = torch.exp(torch.nan_to_num(logp) - old)
    capped = mask & (r > 1.2)
    assert capped.any() and (grad[capped] != 0).all()
    expected = torch.where(mask, -r.clamp(max=1.2) * adv[:, None] / mask.sum(), torch.zeros((), dtype=F64))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert float(m["clip/fraction_high"]) == pytest.approx(float(capped.sum() / mask.sum()))


def test_gmpo_token_weights_act_through_their_geometric_mean():
    logp, old, adv, mask = _inputs(9)
    cfg = PolicyLossConfig(variant="geo_mean")
    w = torch.where(mask, torch.rand(B, T, generator=torch.Generator().manual_seed(1),
                                     dtype=F64) + 0.5, torch.zeros((), dtype=F64))
    geo = torch.exp(torch.where(mask, w.clamp(min=1e-30).log(), 0).sum(-1) / mask.sum(-1))
    torch.testing.assert_close(_loss(cfg, logp, old, adv, mask, correction_weights=w)[:2],
                               _loss(cfg, logp, old, adv, mask, correction_weights=geo)[:2],
                               rtol=1e-12, atol=1e-15)
    w[2, 0] = 0.0  # a masked token drops its whole sequence
    grad = _loss(cfg, logp, old, adv, mask, correction_weights=w)[1]
    assert grad[2].abs().max() == 0 and grad[0].abs().max() > 0


def test_dr_grpo_needs_the_response_budget():
    cfg = PolicyLossConfig(variant="grpo", aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="response_budget"):
        PolicyGradientObjective(cfg)
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert float(PolicyGradientObjective(cfg, response_budget=7).local_count(_Rows(mask))) == 21.0
    assert float(PolicyGradientObjective(PolicyLossConfig(variant="cispo")).local_count(
        _Rows(mask))) == 12.0


def test_a_loss_without_clip_shows_its_gate_in_the_step_metrics(tmp_path, capsys):
    """The first-minibatch metrics keep what the loss reports (no clip share for SAPO / GPG),
    and SAPO's gate is in the progress line."""
    from gspo_megatron.metrics import MetricsLogger
    from gspo_megatron.stages import first_minibatch_metrics

    assert first_minibatch_metrics({"ratio/min": 0.5, "ratio/max": 1.25}) == {
        "ratio/first_minibatch_max_abs_log": pytest.approx(math.log(2.0))}
    assert first_minibatch_metrics({"ratio/min": 1.0, "ratio/max": 1.0, "clip/fraction": 0.25})[
        "clip/first_minibatch_fraction"] == 0.25
    from gspo_megatron.progress import Progress

    steps = Progress("RL steps", 10, every=1, tty=False)  # one plain line per step
    MetricsLogger(str(tmp_path), enabled=True, progress=steps).log(
        3, {"loss/policy": -0.5, "gate/weight_mean": 0.875})
    assert "| gate 0.875" in capsys.readouterr().out
