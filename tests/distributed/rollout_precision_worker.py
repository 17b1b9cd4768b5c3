"""bf16 rollouts (``rollout.precision=bf16``) on a model-parallel layout (run under torchrun by
``tests/unit/test_rollout_precision.py``).

Every rank builds the tiny MoE of :mod:`tests.distributed.rollout_worker` at ``--tp``/``--ep`` (same
seed), samples with a bf16 copy of its own shards, scores the samples with the fp32 trainer and
writes ``{out}/rank{r}.json``: samples, ``k3``/``diff`` against the trainer, and layout checks.
"""

import argparse

import torch

from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
from gspo_megatron.config import OptimConfig, RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig
from gspo_megatron.policy import make_policy_batch
from tests.distributed.rollout_worker import EOS, VOCAB, model_config, prompts
from tests.helpers.rank_results import write_rank_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--kv", default="auto", help="rollout.kv_cache_dtype")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp,
                              expert_model_parallel_size=args.ep, sequence_parallel=args.tp > 1)
    groups = initialize_distributed(parallel, model_config(), seed=1234)
    policy = build_policy(model_config(), parallel, PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    live = policy.unwrapped()
    with torch.no_grad():  # sharper than the init so that EOS occurs
        live.output_layer.weight.mul_(20.0)
    engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=0, vocab_size=VOCAB,
                           config=RolloutConfig(max_new_tokens=8, temperature=0.9,
                                                max_batch_size=8, precision="bf16",
                                                kv_cache_dtype=args.kv,
                                                decode_experts="replicated"
                                                if args.kv == "fp8" else "auto"))
    samples = engine.generate(prompts(7, 16, 2, 7), seed=11)
    batch = make_policy_batch([s.prompt_ids + s.response_ids for s in samples],
                              [len(s.prompt_ids) for s in samples], pad_id=0)
    lp, _ = compute_logprobs(policy.model, batch, 64,
                             ScoringConfig(temperature=0.9, vocab_size=VOCAB), groups)
    train = torch.cat([lp[i, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + len(s.response_ids)]
                       for i, s in enumerate(samples)]).double()
    eng = torch.cat([torch.tensor(s.response_logprobs, dtype=torch.float64) for s in samples])
    d = train - eng
    copy_params = list(engine.sampling_model.parameters())
    result = dict(
        r=[s.response_ids for s in samples], lp=[s.response_logprobs for s in samples],
        f=[s.finish_reason for s in samples],
        k3=float((d.exp() - 1 - d).mean()), diff=float(d.abs().mean()),
        pg_shared=engine.sampling_model.pg_collection is live.pg_collection,
        shards_match=[tuple(p.shape) for p in copy_params] == [tuple(p.shape)
                                                               for p in live.parameters()],
        bf16=all(p.dtype == torch.bfloat16 for p in copy_params),
        sequence_parallel_restored=bool(live.config.sequence_parallel) == (args.tp > 1),
        kv_fp8_rel_err=engine.weight_metrics().get("rollout/kv_fp8_rel_err"),
        kv_dtype=str(engine.dynamic.context.params_dtype),
    )
    write_rank_json(args.out, groups.rank, result)
    destroy_distributed()


if __name__ == "__main__":
    main()
