"""One layout of the parallel-invariance test (run under torchrun by test_parallel_invariance.py).

Loads the reference weights, computes the GSPO minibatch loss and gradients on a fixed batch with
this layout, and writes the loss (JSON) and the reduced gradients (dist checkpoint) to --out.
``--make-reference`` instead initialises the weights from the seed and saves them to --weights.
"""

import argparse
import json
import os

import torch

from gspo_megatron.algorithms import PolicyLossConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.policy import make_policy_batch
from gspo_megatron.config import OptimConfig
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.checkpoint import grads_to_params, load_model_weights, save_model_weights
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs, train_minibatch

BATCH, VOCAB = 8, 100


def tiny_model():
    # Dense layer between MoE layers, 4 experts top-2: exercises both MLP kinds and the router.
    return model_config_from_preset("tiny", num_layers=4, moe_layer_freq=[1, 0, 1, 1], seq_length=32)


def fixed_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 30, (BATCH,), generator=gen)
    seqs = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]
    prompt_lens = torch.randint(2, 6, (BATCH,), generator=gen).tolist()
    batch = make_policy_batch(seqs, prompt_lens, pad_id=0, seq_length=32)
    batch.advantages = torch.randn(BATCH, generator=gen)
    # pi_old differs from pi by a per-token perturbation so ratios, clipping and KL are non-trivial.
    noise = 0.3 * torch.randn(batch.tokens.shape, generator=gen)
    return batch, noise


def compare_grads(model, reference_dir, other_dirs):
    """Print, as JSON, the largest |grad - grad_ref| and the ref grad scale for each layout."""
    load_model_weights(model, reference_dir)
    ref = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    report = {}
    for d in other_dirs:
        load_model_weights(model, os.path.join(d, "grads"))
        diffs = {k: (v - ref[k]).abs().max().item() for k, v in model.state_dict().items()
                 if torch.is_tensor(v) and k in ref and v.is_floating_point()}
        worst = max(diffs, key=diffs.get)
        report[d] = {"max_abs_diff": diffs[worst], "worst_param": worst,
                     "ref_scale": max(v.abs().max().item() for v in ref.values() if v.is_floating_point()),
                     "num_params": len(diffs)}
    print("COMPARE " + json.dumps(report))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=BATCH)
    ap.add_argument("--variant", default="gspo")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--make-reference", action="store_true")
    ap.add_argument("--compare", nargs="*", default=None,
                    help="grad checkpoints to compare with --out's (single process)")
    args = ap.parse_args()

    model_cfg = tiny_model()
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                              expert_model_parallel_size=args.ep, sequence_parallel=args.tp > 1)
    groups = initialize_distributed(parallel, model_cfg, seed=1234)
    policy = build_policy(model_cfg, parallel, PrecisionConfig(transformer_impl="local"), OptimConfig(),
                          groups, total_steps=1, with_optimizer=False)
    if args.make_reference:
        save_model_weights(policy.unwrapped(), args.weights)
        destroy_distributed()
        return
    if args.compare is not None:
        compare_grads(policy.unwrapped(), os.path.join(args.out, "grads"), args.compare)
        destroy_distributed()
        return
    load_model_weights(policy.unwrapped(), args.weights)

    batch, noise = fixed_batch(seed=7)
    per_rank = BATCH // groups.dp_size
    local = batch.select(slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank))
    scoring = ScoringConfig(vocab_size=VOCAB)
    # Old log-probs from the reference weights themselves (same for every layout up to float error).
    logprobs, _ = compute_logprobs(policy.model, local, args.micro_batch_size, scoring, groups)
    if logprobs is not None:
        local_noise = noise[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
        local.old_logprobs = (logprobs + local_noise * local.response_mask).detach()
    else:  # non-last pipeline stages never read it
        local.old_logprobs = torch.zeros(local.tokens.shape)

    loss_cfg = PolicyLossConfig(variant=args.variant, clip_low=0.05, clip_high=0.05)
    policy.zero_grad()
    metrics = train_minibatch(policy.model, local, args.micro_batch_size, loss_cfg, scoring, groups)

    os.makedirs(args.out, exist_ok=True)
    # What this rank holds, for the layout planner's exact parameter counts.
    params = dict(policy.unwrapped().named_parameters())
    expert = sum(p.numel() for n, p in params.items() if ".experts." in n)
    with open(os.path.join(args.out, f"params_rank{groups.rank}.json"), "w") as f:
        json.dump({"pp_rank": groups.pp_rank,
                   "dense": sum(p.numel() for p in params.values()) - expert, "expert": expert}, f)
    if groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0:
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    grads_to_params(policy.unwrapped())
    save_model_weights(policy.unwrapped(), os.path.join(args.out, "grads"))
    destroy_distributed()


if __name__ == "__main__":
    main()
