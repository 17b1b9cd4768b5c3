"""The experts' FP8 grouped GEMM of the decoding step (``rollout.precision: fp8`` on Hopper:
``torch._scaled_grouped_mm``), everything around the kernel on CPU: the arguments it is given
pass torch's own checks (its meta registration, the twin of ``Blas.cpp``'s), the float32 twin
against a float64 reference, the per-row requantization, and the MoE layer of the decoding step
calling it with the permuted rows and their offsets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gspo_megatron.backends.megatron.engine.decode_weights import fp8_experts
from gspo_megatron.backends.megatron.kernels import decode
from gspo_megatron.rollouts.fp8 import (E4M3, Fp8Experts, fp8_grouped_gemm_works,
                                        fp8_grouped_linear, fp8_grouped_reference,
                                        fp8_grouped_unfit, quantize_rowwise)
from tests.unit.test_rollout import setup  # noqa: F401


def test_grouped_gemm_arguments_pass_torchs_checks():
    """:func:`fp8_grouped_linear` run on meta tensors: torch 2.13's ``_scaled_grouped_mm``
    meta function (``torch/_meta_registrations.py``: e4m3 operands, ``mat_a`` row-major,
    ``mat_b`` column-major, float32 ``scale_a [T]`` / ``scale_b [E, N]``, 16-byte strides)
    accepts what it builds and gives ``[T, N]`` bf16; a ``K`` that
    :func:`fp8_grouped_unfit` refuses is refused by torch too, and one it takes is taken."""
    def call(t, e, n, k):
        x = torch.empty(t, k, device="meta", dtype=torch.bfloat16)
        q = torch.empty(e, n, k, device="meta", dtype=E4M3)
        s = torch.empty(e, n, device="meta")
        return fp8_grouped_linear(x, q, s, torch.empty(e, dtype=torch.int32, device="meta"))

    for t, e, n, k in ((7, 4, 96, 64), (1, 128, 1536, 2048), (33, 8, 40, 768)):
        out = call(t, e, n, k)
        assert out.shape == (t, n) and out.dtype == torch.bfloat16
        assert fp8_grouped_unfit(k) is None
    assert fp8_grouped_unfit(40) is not None
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        call(7, 4, 96, 40)
    assert "Hopper only" in fp8_grouped_gemm_works(torch.device("cpu"))


def test_grouped_reference_and_rowwise_scales_against_float64():
    """Row-wise scales are each expert row's float64 ``amax / 448``; the twin equals, per
    expert's rows, the float64 product of the quantized rows and weights (to float32
    accumulation), rows of an empty group and past the last offset untouched (zero); the FP8
    result is within e4m3's error of the exact product."""
    g = torch.Generator().manual_seed(0)
    e, n, k = 4, 48, 64
    w = torch.randn(e, n, k, generator=g, dtype=torch.float64) * 0.05
    q, s = quantize_rowwise(w)
    assert q.dtype == E4M3 and s.shape == (e, n)
    torch.testing.assert_close(s.double(), (w.abs().amax(-1) / 448).float().double(), rtol=0,
                               atol=0)
    x = torch.randn(13, k, generator=g, dtype=torch.float64)
    offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)  # expert 1 empty, row 12 unused
    got = fp8_grouped_reference(x, q, s, offs)
    xq = (x / (x.abs().amax(-1, keepdim=True) / 448)).to(E4M3).double() \
        * (x.abs().amax(-1, keepdim=True) / 448).float().double()
    wd = q.double() * s.double().unsqueeze(-1)
    want = torch.zeros(13, n, dtype=torch.float64)
    for expert, (a, b) in enumerate(((0, 3), (3, 3), (3, 9), (9, 12))):
        want[a:b] = xq[a:b] @ wd[expert].t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[12], torch.zeros(n))
    exact = torch.cat([x[a:b] @ w[i].t() for i, (a, b) in ((0, (0, 3)), (2, (3, 9)),
                                                           (3, (9, 12)))])
    rel = float((got[:12].double() - exact).norm() / exact.norm())
    assert 0.005 < rel < 0.06, rel


def moe_layer(e=8, h=64, f=32, seed=0):
    """A MoE layer of the decoding step (its stacked views as the adapters give them: ``w1
    [E, H, 2F]``, ``w2 [E, F, H]``, bf16) and the step's weights around it, top-2 softmax."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(e, 2 * f, h, generator=g) * 0.1).to(torch.bfloat16).transpose(1, 2)
    w2 = (torch.randn(e, h, f, generator=g) * 0.1).to(torch.bfloat16).transpose(1, 2)
    layer = decode.DecodeLayer(None, None, None, None, None, None,
                               torch.randn(e, h, generator=g).to(torch.bfloat16), w1, w2)
    w = decode.DecodeWeights(torch.zeros(1, h, dtype=torch.bfloat16), [layer], None,
                             torch.zeros(1, h), 4, 2, 16, 16, 2, False, None, torch.float32, True,
                             F.silu, 0.0, 0.25, True)
    return w, layer


def test_decoding_step_runs_the_experts_as_fp8_grouped_gemms():
    """:func:`fp8_experts` gives each MoE layer ``Fp8Experts`` of its experts as ``F.linear``
    takes them (``[E, N, K]``, row-wise scales of the bf16 experts); the decoding step's MoE
    (8 experts, top-2: the grouped branch) calls them with its expert-major rows and offsets
    (each expert's routed rows, in order), and its output stays within FP8's error of the bf16
    grouped GEMM's."""
    w, layer = moe_layer()
    calls = []

    def gemm(x, q, scale, offs):
        calls.append((x.shape, q.shape, offs.clone()))
        return fp8_grouped_reference(x, q, scale, offs)

    fw = fp8_experts(w, gemm)
    assert fp8_experts(w, None) is w
    fl = fw.layers[0]
    assert isinstance(fl.fp8_w1, Fp8Experts) and fl.fp8_w1.q.shape == (8, 64, 64)
    assert fl.fp8_w2.q.shape == (8, 64, 32) and fl.fp8_w2.scale.shape == (8, 64)
    q, s = quantize_rowwise(layer.w1.transpose(1, 2))
    assert torch.equal(fl.fp8_w1.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fl.fp8_w1.scale, s)
    y = torch.randn(12, 1, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want, top = decode._moe(w, layer, y)
    got, top_fp8 = decode._moe(fw, fl, y)
    assert torch.equal(top, top_fp8) and len(calls) == 2
    counts = torch.bincount(top.reshape(-1), minlength=8).cumsum(0).to(torch.int32)
    assert all(torch.equal(offs, counts) for _, _, offs in calls)
    assert calls[0][0] == (24, 64) and calls[1][0] == (24, 32)  # [T k, H] then [T k, F]
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert 0.002 < rel < 0.08, rel
    # the dense branch (E <= 2 k) keeps the bf16 experts
    small = dataclasses.replace(fw, topk=4)
    decode._moe(small, fl, y)
    assert len(calls) == 2


@pytest.mark.slow
def test_fp8_copy_hands_its_experts_to_the_decoding_step(setup):  # noqa: F811
    """The tiny model's FP8 copy: the weights provider reads the copy's ``fp8_expert_gemm``
    (None on CPU: no FP8 experts) and, given one, hands the decoding step FP8 experts of every
    MoE layer; a decoding step over the real weights (top-1 routing, so that 4 experts take the
    grouped branch) calls the twin twice per MoE layer and its logits stay within FP8's error of
    the bf16 grouped GEMM's."""
    from gspo_megatron.backends.megatron.engine.decode_weights import WeightsProvider
    from gspo_megatron.backends.megatron.kernels.rotary import cos_sin
    from tests.unit.test_fp8_rollout import fp8_engine
    from tests.unit.test_rollout import VOCAB

    eng = fp8_engine(setup, precision="fp8")
    model = eng.sampling_model
    assert model.fp8_expert_gemm is None  # CPU: the probe finds no kernel
    assert all(layer.fp8_w1 is None for layer in WeightsProvider(model, VOCAB).acquire().layers)
    calls = []

    def twin(x, q, scale, offs):
        calls.append(offs.clone())
        return fp8_grouped_reference(x, q, scale, offs)

    model.fp8_expert_gemm = twin
    w = WeightsProvider(model, VOCAB).acquire()
    moe = [layer for layer in w.layers if layer.router is not None]
    assert moe and all(isinstance(layer.fp8_w1, Fp8Experts) for layer in moe)
    layer = moe[0]  # the chunked quantization is the whole stack's
    q, s = quantize_rowwise(layer.w1.transpose(1, 2))
    assert torch.equal(Fp8Experts(layer.w1.transpose(1, 2), twin, chunk=3).q.view(torch.uint8),
                       q.view(torch.uint8)) and torch.equal(layer.fp8_w1.scale, s)
    provider = WeightsProvider(model, VOCAB)
    provider.acquire()
    rel = provider.fp8_metrics()["rollout/fp8_expert_requant_rel_err"]
    assert 0.005 < rel < 0.06, rel
    w = dataclasses.replace(w, topk=1)
    plain = dataclasses.replace(w, layers=[dataclasses.replace(layer, fp8_w1=None, fp8_w2=None)
                                           for layer in w.layers])
    B, Lk, bs, blocks = 4, 8, 16, 4
    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(2, len(w.layers), blocks, bs, w.groups, w.head_dim, dtype=torch.bfloat16)
    j = torch.arange(Lk)
    key_rows = torch.arange(B)[:, None] * bs + j
    pos = torch.tensor([3, 7, 0, 5])
    pair = cos_sin(model.rotary_pos_emb(64), 1.0, torch.bfloat16)
    batch = decode.DecodeBatch(torch.randint(3, VOCAB, (B,), generator=g), pos,
                               key_rows.gather(1, pos[:, None])[:, 0], pair.cos, pair.sin,
                               [decode.KeyGroup(None, key_rows, j[None, :] <= pos[:, None], j)])
    with torch.no_grad():
        want, _ = decode.decode_forward(plain, kv.clone(), batch)
        got, _ = decode.decode_forward(w, kv.clone(), batch)
    assert len(calls) == 2 * len(moe) and all(int(o[-1]) == B for o in calls)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.1, rel
