"""One layout of the parallel-invariance test (run under torchrun by test_parallel_invariance.py).

Loads the reference weights, computes the GSPO minibatch loss and gradients on a fixed batch with
this layout, and writes the loss (JSON) and the reduced gradients (gathered whole on rank 0,
``tests.helpers.megatron.full_state``, one ``grads.pt``) to --out; then
does the same in the same process for each rollout-correction case of ``CORRECTIONS`` (the same
batch carrying ``rollout_logprobs``) and each other loss of ``VARIANTS`` (GRPO with both
aggregations, GSPO-token, and every other registered loss and aggregation), to --out/<case>.
``--make-reference`` instead initialises the weights from the seed and saves them to --weights.
:func:`compare_grads` (called by the test) compares the layouts' gradients with a reference run's.
"""

import argparse
import dataclasses
import json
import os

import torch

from gspo_megatron.algorithms import LOSSES, PolicyLossConfig, RolloutCorrectionConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.policy import make_policy_batch
from gspo_megatron.config import OptimConfig
from gspo_megatron.layout import balance_across_ranks
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.checkpoint import load_model_weights, save_model_weights
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
from tests.helpers.megatron import full_state, grads_to_params, train_minibatch

BATCH, VOCAB = 8, 100

# Rollout-correction cases run after the uncorrected loss, on the same batch. With
# rollout = old + 0.3 * randn (fixed_batch), the mask band [1/1.5, 1.5] drops ~18% of the response
# tokens and keeps the rest at w != 1; the sequence-level geometric-mean weights lie in ~[0.93, 1.014],
# so cap 1.01 truncates one sequence of 8 and leaves the others below 1.
GSPO = PolicyLossConfig(variant="gspo", clip_low=0.05, clip_high=0.05)
CORRECTIONS = {
    "mask_token": RolloutCorrectionConfig(mode="mask", level="token", cap=1.5),
    "truncate_seq": RolloutCorrectionConfig(mode="truncate", level="sequence", cap=1.01),
}
# The other loss variants, run after the corrections on the same batch. GRPO's token_mean is the
# case whose normaliser is the response-token count summed over data-parallel ranks; its eps sides
# differ (0.1 / 0.2), so a swapped side changes which tokens clip. GSPO-token gets per-token
# advantages (fixed_batch's last draw), the one variant that takes them.
# Then the registry's other losses and aggregations, with bounds that bind on this batch (token
# log-ratios ~ N(0, 0.3^2)): CISPO's weight capped at 1.2 (verl's example), the dual clip at 1.3
# (with Dr. GRPO's aggregation, normaliser B x RESPONSE_BUDGET summed over data-parallel ranks),
# GMPO at the paper's 0.4; LUSPO (gspo + seq_mean_token_sum). A
# registered loss not named here runs at its defaults: every loss of the registry is covered.
_NAMED = {
    "grpo_seq_mean": PolicyLossConfig(variant="grpo", clip_low=0.1, clip_high=0.2),
    "grpo_token_mean": PolicyLossConfig(variant="grpo", clip_low=0.1, clip_high=0.2,
                                        aggregation="token_mean"),
    "gspo_token": PolicyLossConfig(variant="gspo_token", clip_low=0.03, clip_high=0.06),
    "sapo": PolicyLossConfig(variant="sapo"),
    "cispo": PolicyLossConfig(variant="cispo", clip_high=0.2),
    "geo_mean": PolicyLossConfig(variant="geo_mean"),
    "gpg": PolicyLossConfig(variant="gpg"),
    # (one case for two things, to keep the launches short: each case is a forward-backward)
    "grpo_dual_clip_dr_grpo": PolicyLossConfig(variant="grpo", clip_low=0.1, clip_high=0.2,
                                               clip_ratio_c=1.3,
                                               aggregation="seq_mean_token_sum_norm"),
    "gspo_luspo": dataclasses.replace(GSPO, aggregation="seq_mean_token_sum"),
}
VARIANTS = {**_NAMED, **{v: PolicyLossConfig(variant=v) for v in LOSSES
                         if v != "gspo" and all(c.variant != v for c in _NAMED.values())}}
RESPONSE_BUDGET = 32  # Dr. GRPO's constant (the sequence length here)
# R2 (routing replay of the old policy's routes), run last: the old-log-prob pass records the
# routes under the reference weights; the update then runs on the *moved* weights (reference +
# 0.5 std noise, saved once by --make-reference) replaying them, so routes differ from what free
# routing would pick (the "routing/changed_fraction" of the metrics says how many).
# R3 likewise, with a partial store as the rollout engine's (whose routes cover every token but
# each sequence's last): here a third of the positions are unknown, (row + position) % 3 == 0, so
# the free routing there changes the loss (an unknown last token would not: its output is never
# scored) and the known mask is exercised in every layout's shards.
R2, R3 = "r2", "r3"
CASES = (*CORRECTIONS, *VARIANTS, R2, R3)


def moved_weights(weights: str) -> str:
    return weights.rstrip("/") + "_moved"


def tiny_model(aux_loss: bool = True):
    # Dense layer between MoE layers, 4 experts top-2: exercises both MLP kinds and the router.
    extra = {} if aux_loss else {"moe_aux_loss_coeff": 0.0}
    return model_config_from_preset("tiny", num_layers=4, moe_layer_freq=[1, 0, 1, 1], seq_length=32,
                                    **extra)


def fixed_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 30, (BATCH,), generator=gen)
    seqs = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]
    prompt_lens = torch.randint(2, 6, (BATCH,), generator=gen).tolist()
    batch = make_policy_batch(seqs, prompt_lens, pad_id=0, seq_length=32)
    batch.advantages = torch.randn(BATCH, generator=gen)
    # pi_old differs from pi by a per-token perturbation so ratios, clipping and KL are non-trivial.
    noise = 0.3 * torch.randn(batch.tokens.shape, generator=gen)
    # pi_rollout differs from pi_old the same way (drawn last: the draws above are unchanged).
    rollout_noise = 0.3 * torch.randn(batch.tokens.shape, generator=gen)
    # Per-token advantages for GSPO-token (drawn last again).
    token_advantages = torch.randn(batch.tokens.shape, generator=gen)
    return batch, noise, rollout_noise, token_advantages


def compare_grads(reference_out: str, other_outs) -> dict:
    """The largest |grad - grad_ref| and the reference's gradient scale for each layout (key: its
    out dir) and each of its cases (key: ``<out dir>:<case>``), from the runs' ``grads.pt``."""
    report = {}
    for case in ("", *CASES):
        ref = torch.load(os.path.join(reference_out, case, "grads.pt"), weights_only=True)
        for d in other_outs:
            path = os.path.join(d, case, "grads.pt")
            if not os.path.isfile(path):
                continue  # a case this layout does not run (R2 with packing at TP > 1)
            got = torch.load(path, weights_only=True)
            assert got.keys() == ref.keys(), (d, case, sorted(got.keys() ^ ref.keys()))
            diffs = {k: (v - ref[k]).abs().max().item() for k, v in got.items()}
            worst = max(diffs, key=diffs.get)
            report[f"{d}:{case}" if case else d] = {
                "max_abs_diff": diffs[worst], "worst_param": worst,
                "ref_scale": max(v.abs().max().item() for v in ref.values()),
                "num_params": len(diffs)}
    return report


def save_run(policy, groups, out, metrics):
    """The minibatch metrics (one rank) and the reduced gradients, whole, to ``out``."""
    os.makedirs(out, exist_ok=True)
    if groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0:
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    grads_to_params(policy.unwrapped())  # overwrites the weights: restore them before reusing
    grads = full_state(policy.unwrapped())
    if grads is not None:
        torch.save(grads, os.path.join(out, "grads.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=BATCH)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="pack every pass into microbatches of at most this many tokens")
    ap.add_argument("--balance", action="store_true",
                    help="deal the batch to data-parallel ranks by tokens (balance_across_ranks: "
                         "unequal splits of the rows) instead of rank r taking rows r*n..")
    ap.add_argument("--no-aux-loss", action="store_true",
                    help="MoE load-balancing loss off (it depends on the microbatch composition, "
                         "which packing changes)")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--make-reference", action="store_true")
    args = ap.parse_args()

    model_cfg = tiny_model(aux_loss=not args.no_aux_loss)
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                              expert_model_parallel_size=args.ep, context_parallel_size=args.cp,
                              sequence_parallel=args.tp > 1)
    groups = initialize_distributed(parallel, model_cfg, seed=1234)
    policy = build_policy(model_cfg, parallel, PrecisionConfig(transformer_impl="local"), OptimConfig(),
                          groups, total_steps=1, with_optimizer=False,
                          max_tokens_per_microbatch=args.max_tokens)
    if args.make_reference:
        save_model_weights(policy.unwrapped(), args.weights)
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():  # the policy after some updates: R2's update weights
            for p in policy.unwrapped().parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
        save_model_weights(policy.unwrapped(), moved_weights(args.weights))
        destroy_distributed()
        return
    load_model_weights(policy.unwrapped(), args.weights)
    reference_params = list(policy.unwrapped().parameters())
    reference_weights = [p.detach().clone() for p in reference_params]

    def restore_weights():  # the reference weights again (save_run overwrote them)
        with torch.no_grad():
            for p, w in zip(reference_params, reference_weights):
                p.copy_(w)

    batch, noise, rollout_noise, token_advantages = fixed_batch(seed=7)
    per_rank = BATCH // groups.dp_size
    rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    if args.balance:  # trainer.balance_data_parallel's rule, on the fixed batch's lengths
        lengths = batch.layout.lengths.view(groups.dp_size, per_rank).tolist()
        plan = balance_across_ranks(lengths, 1)
        rows = torch.tensor([src * per_rank + pos for src, pos in plan.sources[groups.dp_rank][0]])
        print("BALANCE " + json.dumps({"rank": groups.dp_rank, "rows": rows.tolist(),
                                       "before": plan.tokens_before, "after": plan.tokens_after}))
    local = batch.select(rows)
    scoring = ScoringConfig(vocab_size=VOCAB)
    # Padded microbatches of --micro-batch-size rows, or packed ones under --max-tokens.
    # (The policy's rule for the packed row's rounding: SP, x 2 CP per sequence under CP.)
    batching = dataclasses.replace(policy.batching, micro_batch_size=args.micro_batch_size)
    # Old log-probs from the reference weights themselves (same for every layout up to float error).
    logprobs, _ = compute_logprobs(policy.model, local, batching, scoring, groups)
    if logprobs is not None:
        local.old_logprobs = (logprobs + noise[rows] * local.response_mask).detach()
        local.rollout_logprobs = local.old_logprobs + rollout_noise[rows] * local.response_mask
    else:  # non-last pipeline stages never read them
        local.old_logprobs = torch.zeros(local.tokens.shape)
        local.rollout_logprobs = torch.zeros(local.tokens.shape)

    loss_cfg = GSPO
    policy.zero_grad()
    metrics = train_minibatch(policy.model, local, batching, loss_cfg, scoring, groups)

    os.makedirs(args.out, exist_ok=True)
    # What this rank holds, for the layout planner's exact parameter counts.
    params = dict(policy.unwrapped().named_parameters())
    expert = sum(p.numel() for n, p in params.items() if ".experts." in n)
    with open(os.path.join(args.out, f"params_rank{groups.rank}.json"), "w") as f:
        json.dump({"pp_rank": groups.pp_rank,
                   "dense": sum(p.numel() for p in params.values()) - expert, "expert": expert}, f)
    save_run(policy, groups, args.out, metrics)

    for case, correction in CORRECTIONS.items():
        restore_weights()
        policy.zero_grad()
        metrics = train_minibatch(policy.model, local, batching, loss_cfg, scoring,
                                  groups, correction=correction)
        save_run(policy, groups, os.path.join(args.out, case), metrics)
    for case, variant_cfg in VARIANTS.items():
        restore_weights()
        policy.zero_grad()
        mb = local
        if variant_cfg.variant == "gspo_token":
            mb = local.select(slice(None))
            mb.advantages = token_advantages[rows]
        metrics = train_minibatch(policy.model, mb, batching, variant_cfg, scoring, groups,
                                  response_budget=RESPONSE_BUDGET)
        save_run(policy, groups, os.path.join(args.out, case), metrics)
    if not (args.max_tokens and args.tp > 1):  # packed rows' routes at TP > 1: refused
        for case in (R2, R3):
            restore_weights()
            run_replay(case, policy, groups, local, rows, batching, scoring, args)
    destroy_distributed()


def run_replay(case, policy, groups, local, batch_rows, batching, scoring, args):
    """R2 / R3: routes recorded by a log-prob pass under the reference weights (for R3 only
    those of every token but each sequence's last: a partial store, as the engine's), replayed
    by the GSPO update on the moved weights."""
    routing = policy.model_routing  # (packed: route stores of whole rows)
    recorder = routing.recorder()
    compute_logprobs(policy.model, local, batching, scoring, groups, routing=recorder)
    store = recorder.store()
    if case == R3:  # rows of the whole batch, so every layout marks the same tokens
        t = local.seq_length
        rows = torch.arange(BATCH)[batch_rows]
        known = (rows[:, None] + torch.arange(t)[None, :]) % 3 != 0
        store.known = known[:, routing.local_positions(t)].contiguous()
    load_model_weights(policy.unwrapped(), moved_weights(args.weights))
    policy.zero_grad()
    hooks = routing.replayer(store, args.micro_batch_size, capture_natural=True)
    metrics = train_minibatch(policy.model, local, batching, GSPO, scoring, groups, routing=hooks)
    natural = hooks.natural_store().indices
    changed = torch.tensor([float((natural != store.indices).any(-1).sum()),
                            float(natural[..., 0].numel())])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(changed)
    metrics["routing/changed_fraction"] = float(changed[0] / changed[1])
    save_run(policy, groups, os.path.join(args.out, case), metrics)


if __name__ == "__main__":
    main()
