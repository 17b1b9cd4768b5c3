"""Rollout throughput of :class:`RolloutEngine` on a model preset (single process).

    PYTHONPATH=. OMP_NUM_THREADS=2 TQDM_DISABLE=1 python -m gspo_megatron.rollout.bench \
        --preset tiny --prompts 64 --max-new-tokens 16

Prints generated tokens per second (response tokens, EOS included) over ``--repeats`` timed calls
after one warm-up call.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-length", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.model.config import ParallelConfig, PrecisionConfig, model_config_from_preset
    from gspo_megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.rollout import RolloutEngine
    from gspo_megatron.training.megatron_setup import OptimConfig, build_policy

    model_cfg = model_config_from_preset(args.preset)
    parallel = ParallelConfig()
    groups = initialize_distributed(parallel, model_cfg, seed=0)
    policy = build_policy(model_cfg, parallel, PrecisionConfig(), OptimConfig(), groups,
                          total_steps=1, with_optimizer=False)
    vocab = model_cfg.vocab_size
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        max_batch_size=args.prompts)
    engine = RolloutEngine(policy.model, groups, eos_id=vocab - 1, pad_id=0, vocab_size=vocab,
                           config=cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab - 1, (args.prompts, args.prompt_length), generator=gen).tolist()
    engine.generate(prompts, seed=0)  # warm-up (KV cache allocation)
    tokens, seconds = 0, 0.0
    for r in range(args.repeats):
        t0 = time.perf_counter()
        samples = engine.generate(prompts, seed=r + 1)
        seconds += time.perf_counter() - t0
        tokens += sum(len(s.response_ids) for s in samples)
    print(json.dumps({
        "preset": args.preset, "backend": engine.backend, "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
        "tokens_per_s": round(tokens / seconds, 1), "s_per_call": round(seconds / args.repeats, 4),
    }))
    destroy_distributed()


if __name__ == "__main__":
    main()
