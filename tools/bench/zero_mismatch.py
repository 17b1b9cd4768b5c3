"""Benchmark: zero mismatch (``precision.batch_invariant``), where the mismatch comes from and what
the mode costs.

    python -m tools.bench.zero_mismatch [--rounds 11] [--batch 64] [--new-tokens 16] [--threads 1]
        [--rollout-reps 5]

**Where** (``probe`` rows, the mode off): each op of the tiny model's forward computed as the
rollout's decoding step computes it and as the trainer's packed forward does, on the same random
inputs of the model's shapes, fp32 and bf16; a row is the share of output values whose bits
differ (0: the two paths agree on this op here). The ops: a matmul of ``m = 1..9`` rows against
the same rows inside a 64-row call (the issue's "3 of 9"); the decoding step's batch (16 rows) vs
the packed training row (64); the QK-norm (fused in the step, per module in training); attention
over the KV cache (one query, SDPA with the query heads folded) vs the packed row's causal SDPA;
the router's GEMM; the experts (every expert over every token, ``bmm``, in the step vs grouped
GEMMs over the routed rows in training); the log-softmax (the sampler's ``log_softmax`` vs the
trainer's chunked log-sum-exp).

**Cost** (the mode on vs off, one process, interleaved rounds A, B, B, A, ...): two policies with
the same initial weights, each with its dynamic engine (``decode_steps_per_sync`` 16, the step
function); the rollout (``batch`` prompts of 4-8 tokens, ``new_tokens`` sampled at temperature 1;
``rollout_reps`` of them per round, timed together) and the training phase as the trainer runs
it (old-policy log-prob pass, then ``update_stage`` with the demo's loss, 4 minibatches of packed
microbatches); CPU time of this single-threaded
process and wall clock, each ratio's median and range over the rounds. Decoding tokens/s:
generated tokens per second of rollout. Each side's ``mismatch/tokens_differ`` (rollout vs its
trainer's old pass) is reported as the check.
"""

from __future__ import annotations

import statistics
import types

TARGET = 1.3


def _share_differ(a, b) -> float:
    return float((a != b).float().mean())


def probe(seed: int = 0) -> list[tuple[str, float, float]]:
    """``(op, share differing fp32, share differing bf16)`` for each op of the module docstring."""
    import torch
    import torch.nn.functional as F

    from gspo_megatron.backends.megatron.kernels import decode
    from gspo_megatron.backends.megatron.kernels.row_attention import packed_sdpa
    from gspo_megatron.backends.megatron.logprobs import vocab_parallel_logprobs

    H, heads, groups, hn, E, k, Fh, V = 64, 4, 2, 16, 4, 2, 64, 128  # the tiny preset
    out = []
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        x, w = rnd(64, H), rnd(192, H)
        full = F.linear(x, w)
        small = [_share_differ(F.linear(x[:m], w), full[:m]) for m in range(1, 10)]
        rows.setdefault("matmul: m rows alone vs inside 64 rows, m = 1..9 (count of m that "
                        "differ)", []).append(float(sum(s > 0 for s in small)))
        rows.setdefault("matmul: the step's 16 rows vs the packed row's 64", []).append(
            _share_differ(F.linear(x[:16], w), full[:16]))
        qk, wq = rnd(16, heads + groups, hn).float(), torch.rand(hn, generator=g) + 0.5
        rows.setdefault("QK-norm: fused (step) vs per module (training)", []).append(
            _share_differ(F.rms_norm(qk, (hn,), None, 1e-6) * wq, F.rms_norm(qk, (hn,), wq, 1e-6)))
        # attention: 8 sequences of 8 tokens, packed; the step reads each token's cached keys
        L, n = 8, 8
        q, kk, v = rnd(n * L, heads, hn), rnd(n * L, groups, hn), rnd(n * L, groups, hn)
        params = types.SimpleNamespace(cu_seqlens_q=torch.arange(0, n * L + 1, L),
                                       cu_seqlens_q_padded=None)
        packed = packed_sdpa(q, kk, v, params, hn ** -0.5)  # [S, np, hn]
        w_fake = types.SimpleNamespace(groups=groups, softmax_scale=hn ** -0.5, invariant=False)
        keys = kk.view(n, L, groups, hn)
        vals = v.view(n, L, groups, hn)
        t = torch.arange(L)
        step = torch.stack([decode._grouped_sdpa(
            w_fake, q.view(n, L, heads, hn)[:, j].unsqueeze(2), keys, vals,
            (t <= j).expand(n, 1, L)).squeeze(2) for j in range(L)], 1).reshape(n * L, heads, hn)
        rows.setdefault("attention: KV cache, one query (step) vs packed causal row (training)",
                        []).append(_share_differ(step, packed))
        router = torch.randn(E, H, generator=g)
        y = x.float()
        rows.setdefault("router GEMM (fp32): the step's 16 rows vs 64", []).append(
            _share_differ(torch.mm(y[:16], router.t()), torch.mm(y, router.t())[:16]))
        # experts: top-k of the router, dense bmm (step) vs grouped GEMMs (training)
        logits = torch.mm(y[:16], router.t())
        probs, top = torch.topk(torch.softmax(logits, -1), k, dim=1)
        w1, w2 = rnd(E, 2 * Fh, H), rnd(E, H, Fh)
        weights = torch.zeros(16, E).scatter(1, top, probs)
        w_act = types.SimpleNamespace(gated=True, activation=F.silu, glu_offset=0.0)
        layer = types.SimpleNamespace(w1=w1.transpose(1, 2), w2=w2.transpose(1, 2))
        dense = decode._dense_experts(w_act, layer, x[:16], weights)
        grouped = torch.zeros(16, H, dtype=dtype)
        for e in range(E):  # the training path's per-expert rows, added in expert order
            sel = (top == e).nonzero()
            if len(sel):
                h = F.linear(x[:16][sel[:, 0]], w1[e])
                a = (F.silu(h[:, :Fh]) * h[:, Fh:] * probs[sel[:, 0], sel[:, 1]][:, None]).to(dtype)
                grouped.index_add_(0, sel[:, 0], F.linear(a, w2[e]))
        rows.setdefault("experts: dense bmm (step) vs routed rows (training)", []).append(
            _share_differ(dense, grouped))
        lg = (torch.randn(64, V, generator=g) * 3).to(dtype).float()
        tgt = torch.randint(0, V, (64,), generator=g)
        a = torch.log_softmax(lg, -1).gather(1, tgt[:, None]).squeeze(1)
        b = vocab_parallel_logprobs(lg, tgt, compute_entropy=False)[0]
        rows.setdefault("log-softmax: sampler's log_softmax vs trainer's chunked "
                        "log-sum-exp", []).append(_share_differ(a, b))
    return [(name, v[0], v[1]) for name, v in rows.items()]


def _measure(rounds: int, batch: int, new_tokens: int, rollout_reps: int):
    import time

    import torch

    from gspo_megatron.algorithms.objectives import tokens_differ
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import DEMO_RECIPE, RolloutConfig, load_config
    from gspo_megatron.config.model import model_config_from_preset
    from gspo_megatron.gc_watch import GcWatch
    from gspo_megatron.policy import make_policy_batch
    from gspo_megatron.stages import batch_stage, update_stage
    from tools.bench import _model

    cfg = model_config_from_preset("tiny", seq_length=64)
    tcfg = load_config(DEMO_RECIPE)
    temperature = tcfg.rollout.temperature
    gen = torch.Generator().manual_seed(0)
    eos = cfg.vocab_size - 1
    prompts = [torch.randint(1, eos, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 9, (batch,), generator=gen)]
    advantages = torch.randn(batch, generator=gen)
    times = {n: [] for n in ("rollout_on", "rollout_off", "train_on", "train_off")}
    cpu = {n: [] for n in times}
    generated, differ = {}, {}
    tokens = {"on": [], "off": []}  # per round: a rollout's generated tokens
    with _model.distributed(cfg) as groups:
        pols = {side: _model.policy(cfg, groups, batch_invariant=(side == "on"))
                for side in ("on", "off")}
        engines = {}
        for side, pol in pols.items():
            pol.micro_batch_size, pol.scoring.vocab_size = tcfg.trainer.micro_batch_size, None
            engines[side] = RolloutEngine(
                pol.model, groups, eos_id=eos, pad_id=0, vocab_size=cfg.vocab_size,
                config=RolloutConfig(max_new_tokens=new_tokens, max_batch_size=batch,
                                     temperature=temperature),
                max_sequence_length=cfg.seq_length)
        samples = {}
        gc_watch = GcWatch()
        gc_watch.freeze()  # as the trainer (trainer.gc_freeze): no full collection in a round

        def rollout(side):  # rollout_reps times (the same prompts and seed): a phase of
            for _ in range(rollout_reps):  # ~0.1 s alone is at the mercy of the host's noise
                samples[side] = engines[side].generate(prompts, seed=0)
            generated[side] = sum(len(s.response_ids) for s in samples[side])

        def train(side):
            pol = pols[side]
            data = batch_stage(samples[side], advantages, lambda seqs, plens: make_policy_batch(
                seqs, plens, pad_id=0))
            lp = pol.logprobs(data, temperature=temperature)
            differ[side] = tokens_differ(lp, data.rollout_logprobs,
                                         data.response_mask)["mismatch/tokens_differ"]
            data.old_logprobs = lp
            update_stage(pol, data, tcfg, seed=0, step=0)

        for r in range(1 + rounds):  # one warm-up round; A, B, B, A, ...
            for phase in (rollout, train):
                for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    if phase is rollout:  # untimed: the caches the training phase left cold
                        engines[side].generate(prompts, seed=0)
                    w, c = time.perf_counter(), time.process_time()
                    phase(side)
                    w, c = time.perf_counter() - w, time.process_time() - c
                    if r:
                        key = f"{phase.__name__}_{side}"
                        n = rollout_reps if phase is rollout else 1
                        times[key].append(w / n)
                        cpu[key].append(c / n)
                        if phase is rollout:
                            tokens[side].append(generated[side])
                if r == 0:
                    gc_watch.freeze()  # and what the first round built (the engines' contexts)
        gc_watch.close()
        # the weights moved apart after the first update: the check is on the last round's
        # rollout against its own trainer (each side's weights are its own)
    return times, cpu, generated, differ, tokens


def run(smoke: bool = False, rounds: int = 11, batch: int = 64, new_tokens: int = 16,
        threads: int = 1, rollout_reps: int = 5) -> dict:
    import torch

    from tools.bench.common import make_result, median, quiet_megatron, row

    quiet_megatron()
    torch.set_num_threads(threads)
    if smoke:
        rounds, batch, new_tokens, rollout_reps = 1, 8, 4, 1
    rows = [row(f"probe (mode off, fp32 / bf16 share of values differing): {name}",
                f"{a:.3g} / {b:.3g}") for name, a, b in probe()]
    times, cpu, generated, differ, tokens = _measure(rounds, batch, new_tokens, rollout_reps)
    ratios, met = {}, True
    for clock, tt in (("cpu", cpu), ("wall", times)):
        sfx = "" if clock == "cpu" else "_wall"
        lbl = "CPU time" if clock == "cpu" else "wall clock"
        for phase in ("rollout", "rollout per token", "train"):
            name = phase.split()[0]
            if phase == "rollout per token":  # the sides' weights part after the first update:
                # their rollouts sample other tokens (ends), so a rollout is not equal work
                per_round = [(a / na) / (b / nb) for a, b, na, nb in zip(
                    tt["rollout_on"], tt["rollout_off"], tokens["on"], tokens["off"])]
            else:
                per_round = [a / b for a, b in zip(tt[f"{name}_on"], tt[f"{name}_off"])]
            key = f"{phase.replace(' ', '_')}_on_vs_off{sfx}"
            ratios[key] = statistics.median(per_round)
            if clock == "cpu" and phase != "rollout":  # (the rollout: per token)
                met = met and ratios[key] <= TARGET
            if phase != "rollout per token":
                rows += [row(f"{phase}, mode off ({lbl})", median(tt[f"{name}_off"]), "s"),
                         row(f"{phase}, mode on ({lbl})", median(tt[f"{name}_on"]), "s")]
            rows += [row(f"{phase} on / off ({lbl}), median of rounds", ratios[key], "x"),
                     row(f"{phase} on / off ({lbl}), range of rounds",
                         f"{min(per_round):.3g}-{max(per_round):.3g}", "x")]
    for side in ("off", "on"):
        rows += [row(f"decoding tokens/s, mode {side} (CPU time)",
                     generated[side] / median(cpu[f"rollout_{side}"]), "tokens/s"),
                 row(f"mismatch/tokens_differ, mode {side} (last round)", differ[side],
                     f"of {generated[side]}")]
    return make_result(
        "zero_mismatch", "Zero mismatch: where the rollout/trainer mismatch comes from, and the "
        "cost of precision.batch_invariant",
        f"rollout (per generated token) and training phase with the mode on <= {TARGET}x off "
        "(median of interleaved rounds, CPU time); mismatch/tokens_differ 0 with the mode on",
        met and differ["on"] == 0,
        rows, ratios, config={"rounds": rounds, "batch": batch, "new_tokens": new_tokens,
                              "threads": threads, "rollout_reps": rollout_reps,
                              "model": "tiny (demo's), seq_length 64"},
        notes=[f"{rounds} interleaved rounds after 1 warm-up; torch threads {threads}; "
               f"batch {batch} prompts of 4-8 tokens, {new_tokens} new tokens, temperature 1; "
               f"a round's rollout phase: {rollout_reps} rollouts, timed together; tokens per "
               f"rollout, off / on: {statistics.median(tokens['off'])} / "
               f"{statistics.median(tokens['on'])} (median)"])


def _args(ap) -> None:
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rollout-reps", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
