"""The FP8 KV cache (``rollout.kv_cache_dtype: fp8``): the per-token, per-head scales against a
float64 reference, the packed rows, greedy agreement of a tiny-model rollout with the compute
dtype's cache, the KV budget's bytes, and the refusals. The tiny model and helpers are
:mod:`tests.unit.test_rollout`'s.
"""

from __future__ import annotations

import re

import pytest
import torch

from gspo_megatron.config.validation import ConfigError, validate_config
from gspo_megatron.kv_budget import kv_bytes_per_token, kv_element_bytes
from gspo_megatron.rollouts import kv_fp8
from gspo_megatron.rollouts.fp8 import E4M3, E4M3_MAX
from tests.unit.test_config import demo
from tests.unit.test_fp8_rollout import fp8_engine
from tests.unit.test_rollout import make_prompts, setup  # noqa: F401


def test_kv_scales_round_trip_against_float64():
    """Random keys ``[T, heads, D]`` with magnitudes over 6 decades: each head's scale is its
    float64 ``amax / 448`` (to float32 rounding), its codes the float64 division rounded to
    e4m3, every value within half an e4m3 step of its input; vectors already on the grid (codes
    times a power-of-two scale, amax 448) come back bitwise through the packed rows; a zero
    vector and a zeroed row read as zeros."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 40, generator=g, dtype=torch.float64) \
        * torch.pow(10.0, torch.empty(37, 3, 1, dtype=torch.float64).uniform_(-4, 2, generator=g))
    x[5, 1] = 0.0
    q, s = kv_fp8.quantize(x)
    amax = x.abs().amax(-1, keepdim=True)
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert s.dtype == torch.float32 and s.shape == (37, 3, 1)
    torch.testing.assert_close(s.double(), want.float().double(), rtol=0, atol=0)
    assert torch.equal(q.float().double(), (x / s.double()).clamp(-448, 448).to(E4M3).double())
    back = kv_fp8.dequantize(q, s, torch.float64)
    # e4m3: 3 mantissa bits, so |error| <= 2^-4 |x| for normal codes; the subnormal step below
    # 2^-6 is 2^-9 (times the scale)
    bound = torch.maximum(x.abs() * 2.0 ** -4, s.double() * 2.0 ** -10)
    assert bool(((back - x).abs() <= bound * (1 + 1e-9)).all())
    assert torch.equal(back[5, 1], torch.zeros(40, dtype=torch.float64))
    rel = float((back - x).norm() / x.norm())
    assert 0.005 < rel < 0.04, rel

    codes = torch.randint(0, 256, (20, 2, 32), generator=g, dtype=torch.uint8).view(E4M3).float()
    codes = torch.where(codes.isfinite(), codes, 0.0)
    codes[..., 0] = E4M3_MAX
    scale = torch.pow(2.0, torch.randint(-20, 4, (20, 2, 1), generator=g).float())
    exact = codes * scale
    rows = kv_fp8.pack(exact)
    assert rows.dtype == torch.uint8 and rows.shape == (20, 2, kv_fp8.packed_width(32))
    assert torch.equal(kv_fp8.unpack(rows, torch.float32), exact)
    assert torch.equal(kv_fp8.unpack(torch.zeros_like(rows), torch.bfloat16),
                       torch.zeros(20, 2, 32, dtype=torch.bfloat16))
    err, norm = kv_fp8.error_sums(exact, rows).tolist()
    assert err == 0 and norm > 0


def test_kv_budget_counts_one_byte_an_element_and_the_scales():
    assert kv_element_bytes("fp8", 2) == (1, 4) and kv_element_bytes("auto", 2) == (2, 0)
    # Qwen3-30B-A3B: 48 layers, 4 KV heads of 128
    bf16 = kv_bytes_per_token(48, 4, 128, dtype_bytes=2)
    fp8 = kv_bytes_per_token(48, 4, 128, 1, 1, *kv_element_bytes("fp8", 2))
    assert bf16 == 2 * 48 * 4 * 128 * 2 and fp8 == 2 * 48 * 4 * (128 + 4)
    assert fp8 / bf16 == pytest.approx(0.515625)
    # the planner (gspo-plan) counts the same bytes
    from gspo_megatron.config.model import model_config_from_preset
    from gspo_megatron.planner import Layout, plan_memory

    tiny = model_config_from_preset("tiny")
    plans = {c: plan_memory(tiny, Layout(), 1, rollout_requests=4, kv_cache_dtype=c)
             for c in ("auto", "fp8")}
    assert plans["fp8"].kv_cache / plans["auto"].kv_cache == pytest.approx((16 + 4) / (16 * 2))


def test_fp8_kv_settings_are_refused_where_no_decoding_step_reads_them():
    for args, message in (
            (["--rollout.engine=static"], "rollout.kv_cache_dtype='fp8' with rollout.engine="),
            (["--rollout.decode_steps_per_sync=0"],
             "rollout.kv_cache_dtype='fp8' with rollout.decode_steps_per_sync=0"),
            (["--precision.batch_invariant=true"], "got rollout.kv_cache_dtype='fp8'"),
            (["--rollout.kv_cache_dtype=fp16"], "rollout.kv_cache_dtype")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_config(demo("--rollout.kv_cache_dtype=fp8", *args))
    validate_config(demo("--rollout.kv_cache_dtype=fp8", "--rollout.precision=fp8"))


@pytest.mark.slow
def test_fp8_kv_greedy_tokens_agree_with_the_compute_dtype_cache(setup):  # noqa: F811
    """Greedy responses of 48 prompts x 8 tokens with the FP8 cache agree with a bf16 cache's
    on >= 90 % of positions (before each response's first difference; the MEASURED line under
    -s), on bf16 rollouts and on FP8-weight rollouts; the buffer holds 1 + 4/D bytes per element;
    the error is logged; the cache is written by prefills (mixed steps) and decoding rounds."""
    prompts = make_prompts(48, seed=7)
    lines = []
    for precision in ("bf16", "fp8"):
        base = fp8_engine(setup, precision=precision, top_k=1)
        eng = fp8_engine(setup, precision=precision, top_k=1, kv_cache_dtype="fp8")
        want, got = base.generate(prompts, seed=0), eng.generate(prompts, seed=0)
        buf, ref = eng.dynamic.context, base.dynamic.context
        assert buf.params_dtype == torch.uint8 and eng.dynamic.fast is not None
        head = eng.sampling_model.config.kv_channels
        assert eng.dynamic.kv_bytes == 0  # released after the call
        eng.dynamic.resume()
        base.dynamic.resume()
        assert buf.memory_buffer.shape[-1] == head + 4
        assert buf.memory_buffer.shape[:-1] == ref.memory_buffer.shape[:-1]
        assert eng.dynamic.kv_bytes / base.dynamic.kv_bytes == pytest.approx((head + 4) / (2 * head))
        eng.dynamic.suspend()
        base.dynamic.suspend()
        rel = eng.weight_metrics()["rollout/kv_fp8_rel_err"]
        assert 0.005 < rel < 0.05, rel
        assert "rollout/kv_fp8_rel_err" not in base.weight_metrics()
        same = total = 0
        for a, b in zip(want, got):
            n = min(len(a.response_ids), len(b.response_ids))
            same += next((i for i in range(n) if a.response_ids[i] != b.response_ids[i]), n)
            total += max(len(a.response_ids), len(b.response_ids))
        exact = sum(a.response_ids == b.response_ids for a, b in zip(want, got)) / len(want)
        lines.append(f"{precision} weights: {same / total:.1%} of positions before the first "
                     f"difference, {exact:.1%} of responses identical, kv_fp8_rel_err {rel:.4f}")
        assert same / total >= 0.9, lines
    print("MEASURED fp8 KV vs bf16 KV greedy: " + "; ".join(lines))


@pytest.mark.slow
def test_fp8_kv_refused_where_the_rollout_would_run_megatrons_forward(setup, monkeypatch):  # noqa: F811
    """A model the decoding step does not cover decodes through Megatron's forward, whose
    attention cannot read the FP8 cache: the engine refuses at build, in one line."""
    from gspo_megatron.backends.megatron.kernels import decode

    monkeypatch.setattr(decode, "unsupported", lambda model, groups: "a stand-in reason")
    with pytest.raises(RuntimeError, match=re.escape("rollout.kv_cache_dtype='fp8': this "
                                                     "rollout would decode through Megatron's")):
        fp8_engine(setup, kv_cache_dtype="fp8")


@pytest.mark.slow
def test_held_fp8_cache_continues_as_uninterrupted_after_a_checkpoint(setup):  # noqa: F811
    """Requests a stop cuts keep their FP8 rows (codes and scales in one row), through a
    checkpoint's ``held_state`` into a fresh engine too: continued without prefill, greedy,
    they give the uninterrupted FP8-cache responses."""
    from gspo_megatron.policy import HELD_REQUEST_KEY, GroupStop

    prompts = make_prompts(12, seed=6)
    cfg = dict(top_k=1, max_new_tokens=12, kv_cache_dtype="fp8")
    eng = fp8_engine(setup, **cfg)
    whole = eng.generate(prompts, seed=0)
    first = eng.generate(prompts, seed=0, stop=GroupStop([i // 2 for i in range(12)], need=1,
                                                         hold_cut=True))
    cut = [i for i, s in enumerate(first) if s.finish_reason == "aborted"]
    state = eng.held_state()
    fresh = fp8_engine(setup, **cfg)
    fresh.restore_held(state)
    assert cut and fresh.dynamic.held_ids() == eng.dynamic.held_ids()
    stop = GroupStop([i // 2 for i in cut], need=len({i // 2 for i in cut}), hold_cut=True,
                     continue_ids={
        k: first[i].extra[HELD_REQUEST_KEY] for k, i in enumerate(cut)})
    rest = fresh.generate([prompts[i] + first[i].response_ids for i in cut], seed=0,
                          budgets=[12 - len(first[i].response_ids) for i in cut], stop=stop)
    assert fresh.dynamic.tokens_forwarded == sum(len(s.response_ids) for s in rest)  # no prefill
    for i, s in zip(cut, rest):
        assert first[i].response_ids + s.response_ids == whole[i].response_ids


def test_decode_plan_counts_fp8_experts_and_the_fp8_key_window():
    """gspo-plan's decoder memory: ``rollout.precision: fp8`` adds the call's experts in FP8
    (one byte a weight, a float32 scale a row; all of them when replicated), printed as its own
    line; the FP8 cache's key window holds the packed rows, their float32 dequantization and the
    compute-dtype result."""
    from gspo_megatron.config.model import model_config_from_preset
    from gspo_megatron.decode_plan import decode_lines, decode_peak

    m = model_config_from_preset("qwen3-30b-a3b")
    kw = dict(tp=2, ep=8, etp=1, pp=1, max_batch_size=64, seq_length=m.seq_length,
              cuda_graphs=False)
    base = decode_peak(m, replicated=False, **kw)
    fp8 = decode_peak(m, replicated=False, fp8_experts=True, **kw)
    assert base.fp8_experts == 0 and not any("FP8" in line for line in decode_lines(base))
    assert fp8.fp8_experts == 48 * 16 * (3 * 2048 * 768 + 4 * (2 * 768 + 2048))
    assert fp8.rollout_begin == base.rollout_begin + fp8.fp8_experts
    assert any("decode: FP8 experts" in line for line in decode_lines(fp8))
    assert decode_peak(m, replicated=True, fp8_experts=True, **kw).fp8_experts == 8 * fp8.fp8_experts
    kv = decode_peak(m, replicated=False, kv_fp8=True, **kw)
    window = 2 * 64 * m.seq_length * 2  # requests x keys x this TP rank's 2 KV heads
    assert kv.step_activations - base.step_activations == window * ((128 + 4) + 4 * 128)


@pytest.mark.distributed
def test_fp8_kv_on_two_tensor_parallel_ranks(tmp_path):
    """TP=2 (+SP) on gloo with the FP8 cache: each rank's cache holds its key/value heads with
    their own scales (a head's scale does not depend on the split), both ranks sample the same
    responses, the error is logged, and the mismatch against the fp32 trainer stays bounded.
    ~12 s, mostly start-up."""
    import json
    import os

    from tests.helpers.torchrun import torchrun

    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed",
                          "rollout_precision_worker.py")
    torchrun(2, worker, "--out", str(tmp_path), "--tp", "2", "--kv", "fp8", timeout=180)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for got in ranks:
        assert got["kv_dtype"] == "torch.uint8", got["kv_dtype"]
        assert 0.005 < got["kv_fp8_rel_err"] < 0.05, got["kv_fp8_rel_err"]
        assert 1e-6 < got["k3"] < 5e-3, got["k3"]
    assert ranks[0]["r"] == ranks[1]["r"] and ranks[0]["lp"] == ranks[1]["lp"]
    print(f"MEASURED TP=2 FP8 cache: k3 {ranks[0]['k3']:.2e}, kv_fp8_rel_err "
          f"{ranks[0]['kv_fp8_rel_err']:.4f}")
