"""R3: routes recorded by the rollout engine (Megatron's static engine on CPU) and replayed by the
trainer, single process. Multi-process layouts are in tests/distributed/test_routing_distributed.py.

The tiny MoE has a real vocabulary of 12 ids; its output layer is sharpened so that EOS (id 2)
ends some responses mid-batch, prompts have 2-6 tokens (the engine's prefill window is the
shortest prompt; longer prompts are fed during decode steps) and 24 prompts with
``max_batch_size: 16`` make two engine batches.
"""

from __future__ import annotations

import os

import pytest
import torch

from gspo_megatron.config import RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron.routing.rollout_routes import rollout_disagreement, rollout_route_store
from gspo_megatron.policy import make_policy_batch

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)

VOCAB, EOS, PAD = 12, 2, 0
os.environ.setdefault("TQDM_DISABLE", "1")


@pytest.fixture(scope="module")
def setup():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig

    # A dense layer between two MoE layers: R3 must index MoE layers, not decoder layers.
    model_cfg = model_config_from_preset("tiny", vocab_size=VOCAB, seq_length=32, num_layers=3,
                                         moe_layer_freq=[1, 0, 1], moe_aux_loss_coeff=0.0)
    groups = initialize_distributed(ParallelConfig(), model_cfg, seed=4321)
    policy = build_policy(model_cfg, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False,
                          vocab_size=VOCAB)
    with torch.no_grad():
        policy.unwrapped().output_layer.weight.mul_(30.0)
    yield policy, groups
    destroy_distributed()


def make_prompts(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def make_engine(setup, record_routes=True, **cfg):
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine

    policy, groups = setup
    cfg = {"max_new_tokens": 8, "max_batch_size": 16, **cfg}
    return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                         config=RolloutConfig(**cfg), record_routes=record_routes)


def batch_of(samples):
    batch = make_policy_batch([s.prompt_ids + s.response_ids for s in samples],
                              [len(s.prompt_ids) for s in samples], pad_id=PAD)
    rollout_lp = torch.zeros(batch.tokens.shape)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        rollout_lp[i, p - 1: p - 1 + len(s.response_ids)] = torch.tensor(s.response_logprobs)
    batch.rollout_logprobs = rollout_lp
    batch.advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(1))
    return batch


def as_sets(indices):
    """Routes compared as top-k *sets*: sort the expert ids of each (layer, row, position)."""
    return indices.long().sort(dim=-1).values


def replay_pass(policy, samples, batch):
    """The R3 old-policy pass: the rollout's routes replayed, the routers' own choice captured.
    Returns (rollout store, log-probs, routes used, routes the routers chose, changed [L, B, T])."""
    from gspo_megatron.routing.stats import route_change

    store = rollout_route_store(samples, batch.layout, policy.model_routing)
    hooks = policy.model_routing.replayer(store, policy.micro_batch_size, capture_natural=True)
    lp = policy.logprobs(batch, routing=hooks)
    used, natural = hooks.replayed_store(), hooks.natural_store()
    assert torch.equal(used.indices[:, store.known], store.indices[:, store.known])  # forced
    changed, _ = route_change(store.indices, natural.indices, 4)
    return store, lp, used, natural, changed


@pytest.fixture(scope="module")
def rollout(setup):
    engine = make_engine(setup)
    samples = engine.generate(make_prompts(), seed=5)
    return engine, samples, batch_of(samples)


def test_routes_cover_every_forwarded_token(setup, rollout):
    policy, _ = setup
    _, samples, batch = rollout
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"eos", "length"}, reasons  # EOS mid-batch and full-length rows
    assert len({len(s.prompt_ids) for s in samples}) > 2
    for s in samples:
        routes = s.extra["routes"]
        assert routes.dtype == torch.uint8
        assert routes.shape == (2, len(s.prompt_ids) + len(s.response_ids) - 1, 2)
    store = rollout_route_store(samples, batch.layout, policy.model_routing)
    assert store.indices.shape == (2, 24, batch.seq_length, 2) and store.moe_layers == [0, 1]
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples])
    assert torch.equal(store.known.sum(1), lengths)
    # every scored position (label = a response token) has a recorded route
    assert bool(store.known[batch.response_mask].all())


def test_r3_replay_with_unchanged_weights_picks_the_rollout_experts(setup, rollout):
    """With the trainer's weights equal to the sampler's (fp32): the trainer's own routers pick
    exactly the rollout's experts (0 differing routes in every layer), the replayed pass gives the
    rollout's log-probs to fp32 rounding, and R2 (the trainer's recorded routes) equals R3."""
    policy, _ = setup
    _, samples, batch = rollout
    store, lp, used, natural, changed = replay_pass(policy, samples, batch)
    assert int(changed[:, store.known].sum()) == 0
    mask = batch.response_mask
    gap = (lp - batch.rollout_logprobs)[mask].abs().max().item()
    assert gap < 1e-5, gap  # measured ~1e-6 (KV-cached decode vs one full forward)
    rec = policy.model_routing.recorder()
    policy.logprobs(batch, routing=rec)
    r2 = rec.store()
    assert torch.equal(as_sets(r2.indices), as_sets(used.indices))
    metrics = rollout_disagreement(policy.model_routing, store, natural, batch.response_mask, lp,
                                   batch.rollout_logprobs, policy.groups)
    assert metrics["routing/rollout/change_rate"] == 0.0
    assert metrics["routing/rollout/token_change_rate"] == 0.0
    assert metrics["routing/rollout/change_rate/layer_1"] == 0.0
    assert metrics["routing/rollout/abs_log_ratio_unchanged"] < 1e-5
    assert all(r.router_replay_action is None and r.target_free is None
               for r in policy.model_routing.replays)


def test_r3_forces_the_rollout_routes_when_the_trainer_routes_differently(setup, rollout):
    """A mismatch between engine and trainer (here: perturbed router weights after sampling):
    free routing differs from the rollout's, R3 still uses the rollout's experts in the old-policy
    pass and, replaying that pass's routes, in the update forward, and the metrics see it."""
    policy, _ = setup
    _, samples, batch = rollout
    routers = policy.model_routing.routers
    saved = [r.weight.detach().clone() for r in routers]
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for r in routers:
                r.weight.add_(0.5 * torch.randn(r.weight.shape, generator=g))
        store, lp, used, natural, changed = replay_pass(policy, samples, batch)
        assert int(changed[:, store.known].sum()) > 0
        metrics = rollout_disagreement(policy.model_routing, store, natural, batch.response_mask, lp,
                                   batch.rollout_logprobs, policy.groups)
        assert 0 < metrics["routing/rollout/change_rate"] < 1
        assert metrics["routing/rollout/token_change_rate"] >= metrics["routing/rollout/change_rate"]

        # The update forward replays the old pass's routes (a full store) bit for bit.
        update = policy.model_routing.replayer(used.select(slice(0, 8)), policy.micro_batch_size,
                                              capture_natural=True)
        lp_update = policy.logprobs(batch.select(slice(0, 8)), routing=update)
        assert torch.equal(lp_update, lp[:8])
    finally:
        with torch.no_grad():
            for r, w in zip(routers, saved):
                r.weight.copy_(w)


def test_batch_split_and_order_do_not_change_the_routes(setup):
    """The same prompts in one engine batch or in three give the same routes per sample (greedy:
    the same tokens), so routes follow their request through the engine's batching."""
    prompts = make_prompts(12, seed=3)
    one = make_engine(setup, max_batch_size=16, top_k=1).generate(prompts, seed=0)
    three = make_engine(setup, max_batch_size=5, top_k=1).generate(prompts, seed=0)
    for a, b in zip(one, three):
        assert a.response_ids == b.response_ids
        assert torch.equal(as_sets(a.extra["routes"]), as_sets(b.extra["routes"]))


def test_no_recording_unless_asked(setup):

    policy, _ = setup
    plain = make_engine(setup, record_routes=False)
    samples = plain.generate(make_prompts(4), seed=0)
    assert all("routes" not in s.extra for s in samples)
    greedy = make_engine(setup).with_sampling(RolloutConfig(max_new_tokens=8, max_batch_size=16,
                                                            top_k=1))
    assert all("routes" not in s.extra for s in greedy.generate(make_prompts(4), seed=0))
    with pytest.raises(RuntimeError, match="carries no routes"):
        rollout_route_store(samples, make_policy_batch(
            [s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples],
            pad_id=PAD, seq_length=32).layout, policy.model_routing)


def test_bf16_rollout_routes_are_replayed_by_the_fp32_trainer(setup):
    """``rollout.precision: bf16``: routes are recorded on the bf16 sampling copy's routers; the
    fp32 trainer replaying them uses exactly those experts, while its own free routing may differ
    (the mismatch R3 removes), which the disagreement metrics count."""
    policy, _ = setup
    engine = make_engine(setup, precision="bf16")
    assert engine.sampling_model is not policy.unwrapped()
    samples = engine.generate(make_prompts(), seed=5)
    batch = batch_of(samples)
    store, lp, _, natural, _ = replay_pass(policy, samples, batch)
    metrics = rollout_disagreement(policy.model_routing, store, natural, batch.response_mask, lp,
                                   batch.rollout_logprobs, policy.groups)
    assert 0.0 <= metrics["routing/rollout/change_rate"] < 0.5
    assert metrics["routing/rollout/abs_log_ratio_unchanged"] > 0  # bf16 vs fp32 log-probs


def test_static_engine_r3_routes_of_left_padded_prompts(setup):
    """The static engine with the local kernels left-pads a batch's prompts to the longest:
    each sample's routes must skip its padding (positions ``pad .. pad + n``). With the trainer's
    weights equal to the sampler's the trainer's own routers pick exactly the recorded experts
    on every forwarded position of prompts of mixed lengths; routes taken from position 0 (the
    planted bug of issue 52: ``gspo_routes[:, :n]``) put the pad positions' routes on the
    prompt's tokens and fail here."""
    policy, _ = setup
    engine = make_engine(setup, engine="static")
    assert engine.backend == "static" and engine._left_padding_ok
    prompts = make_prompts(8, seed=3)
    assert len({len(p) for p in prompts}) > 2  # mixed lengths: left padding in every batch
    samples = engine.generate(prompts, seed=5)
    store, _, _, _, changed = replay_pass(policy, samples, batch_of(samples))
    assert int(changed[:, store.known].sum()) == 0


def test_a_position_forwarded_twice_keeps_its_first_route():
    """An evicted request prefilled again forwards its positions a second time (a recompute,
    other routes possible): ``take_request`` keeps each position's first route, the one taken
    when the next token was sampled, whatever the recording order within a step."""
    from types import SimpleNamespace

    from gspo_megatron.backends.megatron.routing.rollout_routes import PackedRouteRecorder

    rec = PackedRouteRecorder(SimpleNamespace(dtype=torch.int16, reset=lambda: None))
    L, k = 2, 2
    first = torch.arange(L * 3 * k, dtype=torch.int16).view(L, 3, k)  # positions 0..2
    rec.record_tokens(torch.tensor([7, 7, 7]), torch.tensor([0, 1, 2]), first)
    rec.record_tokens(torch.tensor([9]), torch.tensor([0]), torch.zeros(L, 1, k))
    # the re-prefill after an eviction: positions 2, 1, 0 again (other routes), then 3
    again = torch.full((L, 4, k), 99, dtype=torch.int16)
    rec.record_tokens(torch.tensor([7, 7, 7, 7]), torch.tensor([2, 1, 0, 3]), again)
    got = rec.take_request(7, 4)
    assert torch.equal(got[:, :3], first)
    assert bool((got[:, 3] == 99).all())
