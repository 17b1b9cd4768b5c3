"""Benchmark: training cost per real token on long-tailed batches, padded vs packed microbatches.

    python -m tools.bench.packing [--rounds 3]

Reasoning RL batches are long-tailed: most sequences are short, a few run to the cap. Padded
microbatches (``trainer.micro_batch_size`` sequences right-padded to the batch's longest sequence)
make the training phase cost ``batch x longest``; packed microbatches
(``trainer.max_tokens_per_microbatch``: the sequences concatenated into Megatron ``thd`` rows of
at most that many tokens, :mod:`gspo_megatron.layout`) make it follow the real tokens.

Part 1, measured. Workload: the tiny preset (2 layers, hidden 64, 4 experts top-2), random
weights, fp32, Megatron local spec, one thread per process, a 24-id vocabulary. Per rank, 128
sequences: prompts of 4-11 random tokens; responses of random tokens whose lengths are drawn
directly from a seeded geometric distribution (``P(stop) = 1/19`` per token, mean ~19, capped at
256; the seeds give rank 0 a mean of 19.2 and a longest response of 92, rank 1 21.9 and 114), the
shape of the rollout benchmark's EOS lengths. Two batches with the same prompts:

* **long-tailed**: those response lengths;
* **uniform**: every response the long-tailed batch's mean length (rounded), so the same real
  tokens up to the rounding (both counts are reported), no tail.

"Training phase" = the old-log-prob pass (``policy.logprobs``) + ``num_minibatches`` = 4 updates
(shuffled batch split in 4; ``zero_grad`` + ``train_minibatch`` of the GSPO
``PolicyGradientObjective`` + ``optimizer_step`` each, as ``stages.update_stage`` runs them), in
two modes on one policy (``policy.batching`` switched between them):

* **padded**: ``micro_batch_size`` 16 (``trainer.pack_sequences: false``, the opt-out);
* **packed**: the library default, packed microbatches of ``micro_batch_size x model.seq_length``
  = 16 x 272 = 4,352 tokens (:func:`gspo_megatron.config.token_budget`; what a padded microbatch
  of 16 sequences of the model's length holds), the same budget for both batches.

For each layout (EP=1: one process; EP=2: two gloo ranks, each with its own sequences, in
lock-step) and mode it reports the training phase's seconds, real tokens (prompt + response, all
ranks), tokens computed (the microbatches the model sees, old-log-prob pass + updates, all ranks:
padded ``rows x T`` each, packed ``PackedRows.total`` each; "/ real": over the real tokens of
those passes, each counted in both), microseconds per real token, the ratio long-tailed /
uniform per real token (target <= 1.3x packed; padded shown for comparison) and packed / padded
time on the long-tailed batch. The four variants alternate within each round (A, B, C, D, then
D, C, B, A, ...) after one warm-up round; times are medians over the rounds, ratios medians of
the per-round ratios. Packing removes the padded tokens, not attention's quadratic cost: on the
local spec a packed microbatch's attention (``SDPADotProductAttention``) gathers its ``n``
sequences to its longest, ``n x L^2`` query-key pairs (flash-attn / TE: ``sum len_i^2``), so the
long-tailed batch still pays for its tail there (rank 0's phase: ~1.28M pairs long-tailed,
~0.22M uniform; padded 2.41M and 0.23M).

Part 2, counted (no model): tokens computed / real tokens on a synthetic reasoning-RL length
distribution: 512 responses lognormal with median 2,000 tokens and sigma 1.28 (so ~5% exceed the
16,384 cap, P = 1 - Phi(ln(16384/2000)/1.28) = 5.0%), capped at 16,384, prompts of 256 tokens.
Padded = 512 x the longest sequence (every microbatch padded to the batch's longest); packed =
the sum of ``PackedRows.total`` over ``pack_into_microbatches(lengths, 16384 + 256)`` (also with
rows rounded to a multiple of 8, as TP=8 sequence parallelism would pad them) and the number of
microbatches against the fewest possible (real tokens / budget, rounded up). Target: packed
<= 1.05. Padded is ~4.1x here by construction: the capped mean response is
``e^(mu + sigma^2/2) Phi((ln cap - mu - sigma^2) / sigma) + cap * 5%`` ~ 3,730 tokens, and
16,640 / (256 + 3,730) = 4.17 (this draw: 4.07).

Part 3, counted (no model): data-parallel balance. 8 ranks each sample 64 responses of the same
distribution (512 per step), 4 minibatches: the largest rank's tokens over the mean (worst
minibatch of the step; a packed step runs at its slowest rank's pace), median and worst over 20
steps, without and with ``trainer.balance_data_parallel``
(:func:`gspo_megatron.layout.balance_across_ranks`).
"""

from __future__ import annotations


TARGET, SYNTH_TARGET = 1.3, 1.05
VOCAB, SEQUENCES, MAX_RESPONSE, MEAN_RESPONSE = 24, 128, 256, 19
MICRO_BATCH_SIZE, NUM_MINIBATCHES = 16, 4
SYNTH = {"responses": 512, "median": 2000, "sigma": 1.28, "cap": 16384, "prompt": 256, "seed": 0}


def _child(spec: dict) -> dict:
    """One layout in this process (one rank of a torchrun group under EP=2)."""
    import dataclasses
    import math
    import os

    import torch
    import torch.distributed as dist

    from gspo_megatron.algorithms import PolicyGradientObjective, PolicyLossConfig
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.backends.megatron.schedule import Microbatching, make_microbatches
    from gspo_megatron.config import OptimConfig, TrainConfig, TrainerConfig, token_budget
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
    from gspo_megatron.policy import make_policy_batch
    from tools.bench.common import interleaved, median, quiet_megatron

    quiet_megatron()
    torch.set_num_threads(1)
    ep, n, cap, rounds = spec["ep"], spec["sequences"], spec["max_response"], spec["rounds"]
    mbs = spec["micro_batch_size"]
    model = model_config_from_preset("tiny", seq_length=16 + cap)
    # the library default's budget for this model and micro-batch size
    budget = token_budget(TrainConfig(model=model, trainer=TrainerConfig(micro_batch_size=mbs)))
    parallel = ParallelConfig(expert_model_parallel_size=ep)
    groups = initialize_distributed(parallel, model, seed=0)
    torch.manual_seed(0)  # the same random weights on every rank and in every run
    variants = [(b, m) for m in ("padded", "packed") for b in ("long_tailed", "uniform")]
    pol = build_policy(model, parallel, PrecisionConfig(transformer_impl="local"),
                       OptimConfig(lr=1e-6), groups,
                       total_steps=(rounds + 1) * len(variants) * NUM_MINIBATCHES,
                       micro_batch_size=mbs, vocab_size=VOCAB)
    rank = int(os.environ.get("RANK", "0"))
    gen = torch.Generator().manual_seed(1 + rank)  # each EP rank holds different sequences
    prompts = [torch.randint(1, VOCAB, (int(k),), generator=gen).tolist()
               for k in torch.randint(4, 12, (n,), generator=gen)]
    # geometric response lengths: 1 + floor(ln U / ln(1 - p)), p = 1 / mean, capped
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    p = 1.0 / spec["mean_response"]
    long_lengths = [min(cap, 1 + int(math.floor(math.log(x) / math.log(1 - p))))
                    for x in u.tolist()]
    mean = max(1, round(sum(long_lengths) / n))

    def batch_of(lengths: list[int]):
        seqs = [pr + torch.randint(1, VOCAB, (k,), generator=gen).tolist()
                for pr, k in zip(prompts, lengths)]
        b = make_policy_batch(seqs, [len(pr) for pr in prompts], pad_id=0)
        b.advantages = torch.randn(n, generator=gen)
        return b

    batches = {"long_tailed": batch_of(long_lengths), "uniform": batch_of([mean] * n)}
    modes = {"padded": Microbatching(micro_batch_size=mbs),
             "packed": Microbatching(micro_batch_size=mbs, max_tokens=budget)}
    objective = PolicyGradientObjective(PolicyLossConfig())
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))  # same on every rank
    per_minibatch = n // NUM_MINIBATCHES

    def training_phase(name: str, mode: str) -> None:
        # both passes in the mode (the old-log-prob pass reads its own batching: until 2026-11-27
        # it stayed padded here in both modes, 16 x the longest sequence)
        pol.batching = pol.logprob_batching = modes[mode]
        batch = dataclasses.replace(batches[name])
        batch.old_logprobs = pol.logprobs(batch)
        for mb in batch.select(order).split(per_minibatch):
            pol.zero_grad()
            pol.train_minibatch(mb, objective)
            pol.optimizer_step()

    def computed(name: str, mode: str) -> tuple[int, int, int]:
        """(tokens computed, real tokens, microbatches) of the phase's passes: the old-log-prob
        pass and the updates (each real token twice: once in each)."""
        batch = batches[name]
        passes = [batch, *batch.select(order).split(per_minibatch)]
        micro = [m for b in passes for m in make_microbatches(b, modes[mode], pol.groups)]
        tokens = sum(m.size * m.seq_length if m.packing is None else m.packing.total for m in micro)
        return tokens, sum(m.layout.real_tokens for m in micro), len(micro)

    def world_sum(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return [int(x) for x in t.tolist()]

    counts = {f"{b}/{m}": computed(b, m) for b, m in variants}
    times = interleaved({f"{b}/{m}": (lambda b=b, m=m: training_phase(b, m)) for b, m in variants},
                        rounds=rounds, warmup=1)
    real = dict(zip(batches, world_sum([b.layout.real_tokens for b in batches.values()])))
    response = dict(zip(batches, world_sum([sum(long_lengths), mean * n])))
    longest = {k: int(b.layout.lengths.max()) for k, b in batches.items()}
    longest = dict(zip(longest, (int(x) for x in _world_max(list(longest.values())))))
    world = dist.get_world_size() if dist.is_initialized() else 1
    means = world_sum([mean if r == rank else 0 for r in range(world)])  # each rank's
    out: dict = {"real_tokens": real, "response_tokens": response, "longest": longest,
                 "uniform_response": means, "packed_budget": budget, "modes": {}}
    for m in modes:
        per = {}
        for b in batches:
            tokens, passed, micro = world_sum(list(counts[f"{b}/{m}"]))
            seconds = median(times[f"{b}/{m}"])
            per[b] = {"seconds": seconds, "tokens_computed": tokens, "microbatches": micro,
                      "computed_per_real": tokens / passed,
                      "us_per_real_token": seconds / real[b] * 1e6,
                      "times": [round(x, 4) for x in times[f"{b}/{m}"]]}
        # per round (the two batches ran in the same round), then the median over the rounds
        pairs = zip(times[f"long_tailed/{m}"], times[f"uniform/{m}"])
        per["ratio"] = median((a / real["long_tailed"]) / (b / real["uniform"]) for a, b in pairs)
        out["modes"][m] = per
    pair = zip(times["long_tailed/packed"], times["long_tailed/padded"])
    out["packed_over_padded_long_tailed"] = median(a / b for a, b in pair)
    destroy_distributed()
    return out


def _world_max(values: list[int]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def synthetic(responses: int = 512, median: float = 2000, sigma: float = 1.28, cap: int = 16384,
              prompt: int = 256, seed: int = 0, pad_to_multiple_of: int = 1) -> dict:
    """Part 2: tokens computed / real tokens of one batch, padded and packed (no model)."""
    import math
    import random

    import torch

    from gspo_megatron.layout import PackedRows, pack_into_microbatches

    rng = random.Random(seed)
    resp = [min(cap, max(1, round(rng.lognormvariate(math.log(median), sigma))))
            for _ in range(responses)]
    lengths = [prompt + r for r in resp]
    real = sum(lengths)
    budget = prompt + cap
    bins = pack_into_microbatches(lengths, budget, pad_to_multiple_of)
    packed = sum(PackedRows.of(torch.tensor([lengths[i] for i in b]), pad_to_multiple_of).total
                 for b in bins)
    padded = responses * max(lengths)
    return {"real_tokens": real, "padded_tokens": padded, "packed_tokens": packed,
            "padded_ratio": padded / real, "packed_ratio": packed / real, "microbatches": len(bins),
            "min_microbatches": -(-real // budget), "budget": budget,
            "at_cap": sum(r >= cap for r in resp), "mean_response": sum(resp) / responses,
            "longest": max(lengths), "pad_to_multiple_of": pad_to_multiple_of}


def dp_balance(ranks: int = 8, per_rank: int = 64, minibatches: int = 4, steps: int = 20,
               median: float = 2000, sigma: float = 1.28, cap: int = 16384, prompt: int = 256,
               seed: int = 0) -> dict:
    """Part 3: data-parallel token imbalance (largest rank's tokens / the mean, worst minibatch)
    of ``steps`` synthetic reasoning-RL steps, each rank sampling its own ``per_rank``
    responses, before and after ``trainer.balance_data_parallel``'s exchange (no model)."""
    import math
    import random

    from gspo_megatron.layout import RankBalance, balance_across_ranks

    rng = random.Random(seed)
    before, after = [], []
    for _ in range(steps):
        lengths = [[prompt + min(cap, max(1, round(rng.lognormvariate(math.log(median), sigma))))
                    for _ in range(per_rank)] for _ in range(ranks)]
        plan = balance_across_ranks(lengths, minibatches)
        before.append(RankBalance.imbalance(plan.tokens_before))
        after.append(RankBalance.imbalance(plan.tokens_after))
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"ranks": ranks, "per_rank": per_rank, "minibatches": minibatches, "steps": steps,
            "before_median": mid(before), "before_max": max(before),
            "after_median": mid(after), "after_max": max(after)}


def run(smoke: bool = False, rounds: int = 3) -> dict:
    from tools.bench.common import make_result, row

    spec = {"sequences": 16 if smoke else SEQUENCES, "max_response": 32 if smoke else MAX_RESPONSE,
            "mean_response": 6 if smoke else MEAN_RESPONSE, "rounds": 1 if smoke else rounds,
            "micro_batch_size": 4 if smoke else MICRO_BATCH_SIZE}
    results = {f"ep{ep}": _layout(ep, spec) for ep in (1, 2)}
    synth = {1: synthetic(**SYNTH), 8: synthetic(**SYNTH, pad_to_multiple_of=8)}
    rows, ratios, worst = [], {}, 0.0
    for layout, r in results.items():
        rows += [row(f"{layout} long-tailed: real tokens (longest sequence, any rank: "
                     f"{r['longest']['long_tailed']})", r["real_tokens"]["long_tailed"], "tok"),
                 row(f"{layout} uniform: real tokens (responses of "
                     f"{'/'.join(map(str, r['uniform_response']))} per rank)",
                     r["real_tokens"]["uniform"], "tok")]
        for mode, per in r["modes"].items():
            for b in ("long_tailed", "uniform"):
                v, tag = per[b], f"{layout} {mode} {b.replace('_', '-')}"
                rows += [row(f"{tag}: training phase", v["seconds"], "s"),
                         row(f"{tag}: tokens computed ({v['microbatches']} microbatches)",
                             v["tokens_computed"], "tok"),
                         row(f"{tag}: tokens computed / real", v["computed_per_real"], "x"),
                         row(f"{tag}: time per real token", v["us_per_real_token"], "us")]
            rows.append(row(f"{layout} {mode}: per real token, long-tailed / uniform",
                            per["ratio"], "x"))
            ratios[f"{layout}_{mode}"] = per["ratio"]
            if mode == "packed":
                worst = max(worst, per["ratio"])
        rows.append(row(f"{layout} long-tailed: packed / padded training-phase time",
                        r["packed_over_padded_long_tailed"], "x"))
        ratios[f"{layout}_packed_over_padded_long_tailed"] = r["packed_over_padded_long_tailed"]
    s = synth[1]
    rows += [row(f"synthetic: real tokens ({SYNTH['responses']} seqs, {s['at_cap']} capped, "
                 f"mean resp. {s['mean_response']:.0f})", s["real_tokens"], "tok"),
             row(f"synthetic: padded tokens / real (512 x {s['longest']})", s["padded_ratio"], "x"),
             row(f"synthetic: packed tokens / real (budget {s['budget']})", s["packed_ratio"], "x"),
             row(f"synthetic: packed microbatches (at least {s['min_microbatches']})",
                 s["microbatches"], "mb"),
             row("synthetic: packed tokens / real, rows rounded to 8 (TP=8 SP)",
                 synth[8]["packed_ratio"], "x"),
             row("synthetic: packed microbatches, rows rounded to 8", synth[8]["microbatches"],
                 "mb")]
    bal = dp_balance()
    tag = (f"synthetic DP={bal['ranks']} ({bal['per_rank']} per rank, {bal['minibatches']} "
           f"minibatches, {bal['steps']} steps): largest rank's tokens / mean")
    rows += [row(f"{tag}, unbalanced, median", bal["before_median"], "x"),
             row(f"{tag}, unbalanced, worst", bal["before_max"], "x"),
             row(f"{tag}, balance_data_parallel, median", bal["after_median"], "x"),
             row(f"{tag}, balance_data_parallel, worst", bal["after_max"], "x")]
    ratios.update({"synthetic_padded": s["padded_ratio"], "synthetic_packed": s["packed_ratio"],
                   "synthetic_packed_tp8": synth[8]["packed_ratio"],
                   "dp8_imbalance_unbalanced": bal["before_median"],
                   "dp8_imbalance_balanced": bal["after_median"]})
    met = worst <= TARGET and max(x["packed_ratio"] for x in synth.values()) <= SYNTH_TARGET
    return make_result(
        "packing", "Training cost per real token: long-tailed vs uniform, padded vs packed",
        f"packed: long-tailed / uniform training cost per real token <= {TARGET}x at EP=1 and "
        f"EP=2; synthetic reasoning-RL batch: packed tokens / real <= {SYNTH_TARGET}",
        None if smoke else met, rows, ratios=ratios,
        config={**spec, "vocab": VOCAB, "num_minibatches": NUM_MINIBATCHES, "synthetic": SYNTH,
                "dp_balance": bal,
                "results": results, "synthetic_results": {str(k): v for k, v in synth.items()}},
        notes=[f"{spec['rounds']} rounds after 1 warm-up, variants alternating; medians",
               "real tokens = prompt + response tokens over all ranks; tokens computed = the "
               "microbatches of the old-log-prob pass + the updates (each real token in both), "
               "/ real = over the real tokens of those same passes"])


def _layout(ep: int, spec: dict) -> dict:
    from tools.bench.common import run_layout

    return run_layout("tools.bench.packing", {**spec, "ep": ep}, nproc=ep)


if __name__ == "__main__":
    from tools.bench.common import layout_main

    layout_main(run, _child)
