"""Routing replay on Megatron-Core's RouterReplay, scoped to one model (single process, CPU).

Multi-process layouts (TP=2+SP, EP=2, PP=2, full recompute) are in
tests/distributed/test_routing_distributed.py.
"""

import pytest
import torch

from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from tests.helpers.routing import forward_logits

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)

MBS = 4


@pytest.fixture(scope="module")
def setup():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.policy import make_policy_batch
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.backends.megatron.policy import build_policy

    # Dense layer between MoE layers; aux loss off so any router gradient comes through replay.
    model = model_config_from_preset("tiny", num_layers=3, moe_layer_freq=[1, 0, 1], seq_length=32,
                                     moe_aux_loss_coeff=0.0)
    groups = initialize_distributed(ParallelConfig(), model, seed=3)
    policy = build_policy(model, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 30, (8,), generator=gen)  # padded batch
    seqs = [torch.randint(0, 100, (int(n),), generator=gen).tolist() for n in lengths]
    batch = make_policy_batch(seqs, [3] * 8, pad_id=0)
    batch.advantages = torch.randn(8, generator=gen)
    yield model, groups, policy, batch
    destroy_distributed()


@pytest.fixture
def saved_weights(setup):
    _, _, policy, _ = setup
    state = {k: v.clone() for k, v in policy.unwrapped().state_dict().items() if torch.is_tensor(v)}
    yield
    policy.unwrapped().load_state_dict(state, strict=False)


def test_layers_and_compact_store(setup):
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting

    _, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    assert routing.moe_layers == [0, 1]  # the dense layer 2 is skipped
    rec = routing.recorder(capture_entropy=True)
    forward_logits(policy, batch, MBS, rec, train=False)
    store = rec.store()
    assert store.indices.shape == (2, 8, batch.seq_length, 2)
    assert store.indices.dtype == torch.uint8 and store.bytes_per_token_per_layer() == 2
    assert store.entropy.shape == (2, 8, batch.seq_length)
    assert (store.entropy > 0).all() and (store.entropy <= torch.log(torch.tensor(4.0)) + 1e-5).all()


def test_replay_with_unchanged_weights_is_bit_identical(setup):
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting

    _, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    rec = routing.recorder()
    old = forward_logits(policy, batch, MBS, rec, train=False)  # old-policy pass: eval, no grad
    store = rec.store()
    new = forward_logits(policy, batch, MBS, routing.replayer(store, MBS), train=True)  # update forward
    assert torch.equal(old, new)
    # routes are kept per sequence: a shuffled minibatch with another micro-batch size replays too
    perm = torch.tensor([5, 2, 7, 0, 1, 3, 6, 4])
    again = forward_logits(policy, batch.select(perm), 2, routing.replayer(store.select(perm), 2), train=True)
    assert torch.equal(old[perm], again)
    assert all(r.router_replay_action is None for r in routing.replays), "replay left switched on"


def test_perturbed_weights_replay_recorded_routes_and_router_gets_gradient(setup, saved_weights):
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting
    from gspo_megatron.routing.stats import multi_hot

    _, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    rec = routing.recorder()
    forward_logits(policy, batch, MBS, rec, train=False)
    store = rec.store()
    with torch.no_grad():
        for router in routing.routers:
            router.weight.add_(2 * router.weight.std() * torch.randn_like(router.weight))
    free = routing.recorder()
    forward_logits(policy, batch, MBS, free, train=False)
    assert (free.store().indices != store.indices).any(), "perturbation should move free routes"

    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[1].clone()))
             for r in routing.routers]
    policy.zero_grad()
    forward_logits(policy, batch, MBS, routing.replayer(store, MBS), train=True)
    for h in hooks:
        h.remove()
    expected = [multi_hot(x, 4) for s in range(0, 8, MBS)
                for x in store.sequence_major(slice(s, s + MBS))]
    assert len(seen) == len(expected) and all(torch.equal(a, b) for a, b in zip(seen, expected))
    for router in routing.routers:  # the gathered scores at the forced experts carry the gradient
        assert router.weight.main_grad.abs().sum() > 0


def test_training_forwards_record_the_free_routes_also_under_replay(setup, saved_weights):
    """routing/drift/* comes from the update forwards. A recorder in a training forward gives
    exactly the routes of a free eval forward with the same weights. A replayer with
    capture_natural gives, per layer, the router's own top-k on the hidden states that replay
    produced: the first MoE layer's equal free routing's, deeper ones are conditioned on the
    replayed layers below."""
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting
    from gspo_megatron.backends.megatron.routing.diagnostics import route_drift

    _, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    rec = routing.recorder()
    forward_logits(policy, batch, MBS, rec, train=False)
    old = rec.store()
    train_rec = routing.recorder()
    forward_logits(policy, batch, MBS, train_rec, train=True)
    assert torch.equal(train_rec.store().indices, old.indices)
    assert route_drift(routing, old, train_rec.store(), batch.response_mask)[0] == 0.0

    with torch.no_grad():
        for router in routing.routers:
            router.weight.add_(2 * router.weight.std() * torch.randn_like(router.weight))
    free = routing.recorder()
    forward_logits(policy, batch, MBS, free, train=False)
    replayer = routing.replayer(old, MBS, capture_natural=True)
    replayed = forward_logits(policy, batch, MBS, replayer, train=True)
    natural = replayer.natural_store()
    assert torch.equal(natural.indices[0], free.store().indices[0])
    assert (natural.indices[1] != old.indices[1]).any()
    plain = forward_logits(policy, batch, MBS, routing.replayer(old, MBS), train=True)
    assert torch.equal(replayed, plain), "capturing the free routes must not change the replay"
    rate, per_layer = route_drift(routing, old, natural, batch.response_mask)
    assert 0.0 < rate <= 1.0 and len(per_layer) == 2 and max(per_layer) > 0
    assert all(r.capture_natural is False for r in routing.replays)


def test_reference_model_does_not_mix_into_the_policy_routers(setup, saved_weights):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting

    model, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    # A reference model built with Megatron's own switch joins the class-level list ...
    before = len(RouterReplay.global_router_replay_instances)
    reference = build_gpt_model(model, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                                pre_process=True, post_process=True,
                                transformer_config_overrides={"moe_enable_routing_replay": True})
    assert len(RouterReplay.global_router_replay_instances) == before + 2
    assert not any(r in RouterReplay.global_router_replay_instances for r in routing.replays)

    rec = routing.recorder()
    old = forward_logits(policy, batch, MBS, rec, train=False)
    store = rec.store()
    # ... and anything done through it, between the policy's record and replay, stays there.
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        reference(batch.tokens, batch.position_ids(), attention_mask=None)
    assert all(r.get_recorded_indices() is not None for r in RouterReplay.global_router_replay_instances[-2:])
    assert all(r.router_replay_action is None and r.recorded_topk_idx is None for r in routing.replays)
    # a second ModelRouting on the reference takes its routers out of the list, not the policy's
    ref_routing = ModelRouting([reference], groups)
    assert len(RouterReplay.global_router_replay_instances) == before
    assert not set(map(id, ref_routing.replays)) & set(map(id, routing.replays))
    new = forward_logits(policy, batch, MBS, routing.replayer(store, MBS), train=True)
    assert torch.equal(old, new)
    RouterReplay.clear_global_router_replay_action()


def test_replay_rejects_a_mismatched_layout(setup):
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting

    _, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    rec = routing.recorder()
    forward_logits(policy, batch, MBS, rec, train=False)
    store = rec.store()
    short = store.select(slice(0, 8))
    short.indices = short.indices[:, :, :-2]  # as if the batch had been padded differently
    with pytest.raises(RuntimeError, match="recorded tokens but the router sees"):
        forward_logits(policy, batch, MBS, routing.replayer(short, MBS), train=False)
    assert all(r.router_replay_action is None for r in routing.replays)


def test_diagnostics_zero_when_nothing_changed(setup):
    from gspo_megatron.algorithms import PolicyGradientObjective, PolicyLossConfig
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting
    from gspo_megatron.backends.megatron.routing.diagnostics import routing_diagnostics
    from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs

    _, groups, policy, batch = setup
    routing = ModelRouting(policy.model, groups)
    scoring = ScoringConfig(vocab_size=100)
    rec = routing.recorder()
    batch.old_logprobs, _ = compute_logprobs(policy.model, batch, MBS, scoring, groups, routing=rec)
    m = routing_diagnostics(policy.model, routing, batch, rec.store(), MBS, scoring, groups,
                            PolicyGradientObjective(PolicyLossConfig(variant="gspo")).clipped_positions)
    assert m["routing/change_rate"] == 0.0 and m["routing/jaccard"] == 1.0
    assert m["routing/change_rate/layer_0"] == 0.0 and m["routing/change_rate/layer_1"] == 0.0
    assert m["routing/token_change_rate"] == 0.0 and m["routing/abs_log_ratio_unchanged"] == 0.0
    assert m["routing/replay_gap_abs_logprob"] == 0.0 and m["routing/replay_gap_k3"] == 0.0
    assert m["routing/load_imbalance"] >= 1.0
    assert sum(m[f"routing/load/layer_0/expert_{e}"] for e in range(4)) == pytest.approx(1.0)


@pytest.mark.parametrize("override, message", [
    ("--routing.replay=r3 --parallel.pipeline_model_parallel_size=2 "
     "--parallel.expert_model_parallel_size=2 --model.num_layers=2",
     "pipeline_model_parallel_size=2 with parallel.expert_model_parallel_size=2"),
    ("--routing.diagnostics_interval=0", "routing.diagnostics_interval: must be >= 1"),
])
def test_config_validation(override, message):
    from gspo_megatron.config.loader import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, ["--routing.diagnostics=true", "--model.seq_length=2048",
                                 *override.split()])
        validate_config(cfg, world_size=2, check_paths=False)
