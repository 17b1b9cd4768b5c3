"""One layout of the rollout-engine test (run under torchrun by test_rollout_distributed.py).

``--make-reference`` (single process) initialises the tiny MoE from the seed and saves it to --weights
first. Otherwise the weights are loaded. Then every rank generates, with Megatron-Core's engine:
  * ``shared``: the same prompts on every rank, greedy and sampled;
  * ``own``: prompts that depend on the data-parallel rank (different count and lengths), sampled
    (under EP these ranks hold different prompts but share the MoE all-to-alls);
and writes ``{out}/rank{r}.json``. A single process also writes ``own_by_dp``: the ``own`` prompts
of data-parallel ranks 0 and 1, to compare with a DP=2 layout's ranks.
"""

import argparse

import torch

from gspo_megatron.config import RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
from gspo_megatron.config import OptimConfig
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.checkpoint import load_model_weights, save_model_weights
from gspo_megatron.backends.megatron.routing.rollout_routes import rollout_disagreement, rollout_route_store
from tests.helpers.rank_results import write_rank_json

VOCAB, EOS = 16, 2


def model_config():
    return model_config_from_preset("tiny", num_layers=2, moe_layer_freq=[1, 1], vocab_size=VOCAB,
                                    seq_length=32)


def prompts(seed, n, lo, hi):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def own_prompts(dp_rank):
    return prompts(100 + dp_rank, 5 + 3 * dp_rank, 2 + dp_rank, 6 + 2 * dp_rank)


def as_json(samples):
    return [dict(r=s.response_ids, lp=s.response_logprobs, f=s.finish_reason) for s in samples]


def r3_check(policy, groups, tp):
    """R3 on this layout (greedy: the same tokens through the multi-step rounds where the layout
    has them and Megatron's per-step loop where not): the routes the engine recorded per sample (this stage's MoE layers, as
    top-k sets), and the old-policy pass replaying them (this rank's sequence shard): forced where
    recorded, its log-probs against the engine's, the rollout-vs-trainer disagreement."""
    from gspo_megatron.policy import make_policy_batch

    engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=0, vocab_size=VOCAB,
                           config=RolloutConfig(max_new_tokens=8, temperature=0.9, top_k=1,
                                                max_batch_size=4), record_routes=True)
    samples = engine.generate(prompts(7, 6, 2, 7), seed=11)
    layers = policy.model_routing.moe_layers
    routes = [{str(layer): s.extra["routes"][i].long().sort(-1).values.tolist()
               for i, layer in enumerate(layers)} for s in samples]
    batch = make_policy_batch([s.prompt_ids + s.response_ids for s in samples],
                              [len(s.prompt_ids) for s in samples], pad_id=0,
                              pad_to_multiple_of=tp, seq_length=32 if groups.pp_size > 1 else None)
    rollout_lp = torch.zeros(batch.tokens.shape)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        rollout_lp[i, p - 1: p - 1 + len(s.response_ids)] = torch.tensor(s.response_logprobs)
    batch.rollout_logprobs = rollout_lp
    store = rollout_route_store(samples, batch.layout, policy.model_routing)
    hooks = policy.model_routing.replayer(store, policy.micro_batch_size, capture_natural=True)
    lp = policy.logprobs(batch, temperature=0.9, routing=hooks)  # the sampling temperature
    used, natural = hooks.replayed_store(), hooks.natural_store()
    known = store.known
    out = dict(routes=routes, store_shape=list(store.indices.shape), seq_length=batch.seq_length,
               forced=bool(torch.equal(used.indices[:, known], store.indices[:, known])),
               metrics=rollout_disagreement(policy.model_routing, store, natural, batch.response_mask, lp,
                                   batch.rollout_logprobs, policy.groups))
    if lp is not None:
        out["max_gap"] = float((lp - rollout_lp)[batch.response_mask].abs().max())
        out["lp"] = [lp[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.response_ids)]
                     .tolist() for i, s in enumerate(samples)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--make-reference", action="store_true")
    args = ap.parse_args()

    model_cfg = model_config()
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep,
                              expert_tensor_parallel_size=args.etp,
                              pipeline_model_parallel_size=args.pp, sequence_parallel=args.tp > 1)
    groups = initialize_distributed(parallel, model_cfg, seed=1234)
    policy = build_policy(model_cfg, parallel, PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False,
                          vocab_size=VOCAB)
    if args.make_reference:
        with torch.no_grad():  # sharper than the init so that greedy/sampled runs see EOS
            policy.unwrapped().output_layer.weight.mul_(20.0)
        save_model_weights(policy.unwrapped(), args.weights)
    else:
        load_model_weights(policy.unwrapped(), args.weights)

    result = {}
    for name, cfg in {
        "greedy": RolloutConfig(max_new_tokens=8, top_k=1, max_batch_size=4),
        # Sampled through Megatron's per-step loop on every layout (TP / PP rollouts always
        # decode there): the multi-step rounds draw from the same distribution, but a round's
        # draws include its finished rows, so its tokens are another draw than the loop's.
        "sampled": RolloutConfig(max_new_tokens=8, temperature=0.9, top_k=6, max_batch_size=4,
                                 decode_steps_per_sync=0),
        # EP: the decoding step's experts on their own ranks (two collectives per MoE layer and
        # step) instead of gathered once per call (``auto`` here: the tiny model's fit)
        "greedy_sharded": RolloutConfig(max_new_tokens=8, top_k=1, max_batch_size=4,
                                        decode_experts="sharded"),
        # Megatron's forward at every step (the layout's own modules and collectives): what
        # the step function's greedy tokens must equal on this layout
        "greedy_megatron": RolloutConfig(max_new_tokens=8, top_k=1, max_batch_size=4,
                                         decode_steps_per_sync=0),
        # sampled through the rounds: every rank of a TP group draws the same tokens (each
        # samples from the same gathered logits with the same seed; nothing is broadcast)
        "sampled_rounds": RolloutConfig(max_new_tokens=8, temperature=0.9, top_k=6,
                                        max_batch_size=4),
    }.items():
        engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=0, vocab_size=VOCAB,
                               config=cfg)
        result[name] = as_json(engine.generate(prompts(7, 6, 2, 7), seed=11))
        # Own prompts per rank: EP ranks decode them in lock-step (greedy: through the
        # multi-step rounds where the layout has them, the ranks agreeing when rounds run)
        own = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=0, vocab_size=VOCAB,
                            config=cfg)
        result[f"own_{name}"] = as_json(own.generate(own_prompts(groups.dp_rank), seed=23))
        fast = own.dynamic.fast if own.dynamic is not None else None
        result[f"own_{name}_replicated"] = fast is not None and fast.replicated
        result[f"own_{name}_fast"] = fast is not None
        if groups.world_size == 1:
            result[f"own_{name}_by_dp"] = [as_json(own.generate(own_prompts(dp), seed=23))
                                           for dp in (0, 1)]
    result["r3"] = r3_check(policy, groups, args.tp)
    result["sequence_parallel_restored"] = bool(policy.unwrapped().config.sequence_parallel) == (
        args.tp > 1)
    result["training_restored"] = policy.unwrapped().training
    result["dp_rank"] = groups.dp_rank
    write_rank_json(args.out, groups.rank, result)
    destroy_distributed()


if __name__ == "__main__":
    main()
