"""FP8 rollouts (``rollout.precision: fp8``) and the router-noise control
(``rollout.router_noise_std``): the block-wise quantization against a float64 reference, the
sampling copy's FP8 weights, greedy agreement with bf16 rollouts, the noise's effect on routes,
and the refusals. The tiny model and helpers are :mod:`tests.unit.test_rollout`'s.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from gspo_megatron.config import RolloutConfig
from gspo_megatron.config.validation import ConfigError
from gspo_megatron.config.validation import validate_config
from gspo_megatron.rollouts.fp8 import (E4M3, E4M3_MAX, dequantize_blockwise, fp8_linear,
                                        fp8_linear_reference, quantize_blockwise)
from tests.unit.test_config import demo
from tests.unit.test_rollout import EOS, PAD, VOCAB, make_prompts, setup  # noqa: F401


def reference_quantize(w: torch.Tensor, b: int):
    """Block by block in float64: ``scale = amax / 448``, ``q = round_e4m3(w / scale)``."""
    n, k = w.shape
    scale = torch.ones(math.ceil(n / b), math.ceil(k / b), dtype=torch.float64)
    deq = torch.zeros_like(w, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * b:(i + 1) * b, j * b:(j + 1) * b].double()
            amax = tile.abs().max()
            s = amax / 448 if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
            scale[i, j] = s
            q = (tile / s).clamp(-448, 448).to(E4M3).double()
            deq[i * b:(i + 1) * b, j * b:(j + 1) * b] = q * s
    return scale, deq


def test_block_scales_round_trip_exactly():
    """Values representable in the block format (e4m3 codes times a power-of-two scale per
    block, each block's largest |code| 448) come back bitwise: the same codes, the same scales,
    the same weights; edge blocks (300 x 200 in 128-blocks) and a stacked [E, N, K] included."""
    g = torch.Generator().manual_seed(0)
    for shape, b in (((300, 200), 128), ((3, 130, 64), 128), ((40, 50), 16)):
        codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(E4M3)
        codes = torch.where(codes.float().isfinite(), codes.float(), 0.0)  # drop the NaN codes
        nb, kb = math.ceil(shape[-2] / b), math.ceil(shape[-1] / b)
        exps = torch.randint(-12, 4, (*shape[:-2], nb, kb), generator=g).double()
        scale = torch.pow(2.0, exps)
        codes[..., ::b, ::b] = E4M3_MAX  # each block's first element: the block amax
        w = codes.double() * scale.repeat_interleave(b, -2).repeat_interleave(b, -1)[
            ..., :shape[-2], :shape[-1]]
        for dtype in (torch.float64, torch.float32):
            q, s = quantize_blockwise(w.to(dtype), b)
            assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == scale.shape
            assert torch.equal(q.float(), codes.float()) and torch.equal(s.double(), scale)
            assert torch.equal(dequantize_blockwise(q, s, torch.float64, b), w)


def test_quantize_matches_a_float64_reference():
    """Random weights: scales and dequantized weights equal a block-by-block float64 reference
    (to float32 rounding of the scale), and every element within half an e4m3 step."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(260, 300, generator=g) * torch.rand(260, 1, generator=g) * 0.05
    w[:128, :128] = 0.0  # an all-zero block: scale 1, codes 0
    q, s = quantize_blockwise(w, 128)
    scale, deq = reference_quantize(w, 128)
    torch.testing.assert_close(s.double(), scale.float().double(), rtol=0, atol=0)
    got = dequantize_blockwise(q, s, torch.float64, 128)
    torch.testing.assert_close(got, deq, rtol=2 ** -20, atol=0)
    step = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:260, :300]
    bound = torch.maximum(w.double().abs() * 2 ** -4, step * 2 ** -10) * (1 + 1e-6)
    assert ((got - w.double()).abs() <= bound).all()
    assert s[0, 0] == 1 and (q[:128, :128].float() == 0).all()


def test_fp8_linear_reference_and_the_gemm_call():
    """The GEMM's CPU twin (activations per 1 x 128, weights per 128 x 128) is a matmul to FP8
    precision; ``fp8_linear``'s ``torch._scaled_mm`` call has the layout the kernel takes (its
    shape checks, run on the meta device: the kernel itself runs only on Hopper)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 256, generator=g), torch.randn(384, 256, generator=g) * 0.02
    q, s = quantize_blockwise(w, 128)
    out = fp8_linear_reference(x, q, s)
    exact = x.double() @ w.double().t()
    rel = float((out.double() - exact).norm() / exact.norm())
    assert 1e-3 < rel < 6e-2, rel
    meta = fp8_linear(x.to("meta", torch.bfloat16), q.to("meta"), s.to("meta"))
    assert meta.shape == (5, 384) and meta.dtype == torch.bfloat16


def scaled_mm_as_cublas_checks(calls):
    """A CPU stand-in for ``torch._scaled_mm`` with block-wise scales: cuBLAS's layout rules
    (1 x 128 activation scales rows-innermost with a 16-byte aligned leading dimension; 128 x 128
    weight scales ``[K/128, N/128]`` K-innermost, ``K/128`` a multiple of 4), then the product
    of the dequantized operands in float32."""
    def fake(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, **_):
        rows, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == E4M3 and b.stride(0) == 1  # B column-major
        assert scale_a.shape == (rows, k // 128) and scale_a.stride(0) == 1
        assert scale_a.stride(1) % 4 == 0 or k == 128, "leading dimension not 16-byte aligned"
        assert scale_b.shape == (k // 128, n // 128) and scale_b.stride(0) == 1
        assert (k // 128) % 4 == 0
        calls.append(rows)
        x = dequantize_blockwise(a, scale_a, torch.float32, (1, 128))
        w = dequantize_blockwise(b.t(), scale_b.t(), torch.float32, 128)
        return (x @ w.t()).to(out_dtype)
    return fake


def test_fp8_gemm_pads_rows_and_refuses_what_cublas_does_not_take(monkeypatch):
    """A decoding step has any number of rows: ``fp8_linear`` pads them to 16 (zero rows, scale
    1, dropped from the output) so the activation scales' leading dimension is aligned (one row
    was refused by cuBLAS on the H200); weights whose ``K`` is not whole groups of four blocks are
    left to the dequantized path; a GEMM that refuses is found by the probe, in one line."""
    import gspo_megatron.rollouts.fp8 as fp8

    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_as_cublas_checks(calls))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g) * 0.02
    q, s = quantize_blockwise(w, 128)
    for rows in (1, 5, 16, 37):
        x = torch.randn(rows, 512, generator=g)
        got = fp8.fp8_linear(x, q, s, out_dtype=torch.float32)
        assert got.shape == (rows, 256)
        torch.testing.assert_close(got, fp8_linear_reference(x, q, s), rtol=1e-5, atol=1e-5)
    assert calls == [16, 16, 16, 48]
    assert fp8.fp8_gemm_unfit(256, 512) is None
    assert "K % 512" in fp8.fp8_gemm_unfit(256, 384) and "N % 128" in fp8.fp8_gemm_unfit(200, 512)
    assert "block 64" in fp8.fp8_gemm_unfit(256, 512, 64)
    assert "Hopper" in fp8.fp8_gemm_works(torch.device("cpu"))
    monkeypatch.setattr(fp8, "fp8_gemm_runs_on", lambda device: True)
    assert fp8.fp8_gemm_works(torch.device("cpu")) is None  # the stand-in takes the layout

    def refuses(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLt...`\n"
                           "more lines")
    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    why = fp8.fp8_gemm_works(torch.device("cpu"))
    assert why.startswith("torch._scaled_mm refused") and "NOT_SUPPORTED" in why
    assert "\n" not in why
    # The copy packs for the kernel only the attention weights it takes; the rest stay dequantized.
    from types import SimpleNamespace

    from gspo_megatron.backends.megatron.rollout_numerics import Fp8Weights

    pairs = [(f"decoder.layers.0.self_attention.{name}.weight", torch.zeros(n, k), live)
             for name, (n, k) in (("linear_qkv", (256, 512)), ("linear_proj", (256, 384)))
             for live in [torch.randn(n, k, generator=g)]]
    weights = Fp8Weights(pairs, 128, fp8.fp8_linear, SimpleNamespace())
    weights.apply()
    assert list(weights.packed) == ["decoder.layers.0.self_attention.linear_qkv.weight"]


# ----------------------------------------------------------------------- the engine (tiny model)
def fp8_engine(setup, **cfg):  # noqa: F811
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine

    policy, groups = setup
    cfg = {"max_new_tokens": 8, "max_batch_size": 16, **cfg}
    return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                         config=RolloutConfig(**cfg))


@pytest.mark.slow
def test_fp8_copy_quantizes_the_linear_layers_only(setup):  # noqa: F811
    """The copy's attention and expert weights are the live ones through FP8 (requantized when
    the live weights change); embeddings, norms, routers and the output layer are the bf16
    cast; the live model is untouched; the error is logged overall and per layer."""
    policy, _ = setup
    live = policy.unwrapped()
    eng = fp8_engine(setup, precision="fp8")
    eng.generate(make_prompts(4), seed=0)
    copy = dict(eng.copy.model.named_parameters())
    names = {n for n, _, _ in eng.fp8.pairs}
    assert names and all(re.search(r"linear_(qkv|proj|fc1|fc2)\.weight$", n) for n in names)
    assert any("local_experts" in n for n in names)
    for n, p in live.named_parameters():
        if n in names:
            q, s = quantize_blockwise(p.detach(), 128)
            assert torch.equal(copy[n], dequantize_blockwise(q, s, torch.bfloat16))
            assert not torch.equal(copy[n], p.detach().to(torch.bfloat16))
        else:
            assert torch.equal(copy[n], p.detach().to(torch.bfloat16)), n
    m = eng.weight_metrics()
    layers = [k for k in m if "/layer_" in k]
    assert len(layers) == live.config.num_layers
    assert all(0.005 < v < 0.06 for v in m.values()), m  # e4m3: 3 mantissa bits
    before = copy[next(iter(names))].clone()
    with torch.no_grad():
        saved = [p.detach().clone() for p in live.parameters()]
        for p in live.parameters():
            p.mul_(1.5)
        eng.generate(make_prompts(2), seed=0)
        after = dict(eng.copy.model.named_parameters())[next(iter(names))]
        assert not torch.equal(after, before)  # requantized at the refresh
        for p, v in zip(live.parameters(), saved):
            p.copy_(v)


@pytest.mark.slow
def test_fp8_greedy_tokens_agree_with_bf16(setup):  # noqa: F811
    """Greedy responses of 48 prompts x 8 tokens from FP8 weights agree with bf16 rollouts'
    token by token on >= 90 % of positions (measured: see the MEASURED line under -s); the
    static engine's FP8 rollouts agree with the dynamic engine's."""
    prompts = make_prompts(48, seed=7)
    out = {p: fp8_engine(setup, precision=p, top_k=1).generate(prompts, seed=0)
           for p in ("bf16", "fp8")}
    same = total = 0
    for a, b in zip(out["bf16"], out["fp8"]):
        n = min(len(a.response_ids), len(b.response_ids))
        first = next((i for i in range(n) if a.response_ids[i] != b.response_ids[i]), n)
        same += first  # positions before the first difference (after it, contexts differ)
        total += max(len(a.response_ids), len(b.response_ids))
    agree = same / total
    exact = sum(a.response_ids == b.response_ids for a, b in zip(out["bf16"], out["fp8"])) / 48
    print(f"MEASURED fp8 vs bf16 greedy: {agree:.1%} of positions before the first "
          f"difference, {exact:.1%} of responses identical")
    assert agree >= 0.9, agree
    # The legacy static engine samples from the same FP8 copy.
    static = fp8_engine(setup, precision="fp8", top_k=1, engine="static").generate(prompts, seed=0)
    same_static = sum(a.response_ids == b.response_ids for a, b in zip(static, out["fp8"])) / 48
    assert same_static >= 0.9, same_static


@pytest.mark.slow
def test_decoding_step_runs_attention_as_fp8_gemms(setup):  # noqa: F811
    """What Hopper runs, with the GEMM's CPU twin: the copy's attention weights become
    ``Fp8Linear`` objects (kept in the same tensors across refreshes, for CUDA graphs) that the
    multi-step decoding step calls through ``F.linear``; greedy tokens stay within the FP8
    agreement of the dequantized path (activation quantization is the only difference)."""
    from gspo_megatron.backends.megatron.kernels.decode import DecodeWeights
    from gspo_megatron.rollouts.fp8 import Fp8Linear

    prompts = make_prompts(24, seed=11)
    plain = fp8_engine(setup, precision="fp8", top_k=1)
    assert plain.fp8.gemm is None and not plain.fp8.packed  # CPU: dequantized weights only
    want = plain.generate(prompts, seed=0)
    eng = fp8_engine(setup, precision="fp8", top_k=1)
    eng.fp8.gemm = fp8_linear_reference
    got = eng.generate(prompts, seed=0)
    w = DecodeWeights.of(eng.copy.model)
    assert all(isinstance(layer.qkv, Fp8Linear) and isinstance(layer.proj, Fp8Linear)
               for layer in w.layers)
    q = w.layers[0].qkv.q
    eng.generate(prompts[:2], seed=0)
    assert DecodeWeights.of(eng.copy.model).layers[0].qkv.q is q  # refreshed in place
    x = torch.randn(3, 1, q.shape[1], dtype=torch.bfloat16)
    torch.testing.assert_close(torch.nn.functional.linear(x, w.layers[0].qkv).float(),
                               fp8_linear_reference(x.view(3, -1), q, w.layers[0].qkv.scale_inv)
                               .view(3, 1, -1), rtol=1e-2, atol=1e-2)
    same = sum(a.response_ids == b.response_ids for a, b in zip(want, got)) / len(want)
    print(f"MEASURED FP8 GEMM twin vs dequantized weights: {same:.1%} of greedy responses equal")
    assert same >= 0.75, same


@pytest.mark.slow
def test_router_noise_moves_routes_by_its_scale(setup):  # noqa: F811
    """With the noise on, the engine samples from a copy whose routers add seeded Gaussian
    noise: through Megatron's forward (``decode_steps_per_sync: 0``) the routes taken differ
    from the noise-free ones more as the scale grows; the multi-step decoding step adds the same
    noise (greedy samples change under a large scale); the same seed gives the same samples;
    the live routers stay noise-free."""
    from megatron.core.transformer.moe.router import TopKRouter

    prompts = make_prompts(16, seed=3)
    live = setup[0].unwrapped()

    def run(std, **cfg):
        eng = fp8_engine(setup, router_noise_std=std, top_k=1, **cfg)
        seen = []
        hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(out[1].clone()))
                 for m in eng.sampling_model.modules() if isinstance(m, TopKRouter)]
        samples = eng.generate(prompts, seed=5)
        for h in hooks:
            h.remove()
        return eng, [x.response_ids for x in samples], torch.cat(seen) if seen else None

    eng0, s0, r0 = run(0.0, decode_steps_per_sync=0)
    assert eng0.copy is None and eng0.router_noise is None  # off: today's engine
    rates = []
    for std in (0.02, 0.5):
        eng, s, r = run(std, decode_steps_per_sync=0)
        assert eng.copy is not None and eng.router_noise is not None
        assert not hasattr(live.decoder.layers[0].mlp.router, "logit_noise")
        n = min(len(r), len(r0))
        rates.append(float((r[:n] != r0[:n]).any(-1).float().mean()))
        assert run(std, decode_steps_per_sync=0)[1] == s  # seeded
    print(f"MEASURED router noise 0.02 / 0.5: {rates[0]:.1%} / {rates[1]:.1%} of (token, layer) "
          "routes differ (prefix up to the first changed token)")
    assert 0 < rates[0] < rates[1], rates
    _, fast0, _ = run(0.0)
    _, fast, _ = run(50.0)
    assert fast != fast0 and run(50.0)[1] == fast


def test_bad_fp8_and_noise_settings_are_refused():
    for args, message in (
            (["--rollout.fp8_block_size=100"], "rollout.fp8_block_size: must be a power of two"),
            (["--rollout.fp8_block_size=8"], "rollout.fp8_block_size: must be a power of two"),
            (["--rollout.router_noise_std=-0.1"], "rollout.router_noise_std: must be >= 0"),
            (["--rollout.precision=fp16"], "rollout.precision")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_config(demo(*args))
    validate_config(demo("--rollout.precision=fp8", "--rollout.router_noise_std=0.5"))


@pytest.mark.slow
def test_gpu_fp8_bench_runs_its_gpu_code_on_cpu(tmp_path):
    """``tools/gpu_check``'s ``fp8_decode`` stage at toy size on CPU (the tiny preset): the three
    paths are timed, FP8 greedy tokens compared with bf16's, the error logged; the GEMM timing
    says it needs Hopper. Both stages are in the check's list."""
    from tools.bench.gpu_fp8 import PATHS, run
    from tools.gpu_check import stages

    res = run("smoke", tiny=True)
    assert res["fp8_gemm"] is False and res["gemms"] == {"skipped": "needs a Hopper GPU"}
    assert res["fp8_expert_gemm"] is False
    assert res["grouped_gemms"] == {"skipped": "needs a Hopper GPU"}
    assert 0 < res["kv_fp8_rel_err"] < 0.05
    assert set(res["paths"]) == set(PATHS)
    for name, rec in res["paths"].items():
        assert "error" not in rec and rec["tokens"] > 0, (name, rec)
        assert (rec["refresh_s"] > 0) == (name != "bf16")
    assert 0 < res["fp8_weight_rel_err"]["rollout/fp8_weight_rel_err"] < 0.06
    assert all(0 <= n <= res["batch"] for n in res["greedy_requests_differing_from_bf16"].values())
    assert {"fp8_decode", "tiny_fp8_rollout", "tiny_fp8_kv_rollout"} <= {
        s.name for s in stages(str(tmp_path), "quick")}
