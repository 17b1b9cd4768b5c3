"""gspo_megatron.backends.megatron.kernels.local: the faster local-spec modules against float64 references and
against Megatron's own modules (``precision.local_kernels=False``) with the same weights.

The model-level tests cover every short path: SDPA attention (causal training forward, prefill and
KV-cache decoding), keys rotated once in the static cache, ``F.linear`` at TP=1 and the direct
expert loop (including experts that receive no token), in the forward, the backward (DDP's
``main_grad``) and greedy generation through Megatron's static engine.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)

os.environ.setdefault("TQDM_DISABLE", "1")
MODEL = dict(num_layers=3, moe_layer_freq=[1, 0, 1], seq_length=48, num_moe_experts=8,
             moe_aux_loss_coeff=0.0)  # 4 heads / 2 KV groups (GQA), 8 experts top-2


@pytest.fixture(scope="module")
def setup():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.backends.megatron.policy import build_policy

    model = model_config_from_preset("tiny", **MODEL)
    groups = initialize_distributed(ParallelConfig(), model, seed=11)

    def build(local_kernels):
        return build_policy(model, ParallelConfig(),
                            PrecisionConfig(transformer_impl="local", local_kernels=local_kernels),
                            OptimConfig(), groups, total_steps=1, with_optimizer=False)

    fast, ref = build(True), build(False)
    fast.copy_weights_to(ref)
    yield model, groups, fast, ref
    destroy_distributed()


def test_the_swap_happened(setup):
    from gspo_megatron.backends.megatron.kernels import local as lk
    from gspo_megatron.backends.megatron.kernels import moe as local_moe

    _, _, fast, ref = setup
    kinds = {type(m) for m in fast.unwrapped().modules()}
    assert {lk.RopeOnceSelfAttention, lk.SDPADotProductAttention, lk.DirectColumnParallelLinear,
            lk.DirectRowParallelLinear, local_moe.LoopedSequentialMLP, local_moe.DirectMoELayer,
            local_moe.EagerBiasTopKRouter} <= kinds
    assert not any(type(m).__module__ in (lk.__name__, local_moe.__name__)
                   for m in ref.unwrapped().modules())
    # Same parameters under the same names: checkpoints and converters see no difference.
    assert list(fast.unwrapped().state_dict()) == list(ref.unwrapped().state_dict())


def _reference_attention(q, k, v, scale, mask):
    """float64 softmax attention; q [sq, b, np, hn], k/v [sk, b, ng, hn], mask [sq, sk] True=keep."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("case", ["causal", "decode", "chunk", "explicit_mask"])
def test_sdpa_attention_matches_float64(setup, case):
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.backends.megatron.kernels.local import SDPADotProductAttention

    fast = setup[2]
    config = fast.transformer_config
    attn = SDPADotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self").eval()
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    sq, sk = {"causal": (9, 9), "decode": (1, 13), "chunk": (4, 11), "explicit_mask": (7, 7)}[case]
    b, np_, ng, hn = 3, config.num_attention_heads, config.num_query_groups, config.kv_channels
    q = torch.randn(sq, b, np_, hn, generator=gen)
    k, v = (torch.randn(sk, b, ng, hn, generator=gen) for _ in range(2))
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)  # causal, aligned to the last key
    megatron_mask = None
    if case == "decode":
        keep = torch.ones(sq, sk, dtype=torch.bool)
    if case == "explicit_mask":  # Megatron's convention: True = masked out
        keep = torch.rand(sq, sk, generator=gen) > 0.3
        keep[:, 0] = True  # every query keeps at least one key
        megatron_mask = (~keep).view(1, 1, sq, sk)
    out = attn(q, k, v, megatron_mask)
    ref = _reference_attention(q, k, v, attn.softmax_scale, keep)
    assert out.shape == (sq, b, np_ * hn)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _batch(vocab, seed=0):
    from gspo_megatron.policy import make_policy_batch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, MODEL["seq_length"], (6,), generator=gen)  # padded batch
    seqs = [torch.randint(1, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    return make_policy_batch(seqs, [4] * len(seqs), pad_id=0)


def test_forward_and_gradients_match_megatron_modules(setup):
    from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
    from tests.helpers.megatron import train_sft_minibatch

    model, groups, fast, ref = setup
    scoring = ScoringConfig(vocab_size=model.vocab_size)
    batch = _batch(model.vocab_size)
    lp_fast, _ = compute_logprobs(fast.model, batch, 3, scoring, groups)  # no-grad path
    lp_ref, _ = compute_logprobs(ref.model, batch, 3, scoring, groups)
    torch.testing.assert_close(lp_fast, lp_ref, rtol=1e-5, atol=1e-5)

    losses = {}
    for name, pol in (("fast", fast), ("ref", ref)):
        pol.zero_grad()
        losses[name] = train_sft_minibatch(pol.model, batch, 3, scoring, groups)["loss/sft_nll"]
    assert losses["fast"] == pytest.approx(losses["ref"], rel=1e-5)
    grads_fast = dict(fast.unwrapped().named_parameters())
    checked = 0
    for name, p in ref.unwrapped().named_parameters():
        g_ref, g_fast = p.main_grad, grads_fast[name].main_grad
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-4, atol=1e-6, msg=name)
        checked += int(g_ref.abs().sum() > 0)
    assert checked > 20  # attention, dense MLP, routers and experts all got gradient


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_greedy_generation_matches_megatron_modules(setup, kind):
    """Our local kernels vs Megatron's own modules, same weights, on both engines: the static
    engine's KV cache (left padding, RoPE once, SDPA over the cache) and the dynamic engine's
    paged cache."""
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine

    model, groups, fast, ref = setup
    gen = torch.Generator().manual_seed(5)
    # Prompts of different lengths (the fast engine left-pads them and prefills all at once,
    # Megatron's modules prefill the shortest and feed the others' tails one step at a time),
    # and prompts of one length (no padding): prefill and KV-cache decoding on every path.
    prompts = [torch.randint(1, model.vocab_size, (int(n),), generator=gen).tolist()
               for n in [*torch.randint(3, 9, (5,), generator=gen).tolist(), 6, 6, 6]]
    out = {}
    for name, pol in (("fast", fast), ("ref", ref)):
        engine = RolloutEngine(pol.model, groups, eos_id=model.vocab_size - 1, pad_id=0,
                               vocab_size=model.vocab_size,
                               config=RolloutConfig(max_new_tokens=12, top_k=1, max_batch_size=8,
                                                    engine=kind),
                               max_sequence_length=MODEL["seq_length"])
        out[name] = engine.generate(prompts[:5], seed=0) + engine.generate(prompts[5:], seed=0)
    for a, b in zip(out["fast"], out["ref"], strict=True):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_shared_rotation_is_megatrons_bitwise(rot_dim):
    """The decode path's RoPE (cos/sin computed once per step, ``rotate``) gives exactly
    Megatron's unfused ``_apply_rotary_pos_emb_bshd``, for full and partial rotary dims."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from gspo_megatron.backends.megatron.kernels.rotary import cos_sin, rotate

    gen = torch.Generator().manual_seed(rot_dim)
    t = torch.randn(5, 3, 4, 16, generator=gen)
    freqs = torch.rand(5, 3, 1, rot_dim, generator=gen) * 20
    for mscale in (1.0, 1.3):  # (YaRN's concentration factor)
        ref = _apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)
        out = rotate(t, *cos_sin(freqs, mscale, t.dtype))
        assert torch.equal(out, ref) and not torch.equal(out, t)


def test_direct_moe_layer_is_the_dispatchers_result_bitwise(setup):
    """Without autograd the MoE layer skips the all-to-all dispatcher (single rank): the output
    equals Megatron's dispatcher path bit for bit, and the router still runs as a module (its
    forward hooks fire: R2/R3 record and replay there)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from gspo_megatron.backends.megatron.kernels.moe import DirectMoELayer

    fast = setup[2]
    layer = next(m for m in fast.unwrapped().modules() if isinstance(m, DirectMoELayer))
    assert layer._direct
    x = torch.randn(7, 3, layer.config.hidden_size, generator=torch.Generator().manual_seed(2))
    seen = []
    hook = layer.router.register_forward_hook(lambda m, a, out: seen.append(out[1].sum().item()))
    try:
        with torch.no_grad():
            direct, _ = layer(x)
            megatron, _ = MoELayer.forward(layer, x)
    finally:
        hook.remove()
    assert torch.equal(direct, megatron) and direct.abs().sum() > 0
    assert seen == [7 * 3 * layer.config.moe_router_topk] * 2


def test_grouped_experts_inside_the_rollout_scope_equal_the_loop(setup):
    """Inside ``stacked_expert_weights`` (one generate) a CPU MoE layer's experts run as two
    ``torch._grouped_mm`` calls: bitwise the per-expert loop's output, including an expert that
    gets no token; with autograd on, or after the scope, the loop runs (weights may change)."""
    from gspo_megatron.backends.megatron.kernels.moe import LoopedSequentialMLP, stacked_expert_weights

    fast = setup[2]
    mlps = [m for m in fast.unwrapped().modules() if isinstance(m, LoopedSequentialMLP)]
    assert len(mlps) == 2
    mlp = mlps[0]
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 3, 7, 1, 0, 4, 2])
    x = torch.randn(int(counts.sum()), mlp.config.hidden_size, generator=gen)
    probs = torch.rand(int(counts.sum()), generator=gen)
    with torch.no_grad():
        loop, _ = mlp(x, counts, probs)
        with stacked_expert_weights(fast.unwrapped()):
            assert all(m.stacked is not None for m in mlps)
            grouped, _ = mlp(x, counts, probs)
    assert all(m.stacked is None for m in mlps)
    assert torch.equal(grouped, loop) and loop.abs().sum() > 0
    calls = []
    real = mlp._grouped
    with stacked_expert_weights(fast.unwrapped()), torch.enable_grad():
        # With autograd the scope's stacked weights (a snapshot) are not used: the training path
        # stacks the live weights inside autograd instead.
        mlp._grouped = lambda *a: calls.append(a[-1]) or real(*a)
        try:
            out, _ = mlp(x, counts, probs)
        finally:
            del mlp._grouped
        assert len(calls) == 1 and calls[0] is not mlp.stacked
    assert torch.equal(out.detach(), loop)


def _main_grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for n, p in policy.unwrapped().named_parameters()}


def test_grouped_training_experts_are_the_loop_bitwise(setup):
    """With autograd (the update's forward) a CPU MoE layer's experts run as two grouped GEMMs
    over weights stacked inside autograd: output, input/probs gradients and every expert's weight
    gradient (DDP's ``main_grad``) are bitwise the per-expert loop's, an empty expert included
    (its weights get an exact zero gradient, as in the loop)."""
    from gspo_megatron.backends.megatron.kernels.moe import LoopedSequentialMLP

    fast = setup[2]
    mlp = next(m for m in fast.unwrapped().modules() if isinstance(m, LoopedSequentialMLP))
    assert mlp._grouped_training
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([37, 0, 23, 61, 9, 0, 44, 18])
    x0 = torch.randn(int(counts.sum()), mlp.config.hidden_size, generator=gen)
    p0 = torch.rand(int(counts.sum()), generator=gen)
    g = torch.randn(x0.shape, generator=gen)
    out = {}
    for grouped in (True, False):
        mlp.__dict__["_grouped_training"] = grouped
        calls = []
        real = mlp._grouped
        mlp._grouped = lambda *a: calls.append(1) or real(*a)
        try:
            fast.zero_grad()
            x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
            y, _ = mlp(x, counts, p)
            y.backward(g)
        finally:
            del mlp._grouped
            mlp.__dict__["_grouped_training"] = True
        assert len(calls) == int(grouped)
        out[grouped] = (y.detach(), x.grad, p.grad, _main_grads(fast))
    (y1, x1, p1, w1), (y2, x2, p2, w2) = out[True], out[False]
    assert torch.equal(y1, y2) and torch.equal(x1, x2) and torch.equal(p1, p2)
    experts = [n for n in w1 if "local_experts" in n]
    assert len(experts) == 2 * 8 * 2  # fc1 + fc2, 8 experts, 2 MoE layers
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    assert sum(int(w1[n].abs().sum() > 0) for n in experts) == 6 * 2  # 6 experts got tokens


def test_direct_moe_layer_with_autograd_is_the_dispatchers_bitwise(setup):
    """The update's forward takes the direct MoE path too (single expert/tensor rank): output,
    input gradient and every parameter's ``main_grad`` (router, experts) are bitwise those of
    Megatron's all-to-all dispatcher path, whose single-rank all-to-alls and identity chunk sorts
    pass values and gradients through unchanged."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from gspo_megatron.backends.megatron.kernels.moe import DirectMoELayer

    fast = setup[2]
    layer = next(m for m in fast.unwrapped().modules() if isinstance(m, DirectMoELayer))
    gen = torch.Generator().manual_seed(6)
    x0 = torch.randn(9, 4, layer.config.hidden_size, generator=gen)
    g = torch.randn(x0.shape, generator=gen)
    out = {}
    for name, forward in (("direct", layer.__call__),
                          ("megatron", lambda x: MoELayer.forward(layer, x))):
        fast.zero_grad()
        x = x0.clone().requires_grad_()
        y, _ = forward(x)
        y.backward(g)
        out[name] = (y.detach(), x.grad, _main_grads(fast))
    (y1, x1, w1), (y2, x2, w2) = out["direct"], out["megatron"]
    assert torch.equal(y1, y2) and torch.equal(x1, x2) and y1.abs().sum() > 0
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    assert sum(int(w1[n].abs().sum() > 0) for n in w1) >= 8  # router and experts got gradient


def test_lean_attention_is_megatrons_bitwise(setup):
    """Without an inference context (old-log-prob pass, update) the attention takes the lean
    forward (one shared cos/sin table, no per-call branching): output, input gradient and the
    QKV/norm/projection ``main_grad`` are bitwise ``Attention.forward``'s, and the shared table
    is reused across calls with the same rotary table."""
    from gspo_megatron.backends.megatron.kernels import local as lk

    fast = setup[2]
    gpt = fast.unwrapped()
    attn = next(m for m in gpt.modules() if isinstance(m, lk.RopeOnceSelfAttention))
    assert attn._lean
    gen = torch.Generator().manual_seed(9)
    x0 = torch.randn(11, 3, attn.config.hidden_size, generator=gen)
    g = torch.randn(x0.shape, generator=gen)
    freqs = gpt.rotary_pos_emb(11)
    out = {}
    for lean in (True, False):
        attn.__dict__["_lean"] = lean
        calls = []
        real = attn._lean_forward
        attn._lean_forward = lambda *a: calls.append(1) or real(*a)
        try:
            fast.zero_grad()
            x = x0.clone().requires_grad_()
            y, bias = attn(x, None, rotary_pos_emb=freqs)
            y.backward(g)
            with torch.no_grad():
                y_nograd, _ = attn(x0, None, rotary_pos_emb=freqs)
        finally:
            del attn._lean_forward
            attn.__dict__["_lean"] = True
        assert len(calls) == 2 * int(lean) and bias is None
        out[lean] = (y.detach(), y_nograd, x.grad, _main_grads(fast))
    (y1, n1, x1, w1), (y2, n2, x2, w2) = out[True], out[False]
    assert torch.equal(y1, y2) and torch.equal(n1, n2) and torch.equal(x1, x2)
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    assert sum(int(w1[n].abs().sum() > 0) for n in w1) == 4  # qkv, q/k norms, projection
    get = lambda: attn._rope_cache.get((id(freqs), torch.float32), lambda: freqs,  # noqa: E731
                                       attn._mscale, torch.float32, pin=(freqs,))
    cos, sin, rot = get()
    assert get().cos is cos and rot == freqs.shape[-1]  # made once per table
    assert torch.equal(cos, torch.cos(freqs) * attn._mscale)


def test_paged_attention_forward_and_kv_append_are_megatrons_bitwise(setup):
    """Under the dynamic engine the attention takes the lean paged forward and the context
    appends keys/values with one ``index_copy_`` per tensor: sampled tokens and their
    log-probs are bitwise those of Megatron's ``Attention.forward`` and ``append_key_value_cache``
    (more prompts than slots, so steps mix prefills with decodes; Megatron's per-step loop,
    where every step runs Megatron's forward, as TP / PP rollouts do)."""
    from gspo_megatron.backends.megatron.kernels import local as lk
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    model, groups, fast, _ = setup
    attns = [m for m in fast.unwrapped().modules() if isinstance(m, lk.RopeOnceSelfAttention)]
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, model.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 11, (10,), generator=gen).tolist()]
    engine = RolloutEngine(fast.model, groups, eos_id=model.vocab_size - 1, pad_id=0,
                           vocab_size=model.vocab_size,
                           config=RolloutConfig(max_new_tokens=9, temperature=1.0,
                                                max_batch_size=4, engine="dynamic",
                                                decode_steps_per_sync=0),
                           max_sequence_length=MODEL["seq_length"])
    context_class = type(engine.dynamic.context)
    ours = context_class.append_key_value_cache
    out, calls = {}, []
    for lean in (True, False):
        for a in attns:
            real = a._paged_forward
            a._paged_forward = lambda *x, real=real: calls.append(1) or real(*x)
            a.__dict__["_lean"] = lean
        if not lean:
            context_class.append_key_value_cache = context_class.__mro__[1].append_key_value_cache
        try:
            out[lean] = [(s.response_ids, s.response_logprobs)
                         for s in engine.generate(prompts, seed=3)]
        finally:
            context_class.append_key_value_cache = ours
            for a in attns:
                del a._paged_forward
                a.__dict__["_lean"] = True
        if lean:
            assert calls and engine.dynamic.steps > 9  # waves of admissions: mixed steps
            calls.clear()
        else:
            assert not calls
    assert out[True] == out[False]
    assert sum(len(ids) for ids, _ in out[True]) > 20


def test_training_short_paths_are_bitwise_megatrons(setup):
    """A whole SFT minibatch (forward, loss, backward through DDP) with the direct MoE layer, the
    grouped experts and the lean attention gives bitwise the loss and every ``main_grad`` of the
    same model through Megatron's dispatcher, the per-expert loop and ``Attention.forward``; the
    no-grad log-prob pass too."""
    from gspo_megatron.backends.megatron.kernels.local import RopeOnceSelfAttention
    from gspo_megatron.backends.megatron.kernels.moe import DirectMoELayer, LoopedSequentialMLP
    from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
    from tests.helpers.megatron import train_sft_minibatch

    model, groups, fast, _ = setup
    scoring = ScoringConfig(vocab_size=model.vocab_size)
    batch = _batch(model.vocab_size, seed=8)
    modules = list(fast.unwrapped().modules())
    switches = [(m, "_direct") for m in modules if isinstance(m, DirectMoELayer)]
    switches += [(m, "_grouped_training") for m in modules if isinstance(m, LoopedSequentialMLP)]
    switches += [(m, "_lean") for m in modules if isinstance(m, RopeOnceSelfAttention)]
    assert len(switches) == 2 + 2 + 3
    out = {}
    for short in (True, False):
        for m, attr in switches:
            m.__dict__[attr] = short
        try:
            lp, _ = compute_logprobs(fast.model, batch, 3, scoring, groups)
            fast.zero_grad()
            loss = train_sft_minibatch(fast.model, batch, 3, scoring, groups)["loss/sft_nll"]
        finally:
            for m, attr in switches:
                m.__dict__[attr] = True
        out[short] = (loss, _main_grads(fast), lp)
    assert out[True][0] == out[False][0] and torch.equal(out[True][2], out[False][2])
    assert all(torch.equal(out[True][1][n], out[False][1][n]) for n in out[True][1])


# ---------------------------------------------------------------- bf16 (rollout.precision=bf16)
def _cast(value, dtype):
    """Floating tensors in (nested) args to ``dtype``; everything else as is."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _first_tensor(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@pytest.mark.parametrize("case", ["causal", "decode", "chunk"])
def test_sdpa_attention_bf16_matches_float64(setup, case):
    """SDPA on CPU in bf16 (softmax accumulated in fp32 by the kernel): within bf16 tolerance of
    the float64 reference on the same (bf16-representable) inputs."""
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.backends.megatron.kernels.local import SDPADotProductAttention

    config = setup[2].transformer_config
    attn = SDPADotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self").eval()
    gen = torch.Generator().manual_seed(7)
    sq, sk = {"causal": (9, 9), "decode": (1, 13), "chunk": (4, 11)}[case]
    b, np_, ng, hn = 3, config.num_attention_heads, config.num_query_groups, config.kv_channels
    q = torch.randn(sq, b, np_, hn, generator=gen).bfloat16()
    k, v = (torch.randn(sk, b, ng, hn, generator=gen).bfloat16() for _ in range(2))
    keep = (torch.ones(sq, sk, dtype=torch.bool) if case == "decode"
            else torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq))
    out = attn(q, k, v, None)
    assert out.dtype == torch.bfloat16
    ref = _reference_attention(q, k, v, attn.softmax_scale, keep)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_each_kernel_bf16_forward_matches_its_fp32_forward(setup):
    """Every local-kernel module of a bf16 copy of the model (``rollout.precision=bf16``), fed the
    inputs it saw in a bf16 forward, agrees with the same fp32 module fed those inputs upcast:
    the kernel's own bf16 error only (a few bf16 steps relative to the output's scale)."""
    from gspo_megatron.backends.megatron.engine.rollout import SamplingCopy
    from gspo_megatron.backends.megatron.kernels import local as lk
    from gspo_megatron.backends.megatron.kernels.moe import LoopedSequentialMLP

    model, _, fast, _ = setup
    live = fast.unwrapped()
    bf16 = SamplingCopy(live, torch.bfloat16)
    kinds = (lk.SDPADotProductAttention, lk.DirectColumnParallelLinear, lk.DirectRowParallelLinear,
             LoopedSequentialMLP, lk.RopeOnceSelfAttention)
    seen, handles = {}, []

    def keep(name):
        def hook(module, args, kwargs, output):
            if name not in seen:  # first call; clones: later ops may write in place
                seen[name] = _clone((args, kwargs, output))
            # returns None: the output is not rewritten
        return hook

    for name, module in bf16.model.named_modules():
        if isinstance(module, kinds):
            handles.append(module.register_forward_hook(keep(name), with_kwargs=True))
    tokens = torch.randint(1, model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            bf16.module(tokens, torch.arange(20)[None].expand(2, -1), attention_mask=None)
    finally:
        for h in handles:
            h.remove()
    fp32_modules = dict(live.named_modules())
    assert {type(fp32_modules[n]) for n in seen} == set(kinds)
    live.eval()
    try:
        with torch.no_grad():
            for name, (args, kwargs, out_bf16) in seen.items():
                out_bf16 = _first_tensor(out_bf16)
                assert out_bf16.dtype == torch.bfloat16, name
                out_fp32 = _first_tensor(fp32_modules[name](*_cast(args, torch.float32),
                                                            **_cast(kwargs, torch.float32)))
                scale = float(out_fp32.abs().max())
                err = float((out_bf16.float() - out_fp32).abs().max())
                assert err <= 2e-2 * scale, (name, err, scale)  # measured <= 6e-3 * scale
    finally:
        live.train()


def test_bf16_rollouts_match_megatron_modules(setup):
    """bf16 rollouts (KV-cache decoding, keys rotated once) with the local kernels and with
    Megatron's own modules: same weights, log-probs of the same tokens within bf16 tolerance."""
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    model, groups, fast, ref = setup
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, model.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 9, (5,), generator=gen)]
    engines = {name: RolloutEngine(pol.model, groups, eos_id=model.vocab_size - 1, pad_id=0,
                                   vocab_size=model.vocab_size,
                                   config=RolloutConfig(max_new_tokens=12, max_batch_size=8,
                                                        precision="bf16"),
                                   max_sequence_length=MODEL["seq_length"])
               for name, pol in (("fast", fast), ("ref", ref))}
    samples = engines["fast"].generate(prompts, seed=0)
    # Score the fast engine's tokens with a full bf16 forward of both copies (no KV cache).
    for s in samples:
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        pos = torch.arange(seq.shape[1])[None]
        with torch.no_grad():
            lf, lr = (engines[n].copy.module.eval()(seq, pos, attention_mask=None)
                      for n in ("fast", "ref"))
        assert lf.dtype == lr.dtype == torch.float32
        torch.testing.assert_close(lf.log_softmax(-1), lr.log_softmax(-1), rtol=0, atol=0.1)


@pytest.mark.parametrize("tokens, experts, k", [(1, 4, 2), (37, 8, 2), (128, 16, 4)])
def test_permute_without_host_reads_is_megatrons_permute(tokens, experts, k):
    """The sort-based permute equals Megatron's ``masked_select`` one on random top-k maps:
    tokens, probs and indices bitwise, and the probs' and tokens' gradients; and it reads nothing
    back to the host (counted as tools/bench/host_syncs.py counts)."""
    from megatron.core.transformer.moe.moe_utils import permute

    from gspo_megatron.backends.megatron.kernels.moe import permute_without_host_reads
    from tools.bench.host_syncs import HostSyncCounter

    g = torch.Generator().manual_seed(tokens * experts + k)
    scores = torch.rand(tokens, experts, generator=g, dtype=torch.float64)
    top = scores.topk(k, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = (scores * routing_map).requires_grad_()
    x = torch.randn(tokens, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ref = permute(x, routing_map, probs=probs, num_out_tokens=tokens * k)
    with HostSyncCounter() as syncs:
        ours = permute_without_host_reads(x, routing_map, probs, tokens * k)
    assert syncs.total == 0, syncs.sites
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
    w = torch.randn(tokens * k, 6, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((out[0] * w).sum() + (out[1] * w[:, 0]).sum(), (x, probs))
             for out in (ref, ours)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
