"""One layout of the routing-replay test (run under torchrun by test_routing_distributed.py).

On a 4-layer tiny MoE with a dense layer between MoE layers ([1, 0, 1, 1]) and a padded batch:
records the routes in an eval forward, replays them in a training forward (logits must be
bit-identical), perturbs the routers and checks that replay still forces the recorded routes and
that the routers get a gradient, and computes the routing diagnostics with and without the
perturbation. Writes one JSON per layout (rank 0) with every rank's findings.
"""

import argparse
import json

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import PolicyGradientObjective, PolicyLossConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.backends.megatron.routing.replay import ModelRouting
from gspo_megatron.backends.megatron.routing.diagnostics import route_drift, routing_diagnostics
from gspo_megatron.routing.stats import multi_hot
from gspo_megatron.policy import make_policy_batch
from gspo_megatron.config import OptimConfig
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.checkpoint import load_model_weights, save_model_weights
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
from tests.helpers.routing import forward_logits

BATCH, VOCAB, SEQ = 8, 100, 32


def fixed_batch():
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(6, 30, (BATCH,), generator=gen)  # right padding to SEQ
    seqs = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]
    batch = make_policy_batch(seqs, [3] * BATCH, pad_id=0, seq_length=SEQ)
    batch.advantages = torch.randn(BATCH, generator=gen)
    return batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--recompute", default=None)
    ap.add_argument("--weights", default=None, help="load these weights (dist checkpoint)")
    ap.add_argument("--make-reference", action="store_true", help="save the weights to --weights")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model_cfg = model_config_from_preset("tiny", num_layers=4, moe_layer_freq=[1, 0, 1, 1],
                                         seq_length=SEQ, moe_aux_loss_coeff=0.0)
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                              expert_model_parallel_size=args.ep, sequence_parallel=args.tp > 1)
    groups = initialize_distributed(parallel, model_cfg, seed=1234)
    policy = build_policy(model_cfg, parallel,
                          PrecisionConfig(transformer_impl="local",
                                          recompute_granularity=args.recompute),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    if args.make_reference:
        save_model_weights(policy.unwrapped(), args.weights)
        destroy_distributed()
        return
    if args.weights:
        load_model_weights(policy.unwrapped(), args.weights)
    routing = ModelRouting(policy.model, groups)
    per_rank = BATCH // groups.dp_size
    rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    batch = fixed_batch().select(rows)
    mbs = 2
    res = {"rank": groups.rank, "moe_layers": routing.moe_layers}

    # 1. record (eval, no grad) then replay in a training forward: identical logits.
    rec = routing.recorder()
    logits_old = forward_logits(policy, batch, mbs, rec, train=False)
    store = rec.store()
    res["store_shape"] = list(store.indices.shape)
    res["store_dtype"] = str(store.indices.dtype)
    logits_replay = forward_logits(policy, batch, mbs, routing.replayer(store, mbs), train=True)
    if logits_old is not None:
        res["exact"] = bool(torch.equal(logits_old, logits_replay))

    # 2. diagnostics with unchanged weights: nothing changed.
    scoring = ScoringConfig(vocab_size=VOCAB)
    lp, _ = compute_logprobs(policy.model, batch, mbs, scoring, groups)
    batch.old_logprobs = lp if lp is not None else torch.zeros(batch.tokens.shape)
    clip_rule = PolicyGradientObjective(
        PolicyLossConfig(variant="grpo", clip_low=0.2, clip_high=0.2)).clipped_positions
    res["diag_same"] = routing_diagnostics(policy.model, routing, batch, store, mbs, scoring, groups,
                                           clip_rule)

    # 3. perturb the routers (same noise on every rank: routers are replicated).
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for layer, router in zip(routing.moe_layers, routing.routers):
            noise = torch.randn(router.weight.shape, generator=gen.manual_seed(99 + layer))
            router.weight.add_(2.0 * router.weight.std() * noise)
    rec2 = routing.recorder()
    forward_logits(policy, batch, mbs, rec2, train=False)
    free = rec2.store()
    changed = torch.tensor(float((free.indices != store.indices).any(-1).sum()))
    dist.all_reduce(changed)
    res["free_changed_positions"] = float(changed)

    seen = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: seen.append(out[1].detach().clone()))
             for r in routing.routers]
    policy.zero_grad()
    forward_logits(policy, batch, mbs, routing.replayer(store, mbs), train=True)
    for h in hooks:
        h.remove()
    # forward hooks fire per layer per microbatch (and again on recompute): layer-major per mb
    L = len(routing.routers)
    expected = []
    for i in range(0, batch.size, mbs):
        per_layer = store.sequence_major(slice(i, i + mbs))
        expected.extend(multi_hot(x, routing.num_experts) for x in per_layer)
    # each router call (forward, and the recompute under --recompute full) used recorded routes
    n = len(expected)
    res["routes_forced"] = bool(L == 0 or (len(seen) >= n and all(
        any(torch.equal(a, b) for b in expected) for a in seen)))
    res["num_router_calls"] = len(seen)
    grads = [float(r.weight.main_grad.abs().sum()) for r in routing.routers]
    res["router_grad_abs_sum"] = grads

    res["diag_perturbed"] = routing_diagnostics(policy.model, routing, batch, store, mbs, scoring,
                                                groups, clip_rule)

    # 4. routing/drift/* from training forwards: the free routes (recorder), and under replay the
    # routes the routers would have taken (capture_natural), against the recorded old routes.
    drift_rec = routing.recorder()
    forward_logits(policy, batch, mbs, drift_rec, train=True)
    res["drift_free"] = route_drift(routing, store, drift_rec.store(), batch.response_mask)[0]
    replayer = routing.replayer(store, mbs, capture_natural=True)
    forward_logits(policy, batch, mbs, replayer, train=True)
    res["drift_replay"] = route_drift(routing, store, replayer.natural_store(),
                                      batch.response_mask)[0]
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, res)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(everything, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
