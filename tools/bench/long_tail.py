"""Benchmark: rollout cost per real token on long-tailed responses, dynamic vs static engine.

    python -m tools.bench.long_tail [--rounds 3]

Reasoning RL is long-tailed: most responses end early, a few run to the cap. A static batch decodes
until its longest response ends (under expert parallelism until ``max_new_tokens``: its EP ranks
cannot stop early), so its cost follows the longest response; the dynamic engine's packed batch
drops a response the step it ends, so its cost follows the real tokens.

Workload: the tiny preset (2 layers, hidden 64, 4 experts top-2), random weights, 128 prompts of
4-11 tokens per rank, temperature 1, ``max_new_tokens`` 256, sampling over a 24-id vocabulary
(EOS among them), fp32 on CPU, one thread per process. Two batches of the same mean length:

* **long-tailed**: each response as long as the workload's stopping law makes it (EOS at
  ``1 / VOCAB`` per token: geometric lengths, mean ~24, a few past 100), drawn once per rank
  (:func:`_tail_lengths`) and written with ``rollout.ignore_eos`` and per-request budgets, so
  every dynamic engine writes the same tokens (the static engine, which has no per-request
  budget, decodes its own EOS draws: its cost follows its longest anyway); the partial pools
  sample EOS as training does;
* **uniform**: ``rollout.ignore_eos`` with ``max_new_tokens`` = the long-tailed batch's mean
  length, so every response is that long: the same real tokens, no tail.

For each engine (``dynamic``: the default, every prompt in flight at once, multi-step decoding
rounds; ``dynamic_per_step``: the same with Megatron's forward and bookkeeping at every step; ``dynamic_slots32``:
the same engine with 32 request slots for the 128 prompts, a finished response's slot refilled at
once, both batches at that setting; ``static``: Megatron's static batch engine;
``dynamic_partial`` / ``dynamic_partial_keep_kv``: partial rollouts in their steady state,
continued responses prefilled again / continued from the engine's held KV cache, see
:func:`_partial`; their first ``PARTIAL_WARMUP`` steps, before the pool fills, are reported step by
step too) and each
layout (EP=1: one process; EP=2: two gloo ranks, each with its own prompts, in lock-step) it reports
the seconds per real (response) token of each batch and their ratio (the target: <= 1.3x; under
EP=2 both ranks' tokens over the call's time, the uniform length their common mean), the
engine's forward steps against the longest response, and tokens forwarded per real token. The
batches alternate within each round (A, B, B, A, ...); medians over the rounds.
"""

from __future__ import annotations


TARGET = 1.3
ON_POLICY_TARGET = 2.0
"""Issue 48: on-policy long-tailed / uniform, every prompt in flight (from 3.2-4.5x)."""
VOCAB, PROMPTS, NEW_TOKENS = 24, 128, 256
GROUP, PARTIAL_WARMUP, PARTIAL_STEPS = 4, 4, 4
"""Partial rollouts: responses per group, steps before the steady state, timed steps per round
(the uniform batch runs every other step)."""
STEP_TOKENS = 32
"""Tokens per request of the batch-1 / full-batch step-cost calls."""
ENGINES = {"dynamic": dict(engine="dynamic"),
           "dynamic_per_step": dict(engine="dynamic", decode_steps_per_sync=0),
           "static": dict(engine="static"),
           "dynamic_sharded_experts": dict(engine="dynamic", decode_experts="sharded")}
"""``dynamic``: multi-step rounds (``rollout.decode_steps_per_sync``, the default; under EP the
tiny model's experts replicated for decoding, ``rollout.decode_experts`` ``auto``);
``dynamic_per_step``: Megatron's forward and bookkeeping every step (the path before);
``dynamic_sharded_experts`` (EP only): the rounds with each rank's experts its own, two
collectives per MoE layer and step."""
SLOTS = 32
"""Request slots of the continuous-batching variant (``rollout.max_batch_size``), a quarter of the
prompts: the Qwen3-30B-A3B 16k recipe decodes 64 of a rank's 128 responses at once."""


def _child(spec: dict) -> dict:
    """One layout in this process (rank 0 of a torchrun group under EP=2)."""
    import dataclasses
    import os
    import time

    import torch

    from gspo_megatron.backends.megatron.parallel import initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import OptimConfig, RolloutConfig
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
    from tools.bench.common import median, quiet_megatron

    quiet_megatron()
    torch.set_num_threads(1)
    ep, new_tokens, prompts_n, rounds = spec["ep"], spec["new_tokens"], spec["prompts"], spec["rounds"]
    model = model_config_from_preset("tiny", seq_length=16 + new_tokens)
    parallel = ParallelConfig(expert_model_parallel_size=ep)
    groups = initialize_distributed(parallel, model, seed=0)
    torch.manual_seed(0)  # the same random weights on every rank and in every run
    pol = build_policy(model, parallel, PrecisionConfig(transformer_impl="local"),
                       OptimConfig(lr=1e-5), groups, total_steps=1, with_optimizer=False)
    rank = int(os.environ.get("RANK", "0"))
    gen = torch.Generator().manual_seed(1 + rank)  # each EP rank holds different prompts
    prompts = [torch.randint(1, VOCAB - 1, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 12, (prompts_n,), generator=gen)]
    base = RolloutConfig(max_new_tokens=new_tokens, max_batch_size=prompts_n, temperature=1.0)
    engines = {name: RolloutEngine(pol.model, groups, eos_id=VOCAB - 1, pad_id=0,
                                   vocab_size=VOCAB,
                                   config=dataclasses.replace(base, **ENGINES[name]))
               for name in spec["engines"]}
    slots = spec.get("slots")
    if slots:  # continuous batching: fewer request slots than prompts, freed slots refilled
        base_slots = dataclasses.replace(base, engine="dynamic", max_batch_size=slots)
        engines[f"dynamic_slots{slots}"] = RolloutEngine(
            pol.model, groups, eos_id=VOCAB - 1, pad_id=0, vocab_size=VOCAB, config=base_slots)
    out: dict = {}
    if spec.get("partial"):
        out.update(_partial(spec, pol, groups, base, prompts, rounds))
    tail = _tail_lengths(prompts_n, new_tokens, gen)
    for name, eng in engines.items():
        if eng.backend == "dynamic":  # the same long tail for every engine (module docstring)
            lengths = tail
            long_tailed = eng.with_sampling(dataclasses.replace(eng.config, ignore_eos=True))
            long_tailed.generate(prompts, seed=0, budgets=lengths)  # warm-up
        else:  # a static batch runs to its longest response: its own EOS draws
            lengths = [len(s.response_ids) for s in eng.generate(prompts, seed=0)]
            long_tailed = eng
        mean = max(1, round(_world_sum(sum(lengths)) / _world_sum(len(lengths))))
        uniform = eng.with_sampling(dataclasses.replace(eng.config, max_new_tokens=mean,
                                                        ignore_eos=True))
        batches = {"long_tailed": long_tailed, "uniform": uniform}
        budgets = {"long_tailed": lengths if eng.backend == "dynamic" else None, "uniform": None}
        times = {k: [] for k in batches}
        real = {}
        steps = {}
        for r in range(rounds):
            for k in (("long_tailed", "uniform") if r % 2 == 0 else ("uniform", "long_tailed")):
                t = time.perf_counter()
                samples = batches[k].generate(prompts, seed=0, budgets=budgets[k])
                _all_done()
                times[k].append(time.perf_counter() - t)
                real[k] = _world_sum(sum(len(s.response_ids) for s in samples))
                # the dynamic engine's forward steps (EP padding included); a static batch runs
                # as many as its longest response (under EP: max_new_tokens) by construction
                steps[k] = eng.dynamic.steps if eng.backend == "dynamic" else None
        per_token = {k: median(times[k]) / real[k] for k in batches}
        if eng.backend == "dynamic":
            out[f"{name}_step_ms"] = _step_cost(eng, prompts, rounds)
        out[name] = {"seconds": {k: median(v) for k, v in times.items()}, "real_tokens": real,
                     "forward_steps": steps, "longest": _world_max(max(lengths)),
                     "mean_length": mean,
                     "per_token_s": per_token,
                     "ratio": per_token["long_tailed"] / per_token["uniform"]}
    return out


def _tail_lengths(n: int, cap: int, generator) -> list[int]:
    """``n`` response lengths of the long-tailed batch: the workload's own stopping law (a
    random model over ``VOCAB`` ids writes EOS with probability ``1 / VOCAB`` per token, so the
    lengths are geometric, mean ~``VOCAB``), capped at ``cap``, drawn once: every engine writes
    the same tokens (sampled EOS would give each engine a tail of its own: a round draws its
    random numbers in another order than the per-step loop, and one longest response of 90 or
    169 tokens moves the ratio by 2x)."""
    import math

    import torch

    u = torch.rand(n, generator=generator, dtype=torch.float64)
    steps = torch.floor(torch.log(u) / math.log(1 - 1 / VOCAB)) + 1
    return steps.clamp(1, cap).long().tolist()


def _all_done() -> None:
    """Wait for every rank (EP = 2): a call ends for the job when its slowest rank's does (with
    the experts replicated for decoding, the ranks step alone and return at their own end)."""
    import torch

    from gspo_megatron.distributed import process_group_size

    if process_group_size() > 1:
        torch.distributed.barrier()


def _world_max(x: int) -> int:
    """``x``'s maximum over the ranks."""
    import torch

    from gspo_megatron.distributed import all_reduce_

    return int(all_reduce_(torch.tensor([x]), None, torch.distributed.ReduceOp.MAX).item())


def _world_sum(x: float) -> float:
    """``x`` summed over the ranks (EP = 2: both ranks' tokens; lock-step makes every rank's
    call last as long as the slowest, so a rank's own tokens would leave the other's out)."""
    import torch

    from gspo_megatron.distributed import all_reduce_

    total = all_reduce_(torch.tensor([float(x)], dtype=torch.float64)).item()
    return round(total) if isinstance(x, int) else total


def _step_cost(engine, prompts: list[list[int]], rounds: int) -> dict:
    """Milliseconds per decoding step at batch 1 and at the whole batch (``STEP_TOKENS`` tokens
    each, ``ignore_eos``; the prefill step included), the two alternating, medians: what the tail
    of a long-tailed rollout (a few requests left) costs per step against a full step."""
    import dataclasses
    import time

    from tools.bench.common import median

    steps = min(STEP_TOKENS, engine.config.max_new_tokens)
    fixed = engine.with_sampling(dataclasses.replace(engine.config, max_new_tokens=steps,
                                                     ignore_eos=True))
    batches = {"batch_1": prompts[:1], f"batch_{len(prompts)}": prompts}
    times: dict = {k: [] for k in batches}
    for r in range(rounds + 1):
        for k, p in batches.items():
            t = time.perf_counter()
            fixed.generate(p, seed=0)
            _all_done()
            if r:  # the first round warms up
                times[k].append(1e3 * (time.perf_counter() - t) / steps)
    return {k: median(v) for k, v in times.items()}


def _partial(spec: dict, pol, groups, base, prompts: list[list[int]], rounds: int) -> dict:
    """Partial rollouts (``rollout.partial_rollouts``, its defaults), without and with
    ``rollout.partial_keep_kv`` (the engine holds the cut requests' KV cache): groups of
    ``GROUP`` responses, a step trains on ``len(prompts) / GROUP`` of them, ``len(prompts)``
    requests kept running, fresh groups joining as responses end; the long-tailed rollout's cost
    per step against the tokens it wrote that step (carried responses included), in the steady
    state (after ``PARTIAL_WARMUP`` steps), against the uniform batch of the same mean length
    (every response that long, ``len(prompts)`` requests, no tail to carry). The two pools and
    the uniform batch take turns step by step, each on an engine of its own (a call on a keep_kv
    pool's engine would drop what it holds, as an evaluation does), so all three see the same
    machine."""
    import dataclasses
    import time

    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.rollouts.partial import PartialRollouts
    from tools.bench.common import median

    need = len(prompts) // GROUP
    cfg = dataclasses.replace(base, engine="dynamic", partial_rollouts=True,
                              prompts_per_step=need, group_size=GROUP)
    cfg = dataclasses.replace(cfg, max_batch_size=cfg.in_flight() * GROUP)  # room for them all

    def build(config):
        return RolloutEngine(pol.model, groups, eos_id=VOCAB - 1, pad_id=0, vocab_size=VOCAB,
                             config=config)
    variants = {name: {"engine": build(dataclasses.replace(cfg, partial_keep_kv=keep)),
                       "pool": PartialRollouts(GROUP, need, cfg.in_flight(), spec["new_tokens"],
                                               keep_kv=keep),
                       "drawn": [0], "rows": []}
                for name, keep in (("dynamic_partial", False), ("dynamic_partial_keep_kv", True))}
    lengths = [len(s.response_ids) for s in build(cfg).generate(prompts, seed=0)]
    mean = max(1, round(_world_sum(sum(lengths)) / _world_sum(len(lengths))))
    uniform = build(dataclasses.replace(cfg, max_new_tokens=mean, ignore_eos=True))

    def drawer(drawn):
        def draw():  # the prompts in turn, one group per prompt
            start, drawn[0] = drawn[0], drawn[0] + need
            return [(start + k) % len(prompts) for k in range(need)]
        return draw
    uni = []
    for step in range(PARTIAL_WARMUP + PARTIAL_STEPS * rounds):
        for v in variants.values():
            t = time.perf_counter()
            _, _, m = v["pool"].rollout(v["engine"], lambda i: prompts[i], drawer(v["drawn"]),
                                        seed=step, step=step)
            _all_done()
            # seconds, written, forwarded, steps, carried, age: every step (the first ones are
            # what a run meets before the pool fills)
            v["rows"].append((time.perf_counter() - t,
                              _world_sum(m["rollout/partial_generated_tokens"]),
                              _world_sum(v["engine"].dynamic.tokens_forwarded),
                              v["engine"].dynamic.steps,
                              m["rollout/partial_carried_share"], m["rollout/partial_max_age"]))
        if step < PARTIAL_WARMUP or step % 2 == 0:  # the uniform batch, interleaved
            t = time.perf_counter()
            uniform.generate(prompts, seed=step)
            _all_done()
            uni.append(time.perf_counter() - t)
    out = {}
    real_uniform = _world_sum(mean * len(prompts))
    uniform_per_token = median(uni) / real_uniform
    for name, v in variants.items():
        first = v["rows"][:PARTIAL_WARMUP]
        # per step from the first on, and over the first k steps together (a user's run so far)
        from_start = [(t / w) / uniform_per_token for t, w, *_ in first]
        so_far = [(sum(t for t, *_ in first[:k + 1]) / sum(w for _, w, *_ in first[:k + 1]))
                  / uniform_per_token for k in range(len(first))]
        times, written, fwd, steps, carried, ages = map(list, zip(*v["rows"][PARTIAL_WARMUP:]))
        per_token = {"long_tailed": sum(times) / sum(written),
                     "uniform": uniform_per_token}
        out[name] = {
            "seconds": {"long_tailed": median(times), "uniform": median(uni)},
            "real_tokens": {"long_tailed": round(median(written)), "uniform": real_uniform},
            "forward_steps": {"long_tailed": median(steps), "uniform": None},
            "longest": max(lengths), "mean_length": mean, "per_token_s": per_token,
            "ratio": per_token["long_tailed"] / per_token["uniform"],
            "carried_share": median(carried), "max_age": max(ages),
            "first_steps_ratio": from_start, "first_steps_cumulative_ratio": so_far,
            "first_steps_carried": [c for *_, c, _ in first],
            # every token written but a response's last is fed back once (a decode token); the
            # rest of what the forwards ran is prefill (fresh prompts, continued prefixes)
            "prefilled_per_written": (sum(fwd) - sum(written)) / sum(written)}
    return out


def run(smoke: bool = False, rounds: int = 3) -> dict:
    from tools.bench.common import make_result, row

    spec = {"new_tokens": 16 if smoke else NEW_TOKENS, "prompts": 8 if smoke else PROMPTS,
            "rounds": 1 if smoke else rounds,
            "engines": ["dynamic", "dynamic_per_step", "static"],
            "slots": 4 if smoke else SLOTS, "partial": True}
    results = {f"ep{ep}": _layout(ep, {**spec, "engines": spec["engines"] + (
        ["dynamic_sharded_experts"] if ep > 1 else [])}) for ep in (1, 2)}
    rows, worst, on_policy = [], 0.0, 0.0
    for layout, per_engine in results.items():
        for name, r in list(per_engine.items()):
            if name.endswith("_step_ms"):
                rows.append(row(f"{layout}, {name[:-len('_step_ms')]}: ms per decoding step, "
                                + " / ".join(k.replace("_", " ") for k in r),
                                " / ".join(f"{v:.3f}" for v in r.values()), "ms"))
                continue
            tag = f"{layout}, {name}"
            lt, un = "long_tailed", "uniform"
            rows += [
                row(f"{tag}: per real token, long-tailed / uniform", r["ratio"], "x"),
                row(f"{tag}: long-tailed rollout ({r['real_tokens'][lt]} real tokens, longest "
                    f"{r['longest']})", r["seconds"][lt], "s"),
                row(f"{tag}: uniform rollout ({r['real_tokens'][un]} real tokens, "
                    f"{r['mean_length']} each)", r["seconds"][un], "s"),
            ]
            if r["forward_steps"][lt] is not None:
                rows.append(row(f"{tag}: forward steps, long-tailed (longest response "
                                f"{r['longest']})", r["forward_steps"][lt], "steps"))
            if "carried_share" in r:
                rows.append(row(f"{tag}: share of a step's trained tokens written in earlier "
                                f"steps (median); oldest group's age, steps",
                                f"{r['carried_share']:.2f}; {r['max_age']:.0f}", ""))
                rows.append(row(f"{tag}: tokens prefilled (continued prefixes, fresh "
                                f"prompts) per token written", r["prefilled_per_written"], "x"))
                rows.append(row(f"{tag}: steps 0..{len(r['first_steps_ratio']) - 1}, each, per "
                                f"real token vs uniform", " / ".join(
                                    f"{x:.2f}" for x in r["first_steps_ratio"]), "x"))
                rows.append(row(f"{tag}: steps 0..k together (a run so far), per real token vs "
                                f"uniform", " / ".join(
                                    f"{x:.2f}" for x in r["first_steps_cumulative_ratio"]), "x"))
            if name == "dynamic_partial_keep_kv":  # the setting for long-tailed runs (the
                worst = max(worst, r["ratio"])  # others: what re-prefill, or waiting, costs)
            if name == "dynamic":  # on-policy, every prompt in flight
                on_policy = max(on_policy, r["ratio"])
    for layout, per_engine in results.items():
        if {"dynamic", "static"} <= set(per_engine):
            d, s = per_engine["dynamic"], per_engine["static"]
            rows.append(row(f"{layout}: long-tailed rollout, dynamic / static time",
                            d["seconds"]["long_tailed"] / s["seconds"]["long_tailed"], "x"))
            rows.append(row(f"{layout}: uniform rollout (equal work), dynamic / static time",
                            d["seconds"]["uniform"] / s["seconds"]["uniform"], "x"))
    return make_result(
        "long_tail", "Rollout cost per real token: long-tailed vs uniform responses",
        f"dynamic engine with partial rollouts (rollout.partial_keep_kv): long-tailed / uniform "
        f"cost per real token <= {TARGET}x at EP=1 and EP=2; on-policy (dynamic, multi-step "
        f"decoding) <= {ON_POLICY_TARGET}x",
        None if smoke else worst <= TARGET and on_policy <= ON_POLICY_TARGET, rows,
        ratios={f"{layout}_{name}": r["ratio"] for layout, per in results.items()
                for name, r in per.items() if "ratio" in r},
        config={**spec, "vocab": VOCAB, "results": results})


def _layout(ep: int, spec: dict) -> dict:
    from tools.bench.common import run_layout

    return run_layout("tools.bench.long_tail", {**spec, "ep": ep}, nproc=ep)


if __name__ == "__main__":
    from tools.bench.common import layout_main

    layout_main(run, _child)
