"""gspo_megatron.compat.local_kernels: the faster local-spec modules against float64 references and
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
    from gspo_megatron.compat import local_kernels as lk

    _, _, fast, ref = setup
    kinds = {type(m) for m in fast.unwrapped().modules()}
    assert {lk.RopeOnceSelfAttention, lk.SDPADotProductAttention, lk.DirectColumnParallelLinear,
            lk.DirectRowParallelLinear, lk.LoopedSequentialMLP} <= kinds
    assert not any(type(m).__module__ == lk.__name__ for m in ref.unwrapped().modules())
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

    from gspo_megatron.compat.local_kernels import SDPADotProductAttention

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
    from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs, train_sft_minibatch

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


def test_greedy_generation_matches_megatron_modules(setup):
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.backends.megatron.rollout import RolloutEngine

    model, groups, fast, ref = setup
    gen = torch.Generator().manual_seed(5)
    # Prompts of different lengths: the static engine prefills the shortest, then decodes one
    # position at a time (forcing the longer prompts' tokens), so both attention paths run.
    prompts = [torch.randint(1, model.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 9, (5,), generator=gen)]
    out = {}
    for name, pol in (("fast", fast), ("ref", ref)):
        engine = RolloutEngine(pol.model, groups, eos_id=model.vocab_size - 1, pad_id=0,
                               vocab_size=model.vocab_size,
                               config=RolloutConfig(max_new_tokens=12, top_k=1, max_batch_size=8),
                               max_sequence_length=MODEL["seq_length"])
        out[name] = engine.generate(prompts, seed=0)
    for a, b in zip(out["fast"], out["ref"]):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs),
                                   rtol=1e-4, atol=1e-5)
