"""RolloutEngine (Megatron-Core's static inference engine on CPU), single process.

The model is the tiny MoE with a *real* vocabulary of 12 ids inside the padded 128: if the engine
let padded ids through, almost every sampled token would be >= 12. The output layer is sharpened so
that greedy decoding is not a coin flip and EOS (id 2) is common enough to see both endings.
"""

from __future__ import annotations

import os

import pytest
import torch

from gspo_megatron.config import RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine, RolloutSample
from gspo_megatron.policy import make_policy_batch
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
from tests.helpers.megatron import generate_groups

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)

VOCAB, EOS, PAD = 12, 2, 0
# The engine's reported log-probs vs the trainer's forward on the same tokens (fp32, CPU): 10x the
# worst difference measured at 3b7e318 (3.8e-6, t0.7; MEASURED lines under -s).
LOGPROB_TOL = 4e-5
os.environ.setdefault("TQDM_DISABLE", "1")


@pytest.fixture(scope="module")
def setup():
    from gspo_megatron.backends.megatron.parallel import initialize_distributed
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.backends.megatron.policy import build_policy

    model_cfg = model_config_from_preset("tiny", vocab_size=VOCAB, seq_length=32)
    parallel = ParallelConfig()
    groups = initialize_distributed(parallel, model_cfg, seed=4321)
    policy = build_policy(model_cfg, parallel, PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    with torch.no_grad():
        policy.unwrapped().output_layer.weight.mul_(30.0)
    return policy, groups


def make_prompts(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def assert_valid_samples(prompts, samples, max_new_tokens=8):
    """Each sample answers its prompt with 1..max_new_tokens real-vocabulary ids, one log-prob
    each, ending at its first EOS or at the length limit."""
    for p, s in zip(prompts, samples, strict=True):
        assert isinstance(s, RolloutSample) and s.prompt_ids == p
        assert 1 <= len(s.response_ids) <= max_new_tokens
        assert len(s.response_logprobs) == len(s.response_ids)
        assert all(0 <= t < VOCAB for t in s.response_ids), s.response_ids
        assert all(lp <= 0.0 for lp in s.response_logprobs)
        if s.finish_reason == "eos":
            assert s.response_ids[-1] == EOS and EOS not in s.response_ids[:-1]
        else:
            assert len(s.response_ids) == max_new_tokens and EOS not in s.response_ids


def engine(setup, **cfg):
    policy, groups = setup
    cfg = {"max_new_tokens": 8, "max_batch_size": 16, **cfg}
    return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                         config=RolloutConfig(**cfg))


def trainer_logprobs(setup, samples, temperature):
    policy, groups = setup
    batch = make_policy_batch([s.prompt_ids + s.response_ids for s in samples],
                              [len(s.prompt_ids) for s in samples], pad_id=PAD)
    lp, _ = compute_logprobs(policy.model, batch, 64,
                             ScoringConfig(temperature=temperature, vocab_size=VOCAB), groups)
    return [lp[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.response_ids)]
            for i, s in enumerate(samples)]


def test_lengths_finish_reasons_and_vocab(setup):
    prompts = make_prompts()
    samples = engine(setup, temperature=1.0).generate(prompts, seed=1)
    assert len(samples) == len(prompts)
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"eos", "length"}, reasons  # the setup must exercise both
    assert_valid_samples(prompts, samples)


def test_ignore_eos_samples_the_full_budget(setup):
    """rollout.ignore_eos (vLLM's): every response is max_new_tokens long, EOS an ordinary token;
    the same seed without it gives the same tokens until the first response of the batch ends
    (after that the dynamic engine samples a smaller batch, one draw fewer per step, and a
    waiting prompt takes the freed slot: its tokens come from other draws), and the log-probs
    are still the trainer's."""
    prompts = make_prompts()
    full = engine(setup, temperature=1.0, ignore_eos=True).generate(prompts, seed=1)
    assert all(len(s.response_ids) == 8 and s.finish_reason == "length" for s in full)
    assert any(EOS in s.response_ids[:-1] for s in full)  # sampled, and it did not stop the response
    plain = engine(setup, temperature=1.0).generate(prompts, seed=1)
    first_end = min(len(b.response_ids) for b in plain)
    assert first_end < 8  # some response did end early without ignore_eos
    slots = 16  # max_batch_size: the prompts that start at once
    for a, b in zip(full[:slots], plain[:slots], strict=True):
        assert a.response_ids[:first_end] == b.response_ids[:first_end]
        # the same up to float rounding: the dynamic engine's packed batch shrinks as responses
        # end, so the two runs forward different batch shapes (measured <= 1.2e-6)
        assert a.response_logprobs[:first_end] == pytest.approx(b.response_logprobs[:first_end],
                                                                abs=1e-5)
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(full, trainer_logprobs(setup, full, 1.0)))
    assert worst <= LOGPROB_TOL


def test_seed_determinism_and_model_state(setup):
    policy, _ = setup
    gpt = policy.unwrapped()
    gpt.train()
    eng = engine(setup, temperature=1.0)
    # building the engine leaves training alone too (Megatron's prep for inference sets eval
    # mode: an update in eval mode has no MoE load-balancing loss)
    assert gpt.training, "train mode must survive building the engine"
    prompts = make_prompts()
    rng_before = torch.get_rng_state()
    a = eng.generate(prompts, seed=7)
    assert gpt.training, "train mode must be restored"
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG must be left alone"
    b = eng.generate(prompts, seed=7)
    c = eng.generate(prompts, seed=8)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_logprobs for s in a] == [s.response_logprobs for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]
    # Repeated prompts (a group) draw different samples within one call.
    group = generate_groups(eng, [prompts[0]], seed=7, group_size=6)[0]
    assert len(group) == 6 and len({tuple(s.response_ids) for s in group}) > 1


@pytest.mark.parametrize("cfg", [dict(temperature=0.7), dict(temperature=1.3, top_k=4),
                                 dict(temperature=0.8, top_p=0.9)],
                         ids=["t0.7", "t1.3_topk4", "t0.8_topp0.9"])
def test_logprobs_match_trainer(setup, cfg):
    samples = engine(setup, **cfg).generate(make_prompts(), seed=3)
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(samples, trainer_logprobs(setup, samples, cfg["temperature"])))
    print(f"MEASURED rollout vs trainer log-prob {cfg}: {worst:.3g}")
    assert worst <= LOGPROB_TOL


def test_greedy_equals_manual_argmax(setup):
    policy, _ = setup
    prompts = make_prompts(12, seed=5)
    samples = engine(setup, temperature=0.5, top_k=1).generate(prompts, seed=0)  # greedy: T moot
    topk1 = engine(setup, temperature=1.0, top_k=1).generate(prompts, seed=99)
    assert [s.response_ids for s in samples] == [s.response_ids for s in topk1]
    gpt = policy.unwrapped()
    gpt.eval()
    with torch.no_grad():
        for p, s in zip(prompts, samples):
            seq = list(p)
            for _ in range(8):  # full-sequence forward, no KV cache
                tokens = torch.tensor([seq])
                logits = gpt(tokens, torch.arange(len(seq))[None], attention_mask=None)
                seq.append(int(logits[0, -1, :VOCAB].argmax()))
                if seq[-1] == EOS:
                    break
            assert s.response_ids == seq[len(p):], (p, s.response_ids, seq[len(p):])
    gpt.train()
    assert {s.finish_reason for s in samples} == {"eos", "length"}
    # greedy (top_k=1) reports log-probs at the engine's temperature, like sampling does
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(samples, trainer_logprobs(setup, samples, 0.5)))
    print(f"MEASURED greedy rollout vs trainer log-prob: {worst:.3g}")
    assert worst <= LOGPROB_TOL


def test_mixed_prompt_lengths_are_left_padded_and_prefilled_at_once(setup):
    """Prompts of 2-6 tokens in one static batch are left-padded to the longest and prefilled
    together: max_new_tokens forward steps (Megatron's ragged batch would take max_new_tokens +
    longest - shortest, feeding the longer prompts' tails one step at a time). Each sample is
    what its prompt gets alone (no padding there): the same greedy tokens, log-probs within
    LOGPROB_TOL, and the trainer's log-probs of the padded batch's samples within LOGPROB_TOL.
    (The static engine's path: the dynamic engine packs prompts without padding.)"""
    prompts = make_prompts(12, seed=5)
    assert min(map(len, prompts)) == 2 and max(map(len, prompts)) == 6
    eng = engine(setup, top_k=1, ignore_eos=True, engine="static")
    eng.wrapper.forward_calls = 0
    batch = eng.generate(prompts, seed=0)
    assert eng.wrapper.forward_calls == 8
    assert eng.wrapper.left_padding is None  # reset after the call
    for p, s in zip(prompts, batch, strict=True):
        alone = eng.generate([p], seed=0)[0]
        assert s.prompt_ids == p and s.response_ids == alone.response_ids
        torch.testing.assert_close(torch.tensor(s.response_logprobs),
                                   torch.tensor(alone.response_logprobs),
                                   rtol=0, atol=LOGPROB_TOL)
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(batch, trainer_logprobs(setup, batch, 1.0)))
    assert worst <= LOGPROB_TOL


def test_with_sampling_shares_the_engine_and_samples_as_a_fresh_one(setup):
    """The greedy evaluator is a view of the rollout engine (one KV cache, one Megatron engine: the
    dynamic engine's cache is gigabytes on a GPU), and samples exactly as an engine built with its
    config; the original keeps its own sampling."""
    prompts = make_prompts(10, seed=7)
    sampler = engine(setup, temperature=1.0)
    greedy = sampler.with_sampling(RolloutConfig(max_new_tokens=8, max_batch_size=16, top_k=1))
    assert greedy.dynamic is sampler.dynamic and greedy.controller is sampler.controller
    fresh = engine(setup, top_k=1).generate(prompts, seed=3)
    assert [s.response_ids for s in greedy.generate(prompts, seed=3)] == \
        [s.response_ids for s in fresh]
    again = engine(setup, temperature=1.0).generate(prompts, seed=11)
    assert [s.response_ids for s in sampler.generate(prompts, seed=11)] == \
        [s.response_ids for s in again]
    with pytest.raises(ValueError, match="max_batch_size"):
        sampler.with_sampling(RolloutConfig(max_batch_size=8))


def test_uses_live_weights_and_masks_padded_vocab(setup):
    """Zero the final norm: every logit is 0, so the engine's distribution is uniform over the
    *real* vocabulary (log-prob -log 12, not -log 128) -- seen without rebuilding the engine."""
    policy, _ = setup
    eng = engine(setup, temperature=0.5)
    norm = policy.unwrapped().decoder.final_layernorm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.zero_()
        samples = eng.generate(make_prompts(), seed=2)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    lps = torch.tensor([lp for s in samples for lp in s.response_logprobs])
    torch.testing.assert_close(lps, torch.full_like(lps, -torch.log(torch.tensor(12.0)).item()))
    seen = {t for s in samples for t in s.response_ids}
    assert seen <= set(range(VOCAB)) and len(seen) > VOCAB // 2


def test_config_validation(setup):
    with pytest.raises(ValueError, match="top_k and rollout.top_p"):
        engine(setup, top_k=5, top_p=0.9)
    eng = engine(setup, max_new_tokens=30)
    with pytest.raises(ValueError, match="max sequence length"):
        eng.generate([[3, 4, 5]], seed=0)
    with pytest.raises(ValueError, match="outside"):
        engine(setup).generate([[3, VOCAB]], seed=0)


def test_training_forward_backward_after_generation(setup):
    """Nothing the inference path caches (KV cache, RoPE tables) leaks inference-mode tensors into
    a later training step."""
    policy, _ = setup
    samples = engine(setup).generate(make_prompts(4), seed=0)
    gpt = policy.unwrapped()
    gpt.train()
    tokens = torch.tensor([(s.prompt_ids + s.response_ids + [PAD] * 16)[:8] for s in samples])
    out = gpt(tokens, torch.arange(8)[None].expand(len(samples), -1), attention_mask=None)
    out.float().logsumexp(-1).mean().backward()
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in gpt.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    for chunk in policy.model:
        chunk.zero_grad_buffer()


def test_dynamic_engine_matches_the_static_engine_greedy_with_routes(setup):
    """The default (dynamic) engine against Megatron's static engine on the same weights: greedy
    tokens and finish reasons identical, log-probs to fp32 rounding, and the R3 routes recorded
    from the packed buffer equal the static engine's window by window."""
    policy, groups = setup
    prompts = make_prompts(24)
    cfg = dict(max_new_tokens=8, max_batch_size=32, top_k=1)
    out = {}
    for kind in ("static", "dynamic"):
        eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                            config=RolloutConfig(engine=kind, **cfg), record_routes=True)
        assert eng.backend == kind
        out[kind] = eng.generate(prompts, seed=0)
    assert any(s.finish_reason == "eos" for s in out["dynamic"])  # the stop rule is exercised
    for a, b in zip(out["static"], out["dynamic"], strict=True):
        assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
        assert b.response_logprobs == pytest.approx(a.response_logprobs, abs=1e-5)
        assert torch.equal(a.extra["routes"], b.extra["routes"])


def test_a_decoding_step_forwards_the_running_requests_and_no_padding(setup):
    """With EOS the decoding batch shrinks as requests finish, and each step forwards exactly
    the running requests' tokens: Megatron pads a step to a multiple of 64 tokens for its
    CUDA-graph shapes, which this loop does not use (``RolloutContext.TOKEN_ROUNDER``). Its
    rounding rule is kept (any rounder, rounded up to a multiple of TP). (Megatron's forward at
    every step, ``decode_steps_per_sync: 0``: what is counted here is its forward.)"""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    policy, groups = setup
    eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                        config=RolloutConfig(max_new_tokens=8, max_batch_size=32,
                                             temperature=1.0, decode_steps_per_sync=0))
    seen = []  # (tokens forwarded, running requests) of every decoding step
    forward = eng.wrapper.run_one_forward_step

    def counted(*args, **kwargs):
        ctx = eng.dynamic.context
        if ctx.is_decode_only():
            seen.append((ctx.padded_active_token_count,
                         ctx.total_request_count - ctx.paused_request_count))
        return forward(*args, **kwargs)

    eng.wrapper.run_one_forward_step = counted
    samples = eng.generate(make_prompts(24, seed=5), seed=0)
    assert any(s.finish_reason == "eos" for s in samples)
    assert all(tokens == running for tokens, running in seen), seen
    assert len({running for _, running in seen}) > 1  # the batch shrank

    rollout_context = type(eng.dynamic.context)

    class Megatrons(DynamicInferenceContext):
        TOKEN_ROUNDER = 1

    for rounder in (1, 3, 64):
        rollout_context.TOKEN_ROUNDER = Megatrons.TOKEN_ROUNDER = rounder
        for tp in (1, 2, 8):
            assert [rollout_context.round_up_tokens(v, tp) for v in range(300)] == \
                [Megatrons.round_up_tokens(v, tp) for v in range(300)]
    rollout_context.TOKEN_ROUNDER = 1


def test_dynamic_engine_refills_slots_and_releases_its_kv_cache(setup):
    """More prompts than slots: a finished request hands its slot to a waiting prompt before the
    next forward (no forward runs with a free slot while prompts wait); the paged KV cache exists
    only during a generate. (Megatron's forward at every step, counted here; the multi-step
    rounds start only once nothing waits: ``tests/unit/test_fast_decode.py``.)"""
    policy, groups = setup
    prompts = make_prompts(24, seed=3)
    eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                        config=RolloutConfig(max_new_tokens=8, max_batch_size=6, temperature=1.0,
                                             decode_steps_per_sync=0))
    assert eng.dynamic.kv_bytes == 0  # built suspended
    seen = []  # (requests in the forward, prompts waiting) of every engine forward
    forward = eng.wrapper.run_one_forward_step

    def counted(*args, **kwargs):
        ctx = eng.dynamic.context
        seen.append((ctx.total_request_count - ctx.paused_request_count,
                     len(eng.dynamic.call.waiting)))
        return forward(*args, **kwargs)

    eng.wrapper.run_one_forward_step = counted
    samples = eng.generate(prompts, seed=0)
    assert eng.dynamic.kv_bytes == 0  # released again for the trainer
    assert_valid_samples(prompts, samples)
    lengths = [len(s.response_ids) for s in samples]
    assert min(lengths) < 8 == max(lengths)  # some end early, some run to the limit
    assert len(seen) == eng.dynamic.steps
    assert all(active == 6 for active, waiting in seen if waiting), seen
    assert sum(waiting > 0 for _, waiting in seen) > 10  # the refill ran many times
    eng.dynamic.resume()
    # the budget: 6 slots x 1 block of 256 tokens + the dummy block, K and V of 2 layers x 2 KV
    # heads x 16 channels in fp32
    assert eng.dynamic.kv_bytes == (6 + 1) * 256 * 2 * 2 * 2 * 16 * 4
    eng.dynamic.suspend()
    assert eng.dynamic.kv_bytes == 0


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_progress_is_told_the_responses_finished_as_they_finish(setup, kind):
    """``generate(progress=...)`` (evaluation's display): the static engine reports after each
    batch of ``max_batch_size``, the dynamic engine after each step that finishes requests; the
    count rises to the number of prompts, and the samples are those of a call without it."""
    policy, groups = setup
    prompts = make_prompts(24, seed=5)
    eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                        config=RolloutConfig(engine=kind, max_new_tokens=8, max_batch_size=8,
                                             temperature=1.0))
    counts = []
    samples = eng.generate(prompts, seed=0, progress=counts.append)
    if kind == "static":
        assert counts == [8, 16, 24]
    else:
        assert len(counts) > 3 and counts == sorted(set(counts)) and counts[-1] == 24, counts
    plain = eng.generate(prompts, seed=0)
    assert [s.response_ids for s in samples] == [s.response_ids for s in plain]


def test_a_partial_rollout_stops_at_its_groups_and_continues_where_it_stopped(setup):
    """``GroupStop`` (partial rollouts): the dynamic engine stops once ``need`` groups are
    complete and returns the rest ``aborted`` with the tokens and log-probs written so far;
    continuing each from its prompt + those tokens, with what is left of its budget, gives
    (greedy) the uninterrupted responses, and every log-prob is the trainer's."""
    from gspo_megatron.policy import GroupStop

    eng = engine(setup, temperature=0.7, top_k=1, max_new_tokens=12)
    prompts = make_prompts(12, seed=6)  # greedy: requests 2 and 3 end at once, the rest at 12
    whole = eng.generate(prompts, seed=0)
    stop = GroupStop([i // 2 for i in range(12)], need=1)  # 6 groups of 2
    first = eng.generate(prompts, seed=0, stop=stop)
    aborted = [i for i, s in enumerate(first) if s.finish_reason == "aborted"]
    assert stop.done and stop.complete == 1 and len(aborted) == 10
    assert eng.dynamic.steps < max(len(s.response_ids) for s in whole)  # it stopped early
    for i, s in enumerate(first):
        assert whole[i].response_ids[:len(s.response_ids)] == s.response_ids
        if s.finish_reason != "aborted":
            assert s.response_ids == whole[i].response_ids
    rest = eng.generate([prompts[i] + first[i].response_ids for i in aborted], seed=0,
                        budgets=[12 - len(first[i].response_ids) for i in aborted])
    for i, s in zip(aborted, rest):
        assert first[i].response_ids + s.response_ids == whole[i].response_ids
        assert s.finish_reason == whole[i].finish_reason
    joined = [RolloutSample(prompts[i], first[i].response_ids + s.response_ids,
                            first[i].response_logprobs + s.response_logprobs, s.finish_reason)
              for i, s in zip(aborted, rest)]
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(joined, trainer_logprobs(setup, joined, 0.7)))
    assert worst <= LOGPROB_TOL
    # the engine is left clean: the next full rollout is the same as before
    assert [s.response_ids for s in eng.generate(prompts, seed=0)] == \
        [s.response_ids for s in whole]
    with pytest.raises(NotImplementedError, match="dynamic engine"):
        engine(setup, engine="static").generate(prompts, seed=0, stop=GroupStop([0] * 12, 1))


def test_held_requests_continue_without_prefill_with_their_routes(setup):
    """``GroupStop.hold_cut`` / ``continue_ids`` (``rollout.partial_keep_kv``): the requests a
    stop cuts stay in the engine with their KV cache (the buffer stays allocated), each aborted
    sample naming its request; a call whose prompts are their prompts + written tokens and that
    names the requests they continue goes on with no prefill step, and gives
    (greedy, same weights) the uninterrupted responses, the trainer's log-probs and, under R3,
    the uninterrupted routes of every forwarded position. A call that does not continue them
    (evaluation) drops them and prefills as usual."""
    from gspo_megatron.policy import HELD_REQUEST_KEY, GroupStop

    policy, groups = setup
    eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                        config=RolloutConfig(temperature=0.7, top_k=1, max_new_tokens=12,
                                             max_batch_size=16), record_routes=True)
    prompts = make_prompts(12, seed=6)
    whole = eng.generate(prompts, seed=0)
    first = eng.generate(prompts, seed=0, stop=GroupStop([i // 2 for i in range(12)], need=1,
                                                         hold_cut=True))
    cut = [i for i, s in enumerate(first) if s.finish_reason == "aborted"]
    assert len(cut) == 10 and len(eng.dynamic.held_ids()) == 10
    assert {first[i].extra[HELD_REQUEST_KEY] for i in cut} == eng.dynamic.held_ids()
    assert eng.dynamic.kv_bytes > 0  # held: the cache stays
    written = {i: len(first[i].response_ids) for i in cut}
    stop = GroupStop([i // 2 for i in cut], need=5, hold_cut=True, continue_ids={
        k: first[i].extra[HELD_REQUEST_KEY] for k, i in enumerate(cut[::-1])})
    rest = eng.generate([prompts[i] + first[i].response_ids for i in cut][::-1], seed=0,
                        budgets=[12 - written[i] for i in cut][::-1], stop=stop)[::-1]
    # one token forwarded per token written (each the running request's newest): no prefill
    assert eng.dynamic.tokens_forwarded == sum(len(s.response_ids) for s in rest)
    assert not eng.dynamic.held_ids() and eng.dynamic.kv_bytes == 0
    joined = []
    for i, s in zip(cut, rest):
        assert first[i].response_ids + s.response_ids == whole[i].response_ids
        assert s.finish_reason == whole[i].finish_reason
        assert torch.equal(s.extra["routes"], whole[i].extra["routes"])
        joined.append(RolloutSample(prompts[i], whole[i].response_ids,
                                    first[i].response_logprobs + s.response_logprobs, "eos"))
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(joined, trainer_logprobs(setup, joined, 0.7)))
    assert worst <= LOGPROB_TOL
    # held again, then a call that does not continue them: dropped, prefilled as usual
    eng.generate(prompts, seed=0, stop=GroupStop([i // 2 for i in range(12)], need=1,
                                                 hold_cut=True))
    assert eng.dynamic.held_ids()
    again = eng.with_sampling(eng.config).generate(prompts, seed=0)
    assert not eng.dynamic.held_ids() and eng.dynamic.kv_bytes == 0
    assert [s.response_ids for s in again] == [s.response_ids for s in whole]


def test_a_partial_rollout_takes_requests_added_on_the_way(setup):
    """``GroupStop.refill`` (a partial rollout keeping a batch running): requests it returns
    join the running call and come back after the call's own, in the order added, each as it
    would have been sampled alone (greedy)."""
    from gspo_megatron.policy import GroupStop

    eng = engine(setup, temperature=0.7, top_k=1, max_new_tokens=12)
    prompts = make_prompts(12, seed=6)
    whole = eng.generate(prompts, seed=0)
    asked = []

    def refill(running):
        asked.append(running)
        return [(prompts[5], 12, 2), (prompts[6], 12, 2)] if len(asked) == 2 else []
    stop = GroupStop([0, 0, 1, 1], need=3, refill=refill)
    out = eng.generate(prompts[:4], seed=0, stop=stop)
    assert asked[:2] == [4, 2]  # requests 2 and 3 end after one token (seed 6, greedy)
    assert stop.group_of == [0, 0, 1, 1, 2, 2] and stop.complete == 3
    assert [s.prompt_ids for s in out] == prompts[:4] + [prompts[5], prompts[6]]
    assert [s.response_ids for s in out] == [whole[i].response_ids for i in (0, 1, 2, 3, 5, 6)]
    assert stop.refill is refill  # restored after the call


def test_a_kv_budget_too_small_for_every_request_admits_them_as_blocks_free(setup):
    """A KV budget of 4 blocks for 4 requests that each grow into a second 256-token block: the
    loop admits what the free blocks allow (Megatron's allocator keeps a reserve for paused
    requests), the rest waits for a finished request's blocks, and every response is the one an
    engine with room for all of them writes (greedy)."""
    policy, groups = setup
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (250 + i,), generator=g).tolist() for i in range(4)]
    block = 256 * 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads x 16 channels, fp32

    def engine_with(buffer_size_gb):
        return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                             config=RolloutConfig(max_new_tokens=12, top_k=1, max_batch_size=4,
                                                  dynamic_buffer_size_gb=buffer_size_gb),
                             max_sequence_length=512)
    roomy = engine_with(None)
    whole = roomy.generate(prompts, seed=0)
    tight = engine_with(5.5 * block / 1024 ** 3)  # the dummy block + 4
    assert tight.dynamic.context.block_allocator.total_count == 5
    out = tight.generate(prompts, seed=0)
    assert roomy.dynamic.steps == 12  # all at once: one prefill, 11 decoding steps
    assert tight.dynamic.steps > 12  # in waves
    assert [s.response_ids for s in out] == [s.response_ids for s in whole]
    assert [s.finish_reason for s in out] == [s.finish_reason for s in whole]
    for a, b in zip(out, whole):
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)
