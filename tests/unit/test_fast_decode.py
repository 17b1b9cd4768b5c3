"""The multi-step decoding path (``rollout.decode_steps_per_sync``: :mod:`..engine.rounds` over
:func:`..kernels.decode.decode_forward`) against Megatron's forward at every step (0):

* greedy tokens identical and log-probs equal (1e-5), with EOS ending requests mid-round, with
  more prompts than request slots (new prompts join at round boundaries), with KV blocks crossed
  inside a round, and under YaRN;
* R3: the routes recorded per request equal the per-step path's;
* at most one host synchronisation per decoding step over a 64-token rollout of 128 requests
  (issue 48: ~9 per step before), counted by :class:`tools.bench.host_syncs.HostSyncCounter`;
* the step compiles with ``torch.compile(fullgraph=True)`` (no graph break: nothing a CUDA graph
  could not hold), and the compiled step gives the eager step's logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.unit.test_rollout import EOS, PAD, VOCAB, make_prompts, setup  # noqa: F401

pytestmark = pytest.mark.slow  # builds Megatron models


def engines(setup, steps=16, record_routes=True, **cfg):  # noqa: F811
    """The same model decoding through Megatron's per-step loop (0) and through rounds."""
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    policy, groups = setup
    base = {"max_new_tokens": 12, "max_batch_size": 16, "top_k": 1, **cfg}
    return [RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                          config=RolloutConfig(**base, decode_steps_per_sync=k),
                          max_sequence_length=640, record_routes=record_routes)
            for k in (0, steps)]


def assert_same(a, b):
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    for x, y in zip(a, b):
        assert x.response_logprobs == pytest.approx(y.response_logprobs, abs=1e-5)


@pytest.mark.parametrize("cfg", [
    {},  # EOS inside rounds
    {"max_batch_size": 5},  # 24 prompts through 5 slots: rounds end to let prompts in
    {"ignore_eos": True, "max_new_tokens": 300},  # crosses a 256-token KV block inside a round
    {"long_prompts": True},  # 4 of 24 prompts of 150 tokens: keys read in length groups
    # the KV buffer allocated full of NaN (torch.empty's worst case), slots reused: every slot a
    # round reads past a request's keys is made finite first, once
    {"max_batch_size": 5, "nan_buffer": True},
], ids=["eos", "slots5", "block_crossing", "length_groups", "nan_buffer"])
def test_rounds_give_the_per_step_tokens_and_logprobs(setup, cfg):  # noqa: F811
    cfg = dict(cfg)
    long_prompts = cfg.pop("long_prompts", False)
    nan_buffer = cfg.pop("nan_buffer", False)
    per_step, rounds = engines(setup, **cfg)
    assert per_step.dynamic.fast is None and rounds.dynamic.fast is not None
    if nan_buffer:
        fast = rounds.dynamic.fast
        zero_scratch = fast.buffer_allocated

        def allocated_as_nan():
            fast.context.memory_buffer.fill_(float("nan"))
            zero_scratch()
        fast.buffer_allocated = allocated_as_nan
    prompts = make_prompts(24, seed=3)
    if long_prompts:
        from gspo_megatron.backends.megatron.engine.rounds import _length_groups

        prompts[::6] = [p * 40 for p in prompts[::6]][:4]
        prompts = [p[:150] for p in prompts]
        assert len(_length_groups([len(p) for p in prompts], 12)) > 1
    a, b = per_step.generate(prompts, seed=0), rounds.generate(prompts, seed=0)
    assert_same(a, b)
    assert {s.finish_reason for s in a} == ({"length"} if cfg.get("ignore_eos") else
                                             {"eos", "length"})
    # R3: every forwarded position's route, equal
    for x, y in zip(a, b):
        assert torch.equal(x.extra["routes"], y.extra["routes"])
    # the KV blocks all went back (nothing leaked by the rounds' write-back)
    alloc = rounds.dynamic.context.block_allocator
    assert alloc.total_avail == alloc.total_count - 1


def test_rounds_take_sdpa_output_in_the_fused_kernels_layout(setup, monkeypatch):  # noqa: F811
    """CUDA's fused SDPA kernels return ``[B, H, L, D]`` laid out as ``[B, L, H, D]`` (heads
    innermost), CPU's math kernel contiguously: the step regroups the folded heads by reshape (a
    view failed on the H200 on 2026-11-27), giving the per-step loop's tokens and log-probs."""
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def fused_layout(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out.shape)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    per_step, rounds = engines(setup)
    prompts = make_prompts(12, seed=4)
    a = per_step.generate(prompts, seed=0)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fused_layout)
    assert_same(a, rounds.generate(prompts, seed=0))
    assert calls and all(shape[1] > 1 for shape in calls)  # key/value groups > 1: regrouped


def test_rounds_sample_from_the_same_distribution(setup):  # noqa: F811
    """Sampled (T = 1): every token is a valid id with its log-prob under the model; the
    rounds' draws differ from the per-step loop's only once a request has ended (a round keeps
    drawing for it, masked): the first token of every request is the same draw."""
    per_step, rounds = engines(setup, top_k=0, temperature=1.0)
    prompts = make_prompts(16, seed=5)
    a, b = per_step.generate(prompts, seed=7), rounds.generate(prompts, seed=7)
    assert [s.response_ids[0] for s in a] == [s.response_ids[0] for s in b]
    assert [s.response_logprobs[0] for s in a] == pytest.approx(
        [s.response_logprobs[0] for s in b], abs=1e-5)


def test_at_most_one_host_sync_per_decoding_step(setup):  # noqa: F811
    from tools.bench.host_syncs import HostSyncCounter

    _, rounds = engines(setup, record_routes=False, ignore_eos=True, max_new_tokens=64,
                        max_batch_size=128)
    prompts = make_prompts(128, seed=1)
    rounds.generate(prompts, seed=0)  # warm-up (first-call set-up is not a step)
    with HostSyncCounter() as c:
        out = rounds.generate(prompts, seed=0)
    steps = rounds.dynamic.steps
    assert all(len(s.response_ids) == 64 for s in out) and steps == 64
    per_step = c.total / steps
    print(f"MEASURED host syncs per decoding step: {per_step:.2f} ({c.total} over {steps})")
    assert per_step <= 1.0, c.sites.most_common(8)


def test_the_step_compiles_fullgraph_and_matches_eager(setup):  # noqa: F811
    from gspo_megatron.backends.megatron.kernels.decode import (DecodeBatch, DecodeWeights,
                                                                KeyGroup, decode_forward)
    from gspo_megatron.backends.megatron.kernels.rotary import cos_sin

    policy, _ = setup
    model = policy.unwrapped()
    w = DecodeWeights.of(model)
    B, Lk, bs, blocks = 3, 20, 16, 8
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, len(w.layers), blocks, bs, w.groups, w.head_dim, generator=g)
    table = torch.randperm(blocks, generator=g)[:B * 2].view(B, 2)
    j = torch.arange(Lk)
    key_rows = table[:, j // bs] * bs + j % bs
    pos = torch.tensor([4, 19, 11])
    pair = cos_sin(model.rotary_pos_emb(64), 1.0, torch.float32)
    batch = DecodeBatch(torch.tensor([3, 5, 7]), pos, key_rows.gather(1, pos[:, None])[:, 0],
                        pair.cos, pair.sin, [KeyGroup(None, key_rows, j[None, :] <= pos[:, None], j)])
    with torch.no_grad():
        eager_kv = kv.clone()
        eager, eager_routes = decode_forward(w, eager_kv, batch, True)
        with torch.compiler.set_stance("default"):  # (the CPU compat runs compile eagerly)
            torch._dynamo.reset()
            compiled = torch.compile(decode_forward, fullgraph=True, backend="aot_eager")
            got, routes = compiled(w, kv, batch, True)
    assert torch.allclose(got, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(routes, eager_routes)
    assert torch.allclose(kv, eager_kv, atol=1e-6)  # the same keys and values written


def test_graph_buckets_pad_rows_and_keys_without_changing_the_step(setup):  # noqa: F811
    """:class:`GraphedDecode`'s buckets (rows to a power of two, the key window to whole blocks,
    padded rows on the scratch slot) give the plain step's logits, routes and KV writes; on CPU
    its "replay" runs the bucket eagerly, the padding logic the GPU's graphs replay."""
    from gspo_megatron.backends.megatron.kernels.decode import (DecodeBatch, DecodeWeights,
                                                                KeyGroup, decode_forward)
    from gspo_megatron.backends.megatron.kernels.graphs import GraphedDecode
    from gspo_megatron.backends.megatron.kernels.rotary import cos_sin

    policy, _ = setup
    model = policy.unwrapped()
    w = DecodeWeights.of(model)
    bs, blocks = 16, 12
    scratch = (blocks - 1) * bs  # the last block: no request's
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, len(w.layers), blocks, bs, w.groups, w.head_dim, generator=g)
    kv[:, :, blocks - 1] = 0
    graphed = GraphedDecode(scratch, bs)
    pair = cos_sin(model.rotary_pos_emb(64), 1.0, torch.float32)
    for B, Lk in ((3, 20), (5, 17), (3, 30)):  # buckets (4, 32), (8, 32), (4, 32) again
        table = torch.randperm(blocks - 1, generator=g)[:B * 2].view(B, 2)
        j = torch.arange(Lk)
        key_rows = table[:, j // bs] * bs + j % bs
        pos = torch.randint(0, Lk, (B,), generator=g)
        batch = DecodeBatch(torch.randint(3, 12, (B,), generator=g), pos,
                            key_rows.gather(1, pos[:, None])[:, 0], pair.cos, pair.sin,
                            [KeyGroup(None, key_rows, j[None, :] <= pos[:, None], j)])
        with torch.no_grad():
            ref_kv = kv.clone()
            ref, ref_routes = decode_forward(w, ref_kv, batch, True)
            got, routes = graphed(w, kv, batch, True)
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(routes, ref_routes)
        kv[:, :, blocks - 1] = ref_kv[:, :, blocks - 1]  # (only the scratch block may differ)
        assert torch.allclose(kv, ref_kv, atol=1e-6)  # (a padded GEMM may round otherwise)
    assert graphed.captures == 2  # (4, 32) met twice, captured once


def test_rounds_with_a_dense_layer_and_yarn(setup):  # noqa: F811
    """A dense (non-MoE) first layer (``moe_layer_freq: [0, 1]``, Qwen3's ``mlp_only_layers``)
    and YaRN rope scaling (the step's rotary table carries YaRN's scale): greedy tokens and
    log-probs as Megatron's forward at every step."""
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig, RolloutConfig
    from gspo_megatron.config.model import (ParallelConfig, PrecisionConfig,
                                            model_config_from_preset)

    _, groups = setup
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, seq_length=64, moe_layer_freq=[0, 1],
                                   position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                                   yarn_original_max_position_embeddings=16)
    torch.manual_seed(3)
    policy = build_policy(cfg, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    with torch.no_grad():
        policy.unwrapped().output_layer.weight.mul_(30.0)
    out = []
    for k in (0, 16):
        eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                            config=RolloutConfig(max_new_tokens=40, max_batch_size=8, top_k=1,
                                                 ignore_eos=True, decode_steps_per_sync=k))
        out.append(eng.generate(make_prompts(8, seed=11), seed=0))
    assert_same(*out)
    assert all(len(s.response_ids) == 40 for s in out[0])  # past YaRN's original window


def test_round_length_weighs_rows_past_their_end_against_a_rounds_cost():
    """:func:`round_length`: half the steps before any end was seen, all of them when none
    ended, ``sqrt(2 R / (rows p))`` between a quarter and all of them otherwise: shorter rounds
    while many requests end at once, longer ones as the batch thins out."""
    from gspo_megatron.backends.megatron.engine.rounds import ROUND_COST_ROWS, round_length

    assert round_length(16, 128, None) == 8 and round_length(1, 128, None) == 1
    assert round_length(16, 128, 0.0) == 16
    p = 1 / 24  # the long-tail benchmark's end rate
    lengths = [round_length(16, rows, p) for rows in (128, 64, 32, 16, 8, 4, 1)]
    assert lengths == sorted(lengths) and lengths[0] == 5 and lengths[-1] == 16
    rows = 40
    assert round_length(16, rows, p) == round((2 * ROUND_COST_ROWS / (rows * p)) ** 0.5)
    assert round_length(16, 128, 1.0) == 4  # never below a quarter
    # rollout.decode_round_cost_rows: a GPU's round costs many masked rows -> longer rounds
    assert round_length(16, 128, p, cost_rows=4096) == 16
    assert round_length(16, 40, p, cost_rows=16) == round((2 * 16 / (40 * p)) ** 0.5)


def test_rounds_follow_how_fast_requests_end(setup, monkeypatch):  # noqa: F811
    """A batch whose requests never end (``ignore_eos``) takes whole rounds of
    ``decode_steps_per_sync`` from the first; one whose requests end as they go takes the
    lengths :func:`round_length` gives for the end rate the steps before saw (the first round:
    the prefill's, the requests whose first token ended them)."""
    from gspo_megatron.backends.megatron.engine import rounds as R

    seen = []
    real_run = R.FastDecoder.run

    def run(self, call, plan, steps, *a, **k):
        seen.append((plan.n, plan.steps, self._finish_rate))
        return real_run(self, call, plan, steps, *a, **k)

    monkeypatch.setattr(R.FastDecoder, "run", run)
    _, uniform = engines(setup, record_routes=False, ignore_eos=True, max_new_tokens=40)
    uniform.generate(make_prompts(16, seed=1), seed=0)
    # 1 token from the prefill (none ended: rate 0), then 16 + 16 + 7
    assert [(s, rate) for _, s, rate in seen] == [(16, 0.0), (16, 0.0), (7, 0.0)]
    seen.clear()
    _, ending = engines(setup, record_routes=False, max_new_tokens=200, top_k=0, temperature=1.0)
    ending.generate(make_prompts(16, seed=2), seed=0)
    assert len(seen) > 2 and all(rate is not None for _, _, rate in seen)
    for n, steps, rate in seen:
        assert steps == min(R.round_length(16, n, rate), steps)
    assert any(steps < 16 for _, steps, _ in seen) and any(rate > 0 for _, _, rate in seen)
