"""A shipped recipe's rollout layout decoding a converted HF checkpoint (run under torchrun by
test_decode_recipes.py).

The layout is the recipe's (``examples/configs/*.yaml``: its tensor and expert-tensor parallel
sizes), the expert-parallel size cut to the ranks here (``world / etp``); the model is the
checkpoint's (a shrunk Qwen3-MoE). Every rank decodes the same prompts greedily through the
multi-step step function (``decode_steps_per_sync`` 16) and through Megatron's forward at every
step (0), and writes ``{out}/rank{r}.json``: both token lists, whether the step function ran,
whether its experts were gathered.
"""

import argparse
import json
import os

import torch
import yaml

from gspo_megatron.backends.megatron.checkpoint import load_model_weights
from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.config import OptimConfig, RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig
from gspo_megatron.tools.export_hf import read_mcore_configs
from tests.helpers.rank_results import write_rank_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--mcore", required=True)
    ap.add_argument("--prompts", required=True, help="a JSON list of token-id lists")
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    with open(args.recipe) as f:
        recipe = yaml.safe_load(f)["parallel"]
    tp, etp = recipe["tensor_model_parallel_size"], recipe.get("expert_tensor_parallel_size")
    ep = min(recipe["expert_model_parallel_size"], world // (etp or tp))
    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=etp, sequence_parallel=tp > 1)
    cfg, _, _ = read_mcore_configs(args.mcore)
    groups = initialize_distributed(parallel, cfg, seed=0)
    policy = build_policy(cfg, parallel, PrecisionConfig(transformer_impl="local"), OptimConfig(),
                          groups, total_steps=1, with_optimizer=False)
    load_model_weights(policy.unwrapped(), args.mcore)
    with open(args.prompts) as f:
        prompts = json.load(f)
    result = {"layout": [tp, ep, etp]}
    for k in (16, 0):
        engine = RolloutEngine(policy.model, groups, eos_id=0, pad_id=0, vocab_size=cfg.vocab_size,
                               config=RolloutConfig(max_new_tokens=args.new_tokens, top_k=1,
                                                    ignore_eos=True, max_batch_size=len(prompts),
                                                    decode_steps_per_sync=k))
        result[f"tokens_{k}"] = [s.response_ids for s in engine.generate(prompts, seed=0)]
        fast = engine.dynamic.fast
        result[f"fast_{k}"] = fast is not None
        result[f"replicated_{k}"] = fast is not None and fast.replicated
    write_rank_json(args.out, groups.rank, result)
    destroy_distributed()


if __name__ == "__main__":
    main()
