"""policy_loss vs. independent float64 loop references (value, gradient, metrics)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gspo_megatron.algorithms import PolicyLossConfig, policy_loss, sequence_log_ratio

F64 = torch.float64
# the package re-exports the function `policy_loss`, which shadows the submodule attribute


# --------------------------------------------------------------------------- reference
def _clipped_min(ratio: float, adv: float, lo: float, hi: float) -> tuple[float, float, str]:
    """Return (objective, d objective / d ratio, clip state) for min(rA, clip(r)A)."""
    clipped_ratio = min(max(ratio, 1.0 - lo), 1.0 + hi)
    unclipped = ratio * adv
    clipped = clipped_ratio * adv
    if clipped < unclipped:  # clipped branch strictly chosen
        # the clipped branch is constant in the ratio when the ratio is outside the range
        state = "high" if ratio > 1.0 + hi else "low"
        return clipped, 0.0, state
    return unclipped, adv, "none"


def reference(variant, logp, old, adv, mask, lo, hi, aggregation="seq_mean_token_mean",
              kl_coef=0.0, ref=None, normalizer=None):
    """Loops over sequences/tokens in float64. Returns (loss, grad [B][T], info)."""
    B, T = len(logp), len(logp[0])
    lens = [sum(1 for t in range(T) if mask[i][t]) for i in range(B)]
    total_tokens = sum(lens)
    if normalizer is None:
        normalizer = total_tokens if aggregation == "token_mean" else B
    grad = [[0.0] * T for _ in range(B)]
    obj_total = 0.0
    kl_total = 0.0
    info = {"seq_clip": [], "tok_clip": [], "s": [], "r": [], "log_s": []}
    for i in range(B):
        L = lens[i]
        if L == 0:
            continue
        toks = [t for t in range(T) if mask[i][t]]
        log_s = sum(logp[i][t] - old[i][t] for t in toks) / L
        s = math.exp(log_s)
        info["s"].append(s)
        info["log_s"].append(log_s)
        a_tok = {t: (adv[i][t] if isinstance(adv[i], list) else adv[i]) for t in toks}
        w = 1.0 if aggregation == "token_mean" else 1.0 / L
        if variant == "gspo":
            j, dj_ds, state = _clipped_min(s, a_tok[toks[0]], lo, hi)
            obj_total += j
            info["seq_clip"].append(state)
            info["tok_clip"] += [state] * L
            for t in toks:  # d s / d logp_t = s / L  (Eq. 10)
                grad[i][t] += dj_ds * s / L
        elif variant == "gspo_token":
            states = []
            for t in toks:
                # value of s_it is s_i, derivative w.r.t. logp_t is s_i (stop-gradient on s_i)
                j, dj_ds, state = _clipped_min(s, a_tok[t], lo, hi)
                obj_total += j / L
                grad[i][t] += dj_ds * s / L
                states.append(state)
            info["tok_clip"] += states
            info["seq_clip"].append(states)
        else:
            for t in toks:
                r = math.exp(logp[i][t] - old[i][t])
                info["r"].append(r)
                j, dj_dr, state = _clipped_min(r, a_tok[t], lo, hi)
                obj_total += j * w
                grad[i][t] += dj_dr * r * w
                info["tok_clip"].append(state)
        if kl_coef:
            kw = 1.0 if aggregation == "token_mean" else 1.0 / L
            for t in toks:
                d = ref[i][t] - logp[i][t]
                kl_total += (math.exp(d) - d - 1.0) * kw
                grad[i][t] -= kl_coef * (1.0 - math.exp(d)) * kw  # loss side sign handled below
    # loss = -obj/N + kl_coef * kl/N ; grad so far = dobj/dlogp - kl_coef * dkl/dlogp
    loss = -obj_total / normalizer + kl_coef * kl_total / normalizer
    grad = [[-g / normalizer for g in row] for row in grad]
    info["kl"] = kl_total / normalizer
    return loss, torch.tensor(grad, dtype=F64), info


def make_inputs(seed, B=6, T=12, noise=2e-3, per_token_adv=False, empty_rows=(), pad_value=0.0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.1
    old = logp + noise * torch.randn(B, T, generator=g, dtype=F64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = int(torch.randint(0, T // 3, (1,), generator=g))
        length = int(torch.randint(1, T - start + 1, (1,), generator=g))
        mask[i, start : start + length] = True
    for i in empty_rows:
        mask[i] = False
    adv = torch.randn(B, T if per_token_adv else 1, generator=g, dtype=F64)
    adv = adv if per_token_adv else adv[:, 0]
    logp = torch.where(mask, logp, torch.full_like(logp, pad_value))
    return logp, old, adv, mask, ref


def as_lists(*ts):
    return [t.tolist() for t in ts]


def run(variant, logp, old, adv, mask, cfg_kwargs=None, **kwargs):
    cfg = PolicyLossConfig(variant=variant, **(cfg_kwargs or {}))
    lp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, **kwargs)
    loss.backward()
    return loss.detach(), lp.grad, metrics, cfg


# --------------------------------------------------------------------------- value & grad
CASES = [
    ("gspo", "seq_mean_token_mean", 2e-3),
    ("gspo_token", "seq_mean_token_mean", 2e-3),
    ("grpo", "seq_mean_token_mean", 0.3),
    ("grpo", "token_mean", 0.3),
]


@pytest.mark.parametrize("variant,aggregation,noise", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_matches_reference(variant, aggregation, noise, seed, kl_coef):
    per_tok = variant in ("gspo_token", "grpo") and seed % 2 == 1
    logp, old, adv, mask, ref = make_inputs(seed, noise=noise, per_token_adv=per_tok, empty_rows=(2,))
    cfg = dict(aggregation=aggregation, kl_coef=kl_coef)
    loss, grad, metrics, c = run(variant, logp, old, adv, mask, cfg, ref_logprobs=ref if kl_coef else None)
    exp_loss, exp_grad, info = reference(variant, *as_lists(logp, old, adv, mask), c.eps_low, c.eps_high,
                                         aggregation, kl_coef, ref.tolist())
    assert loss.item() == pytest.approx(exp_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, exp_grad, rtol=1e-9, atol=1e-12)
    # the test inputs exercise both clipped and unclipped cases across seeds
    states = info["tok_clip"]
    n_tok = len(states)
    assert metrics["clip/token_fraction"].item() == pytest.approx(sum(s != "none" for s in states) / n_tok)
    assert metrics["response/empty_fraction"].item() == pytest.approx(1 / 6)
    if kl_coef:
        assert metrics["loss/kl"].item() == pytest.approx(info["kl"], rel=1e-10)
        assert metrics["loss/total"].item() == pytest.approx(exp_loss, rel=1e-10)


def test_reference_inputs_hit_clipping():
    """Guard: the random inputs above really produce clipped and unclipped sequences."""
    states = []
    for seed in range(4):
        logp, old, adv, mask, _ = make_inputs(seed)
        _, _, info = reference("gspo", *as_lists(logp, old, adv, mask), 3e-4, 4e-4)
        states += info["seq_clip"]
    assert {"none", "low", "high"} <= set(states)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_ratio_and_quantile_metrics(seed):
    logp, old, adv, mask, _ = make_inputs(seed, B=8, empty_rows=(0,))
    ent = torch.rand(8, 12, dtype=F64)
    ent_padded = torch.where(mask, ent, torch.full_like(ent, 1e9))  # padding must be ignored
    _, _, info = reference("grpo", *as_lists(logp, old, adv, mask), 0.2, 0.27)
    for variant in ("gspo", "grpo"):
        _, _, m, _ = run(variant, logp, old, adv, mask, entropy=ent_padded)
        vals = info["s"] if variant == "gspo" else info["r"]
        assert m["ratio/mean"].item() == pytest.approx(sum(vals) / len(vals), rel=1e-10)
        assert m["ratio/min"].item() == pytest.approx(min(vals), rel=1e-12)
        assert m["ratio/max"].item() == pytest.approx(max(vals), rel=1e-12)
        log_s = torch.tensor(info["log_s"], dtype=F64)
        assert m["ratio/seq_log_ratio_p50"].item() == pytest.approx(torch.quantile(log_s, 0.5).item())
        assert m["ratio/seq_log_ratio_p05"].item() <= m["ratio/seq_log_ratio_p95"].item()
        assert m["entropy/mean"].item() == pytest.approx(ent[mask].mean().item(), rel=1e-10)
        d = (old - logp)[mask]
        assert m["kl/old_k3"].item() == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-8)
        assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_sequence_log_ratio_matches_eq7():
    logp, old, _, mask, _ = make_inputs(11, empty_rows=(1,))
    got = sequence_log_ratio(logp, old, mask)
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        exp = 0.0 if n == 0 else float((logp[i] - old[i])[mask[i]].sum()) / n
        assert got[i].item() == pytest.approx(exp, abs=1e-15)


# --------------------------------------------------------------------------- GSPO-token == GSPO
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("adv_layout", ["B", "BT"])
def test_gspo_token_equals_gspo_for_sequence_advantages(seed, adv_layout):
    logp, old, adv, mask, _ = make_inputs(seed, empty_rows=(4,))
    if adv_layout == "BT":
        adv = adv[:, None].expand_as(logp).clone()
    l1, g1, m1, _ = run("gspo", logp, old, adv, mask)
    l2, g2, m2, _ = run("gspo_token", logp, old, adv, mask)
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)
    for key in ("clip/fraction", "clip/fraction_low", "clip/fraction_high", "clip/token_fraction",
                "ratio/mean", "ratio/min", "ratio/max"):
        assert m1[key].item() == pytest.approx(m2[key].item(), abs=1e-12), key


def test_gspo_rejects_non_constant_token_advantages():
    logp, old, adv, mask, _ = make_inputs(0, per_token_adv=True)
    with pytest.raises(ValueError, match="advantages"):
        run("gspo", logp, old, adv, mask)


def test_gspo_ignores_padding_advantages():
    logp, old, adv, mask, _ = make_inputs(3)
    adv_bt = torch.where(mask, adv[:, None].expand_as(logp), torch.full_like(logp, 123.0))
    l1, g1, _, _ = run("gspo", logp, old, adv, mask)
    l2, g2, _, _ = run("gspo", logp, old, adv_bt, mask)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)


# --------------------------------------------------------------------------- clipping
# (log-ratio per token, advantage, expected state); GSPO eps 3e-4/4e-4, GRPO 0.2/0.27.
@pytest.mark.parametrize("variant,big", [("gspo", 1e-3), ("gspo_token", 1e-3), ("grpo", 0.5)])
@pytest.mark.parametrize(
    "direction,adv,state",
    [(+1, 1.0, "high"), (+1, -1.0, "none"), (-1, -1.0, "low"), (-1, 1.0, "none"), (0, 1.0, "none"),
     (0, -1.0, "none"), (+1, 0.0, "none"), (-1, 0.0, "none")],
)
def test_clipping_both_sides_both_signs(variant, big, direction, adv, state):
    T = 5
    old = torch.full((1, T), -1.0, dtype=F64)
    logp = old + direction * big
    mask = torch.ones(1, T, dtype=torch.bool)
    loss, grad, m, c = run(variant, logp, old, torch.tensor([adv], dtype=F64), mask)
    ratio = math.exp(direction * big)
    if state == "none":
        assert loss.item() == pytest.approx(-ratio * adv, rel=1e-12)
        # every token gets the same, non-zero gradient (Eq. 10 / per-token GRPO)
        torch.testing.assert_close(grad, torch.full_like(grad, -adv * ratio / T))
    else:
        bound = 1 + c.eps_high if state == "high" else 1 - c.eps_low
        assert loss.item() == pytest.approx(-bound * adv, rel=1e-12)
        assert torch.count_nonzero(grad) == 0
    assert m["clip/fraction_high"].item() == (1.0 if state == "high" else 0.0)
    assert m["clip/fraction_low"].item() == (1.0 if state == "low" else 0.0)
    assert m["clip/fraction"].item() == (0.0 if state == "none" else 1.0)
    assert m["clip/token_fraction"].item() == (0.0 if state == "none" else 1.0)


def test_gspo_sequence_clipping_is_all_or_nothing():
    """One token with a big ratio clips the whole GSPO sequence but only that token in GRPO."""
    old = torch.full((1, 4), -2.0, dtype=F64)
    logp = old.clone()
    logp[0, 0] += 0.5
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=F64)
    _, g, m, _ = run("gspo", logp, old, adv, mask)
    assert torch.count_nonzero(g) == 0 and m["clip/token_fraction"].item() == 1.0
    _, g, m, _ = run("grpo", logp, old, adv, mask)
    assert g[0, 0] == 0 and torch.count_nonzero(g) == 3
    assert m["clip/token_fraction"].item() == 0.25


# --------------------------------------------------------------------------- empty responses
@pytest.mark.parametrize("variant", ["gspo", "gspo_token", "grpo"])
def test_zero_length_responses_contribute_nothing(variant):
    logp, old, adv, mask, _ = make_inputs(8, empty_rows=(0, 3), pad_value=-math.inf)
    old = torch.where(mask, old, torch.full_like(old, math.nan))  # garbage in padding
    loss, grad, m, c = run(variant, logp, old, adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[0]) == 0 and torch.count_nonzero(grad[3]) == 0
    assert torch.count_nonzero(grad[~mask]) == 0
    keep = [i for i in range(6) if i not in (0, 3)]
    # the empty rows only enter through the normaliser B (documented default)
    loss_sub, grad_sub, _, _ = run(variant, logp[keep], old[keep], adv[keep], mask[keep],
                                   loss_normalizer=6)
    torch.testing.assert_close(loss, loss_sub)
    torch.testing.assert_close(grad[keep], grad_sub)
    assert m["response/empty_fraction"].item() == pytest.approx(2 / 6)
    assert all(torch.isfinite(v) for v in m.values())


# --------------------------------------------------------------------------- microbatching
@pytest.mark.parametrize("variant,aggregation,noise", CASES)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_microbatch_split_matches_full_batch(variant, aggregation, noise, kl_coef):
    logp, old, adv, mask, ref = make_inputs(21, B=8, noise=noise, empty_rows=(5,))
    cfg = PolicyLossConfig(variant=variant, aggregation=aggregation, kl_coef=kl_coef)
    kw = dict(ref_logprobs=ref) if kl_coef else {}
    lp = logp.clone().requires_grad_(True)
    full, _ = policy_loss(lp, old, adv, mask, cfg, **kw)
    full.backward()
    norm = float(mask.sum()) if aggregation == "token_mean" else 8.0
    lp2 = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for sl in (slice(0, 3), slice(3, 4), slice(4, 8)):
        kws = dict(ref_logprobs=ref[sl]) if kl_coef else {}
        part, _ = policy_loss(lp2[sl], old[sl], adv[sl], mask[sl], cfg, loss_normalizer=norm, **kws)
        total = total + part
    total.backward()
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp2.grad, lp.grad, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- KL
@pytest.mark.parametrize("variant", ["gspo", "grpo"])
def test_k3_kl_value_and_gradient(variant):
    logp, old, _, mask, ref = make_inputs(4, empty_rows=(1,))
    adv = torch.zeros(6, dtype=F64)  # policy term contributes nothing
    loss, grad, m, _ = run(variant, logp, old, adv, mask, dict(kl_coef=0.5), ref_logprobs=ref)
    exp_kl = 0.0
    exp_grad = torch.zeros_like(logp)
    for i in range(6):
        n = int(mask[i].sum())
        for t in range(12):
            if mask[i, t]:
                d = float(ref[i, t] - logp[i, t])
                exp_kl += (math.exp(d) - d - 1) / n / 6
                exp_grad[i, t] = 0.5 * (1 - math.exp(d)) / n / 6
    assert loss.item() == pytest.approx(0.5 * exp_kl, rel=1e-10)
    assert m["loss/kl"].item() == pytest.approx(exp_kl, rel=1e-10)
    assert m["loss/policy"].item() == 0.0
    torch.testing.assert_close(grad, exp_grad, rtol=1e-9, atol=1e-14)
    d = (ref - logp)[mask]
    assert m["kl/ref_k3"].item() == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-10)


# --------------------------------------------------------------------------- config & errors
def test_config_defaults_per_variant():
    assert (PolicyLossConfig().eps_low, PolicyLossConfig().eps_high) == (3e-4, 4e-4)
    c = PolicyLossConfig(variant="gspo_token")
    assert (c.eps_low, c.eps_high) == (3e-4, 4e-4)
    c = PolicyLossConfig(variant="grpo")
    assert (c.eps_low, c.eps_high) == (0.2, 0.27)
    c = PolicyLossConfig(variant="grpo", clip_low=0.1)
    assert (c.eps_low, c.eps_high) == (0.1, 0.27)
    assert PolicyLossConfig().aggregation is None and PolicyLossConfig().kl_coef == 0.0
    assert PolicyLossConfig().resolved_aggregation == "seq_mean_token_mean"


@pytest.mark.parametrize(
    "kwargs,field",
    [(dict(variant="ppo"), "variant"), (dict(clip_low=-0.1), "clip_low"), (dict(clip_high=-1e-4), "clip_high"),
     (dict(variant="grpo", clip_low=1.0), "clip_low"), (dict(aggregation="sum"), "aggregation"),
     (dict(variant="gspo", aggregation="token_mean"), "aggregation"), (dict(kl_coef=-1.0), "kl_coef"),
     (dict(clip_high=math.nan), "clip_high")],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


def test_sequence_eps_warning():
    """A sequence-level variant given token-level eps warns (each such config; Python's default
    filter then shows it once per calling line); token-level variants and defaults do not."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        PolicyLossConfig(variant="grpo", clip_low=0.2, clip_high=0.2)  # token-level: fine
        PolicyLossConfig(variant="gspo")  # defaults: fine
        assert len(rec) == 0
        PolicyLossConfig(variant="gspo", clip_low=0.2, clip_high=0.28)
        PolicyLossConfig(variant="gspo_token", clip_high=0.2)
    assert len(rec) == 2
    msg = str(rec[0].message)
    assert "1e-4" in msg and "0.2" in msg and "clip_low" in msg and "clip_high=0.28" in msg
    assert "clip_high=0.2" in str(rec[1].message) and "gspo_token" in str(rec[1].message)


def test_config_errors_are_field_errors():
    """The loss section reports like every other section: every problem at once, by field."""
    from gspo_megatron.sections import FieldError

    with pytest.raises(FieldError) as ei:
        PolicyLossConfig(clip_low=-1.0, kl_coef=math.inf)
    assert [fields[0] for fields, _ in ei.value.problems] == ["clip_low", "kl_coef"]
    assert ei.value.messages[0] == "loss.clip_low must be >= 0, got -1.0"


def _base():
    logp, old, adv, mask, ref = make_inputs(0)
    return dict(logprobs=logp, old_logprobs=old, advantages=adv, response_mask=mask), ref


@pytest.mark.parametrize(
    "field,bad",
    [("old_logprobs", lambda d: d["old_logprobs"][:, :-1]), ("response_mask", lambda d: d["response_mask"][:-1]),
     ("advantages", lambda d: d["advantages"][:-1]), ("logprobs", lambda d: d["logprobs"][0])],
)
def test_shape_mismatch_names_field(field, bad):
    d, _ = _base()
    d[field] = bad(d)
    with pytest.raises(ValueError, match=field) as ei:
        policy_loss(**d, config=PolicyLossConfig())
    assert "shape" in str(ei.value)


@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_inputs_name_field(field, value):
    d, ref = _base()
    d["ref_logprobs"], d["entropy"] = ref, torch.rand_like(ref)
    t = d[field].clone()
    i, j = d["response_mask"].nonzero()[0].tolist()
    if t.dim() == 1:
        t[i] = value
    else:
        t[i, j] = value
    d[field] = t
    with pytest.raises(ValueError, match=rf"^{field} contains NaN or Inf"):
        policy_loss(**d, config=PolicyLossConfig(kl_coef=0.1))


def test_all_empty_mask_and_bad_mask_values():
    d, _ = _base()
    d["response_mask"] = torch.zeros_like(d["response_mask"])
    with pytest.raises(ValueError, match="response_mask has no response tokens"):
        policy_loss(**d, config=PolicyLossConfig())
    d, _ = _base()
    d["response_mask"] = d["response_mask"].to(torch.int64) * 2
    with pytest.raises(ValueError, match="response_mask"):
        policy_loss(**d, config=PolicyLossConfig())
    d, _ = _base()
    d["response_mask"] = d["response_mask"].to(torch.float32)  # 0/1 floats are accepted
    loss, _ = policy_loss(**d, config=PolicyLossConfig())
    assert torch.isfinite(loss)


def test_other_argument_errors():
    d, _ = _base()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(**d, config=PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="loss_normalizer"):
        policy_loss(**d, config=PolicyLossConfig(), loss_normalizer=0)
    with pytest.raises(TypeError, match="config"):
        policy_loss(**d, config={"variant": "gspo"})


def test_float32_and_bfloat16_inputs():
    logp, old, adv, mask, _ = make_inputs(2)
    l64, g64, _, _ = run("gspo", logp, old, adv, mask)
    l32, g32, _, _ = run("gspo", logp.float(), old.float(), adv.float(), mask)
    assert l32.dtype == torch.float32 and g32.dtype == torch.float32
    torch.testing.assert_close(l32.double(), l64, rtol=1e-4, atol=1e-5)
    lb, gb, _, _ = run("grpo", logp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert lb.dtype == torch.float32 and gb.dtype == torch.bfloat16 and torch.isfinite(gb).all()
