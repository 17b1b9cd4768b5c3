"""DP=2 x EP=2 on 4 ranks, the two EP groups deciding differently (run by test_lockstep.py).

Every rank generates its own prompts (different counts and lengths per data-parallel rank),
greedy, twice: ``reference`` with the experts replicated for decoding on every rank (no rank's
step then waits on another's), and ``mixed`` with EP group 0 (ranks 0, 1) forced to replicate
and EP group 1 (ranks 2, 3) forced to keep its experts sharded (lock-step over its own group).
Writes ``{out}/rank{r}.json``: both runs' tokens, log-probs and each group's decision.
"""

import argparse
import json
import os

import torch

from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.config import OptimConfig, RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset

VOCAB, EOS = 16, 2


def prompts(dp_rank):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 5 + 2 * dp_rank, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(2 + 3 * dp_rank)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model_cfg = model_config_from_preset("tiny", num_layers=2, moe_layer_freq=[1, 1],
                                         vocab_size=VOCAB, seq_length=32)
    parallel = ParallelConfig(expert_model_parallel_size=2)
    groups = initialize_distributed(parallel, model_cfg, seed=1234)
    policy = build_policy(model_cfg, parallel, PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False,
                          vocab_size=VOCAB)
    with torch.no_grad():  # sharper than the init, so that some requests end early (EOS)
        policy.unwrapped().output_layer.weight.mul_(20.0)
    ep_group = groups.rank // 2  # Megatron's EP groups at TP = PP = 1: {0, 1} and {2, 3}
    result = {"dp_rank": groups.dp_rank}
    for name, experts in (("reference", "replicated"),
                          ("mixed", "replicated" if ep_group == 0 else "sharded")):
        cfg = RolloutConfig(max_new_tokens=10, top_k=1, max_batch_size=3, decode_experts=experts)
        engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=0, vocab_size=VOCAB,
                               config=cfg)
        samples = engine.generate(prompts(groups.dp_rank), seed=5)
        result[name] = [dict(r=s.response_ids, lp=s.response_logprobs, f=s.finish_reason)
                        for s in samples]
        result[f"{name}_replicated"] = engine.dynamic.fast.replicated
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{groups.rank}.json"), "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
