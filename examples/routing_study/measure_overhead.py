#!/usr/bin/env python
"""Step-time overhead of R2 routing replay and of the routing diagnostics on the tiny recipe.

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/measure_overhead.py \
        --init-weights runs/routing_study/sft/sft_weights

Runs ``tiny_grpo.yaml`` four ways from the same weights and seed (replay none/r2 x diagnostics
off/on), ``--steps`` RL steps each, repeated ``--repeats`` times in interleaved order, and prints
the median over steps 1.. (step 0 warms up) of ``perf/step_s``, ``perf/old_logprobs_s`` (the pass
that records routes), ``perf/update_s`` and ``perf/routing_diagnostics_s``, plus the size of the
stored routes. Writes the table as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "baseline": ["--routing.replay=none", "--routing.diagnostics=false"],
    "r2": ["--routing.replay=r2", "--routing.diagnostics=false"],
    "diagnostics": ["--routing.replay=none", "--routing.diagnostics=true"],
    "r2+diagnostics": ["--routing.replay=r2", "--routing.diagnostics=true"],
    "diagnostics_no_gap": ["--routing.replay=none", "--routing.diagnostics=true",
                           "--routing.replay_gap=false"],
}
KEYS = ("perf/step_s", "perf/old_logprobs_s", "perf/update_s", "perf/routing_diagnostics_s")


def run(name, out, args, rep):
    run_dir = os.path.join(out, f"{name}_{rep}")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "--config",
           os.path.join(ROOT, "examples", "configs", "tiny_grpo.yaml"),
           f"--logging.run_dir={run_dir}", "--logging.progress=false", "--sft.steps=0",
           "--data.num_train_examples=500", "--data.num_eval_examples=60",  # as the study (tokenizer)
           f"--trainer.steps={args.steps}", f"--optim.lr={args.lr}",
           *([f"--checkpoint.init_weights={args.init_weights}"] if args.init_weights else []),
           *VARIANTS[name]]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    return rows[1:]


def in_process(repeats: int = 5) -> dict:
    """CPU time (``time.process_time``: robust to other jobs on a shared machine) of one RL step's
    trainer work on the tiny model with the tiny recipe's batch (16 x 8 sequences of 24 tokens,
    4 minibatches of 2 microbatches): old-logprob pass, 4 x (forward+backward + optimiser step),
    with and without R2, and the diagnostics per step."""
    import time

    import torch

    from gspo_megatron.algorithms import PolicyGradientObjective
    from gspo_megatron.config import DEMO_RECIPE, load_config
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
    from gspo_megatron.backends.megatron.parallel import initialize_distributed
    from gspo_megatron.backends.megatron.routing.replay import ModelRouting
    from gspo_megatron.backends.megatron.routing.diagnostics import routing_diagnostics
    from gspo_megatron.policy import make_policy_batch
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs

    cfg = load_config(DEMO_RECIPE)  # the demo's loss and optimiser
    cfg.loss = type(cfg.loss)(variant="grpo", clip_low=0.2, clip_high=0.27)
    model = model_config_from_preset("tiny")
    groups = initialize_distributed(ParallelConfig(), model, seed=1)
    policy = build_policy(model, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(lr=1e-4), groups, total_steps=1000)
    routing = ModelRouting(policy.model, groups)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (int(n),), generator=gen).tolist()
            for n in torch.randint(14, 24, (128,), generator=gen)]
    batch = make_policy_batch(seqs, [10] * 128, pad_id=0)
    batch.advantages = torch.randn(128, generator=gen)
    scoring, mbs, per = ScoringConfig(vocab_size=100), 16, 32
    policy.micro_batch_size, policy.scoring = mbs, scoring  # as the trainer builds it
    objective = PolicyGradientObjective(cfg.loss)

    def step(replay: bool, diagnose: bool) -> dict:
        t = {}
        c = time.process_time()
        rec = routing.recorder() if (replay or diagnose) else None
        batch.old_logprobs, _ = compute_logprobs(policy.model, batch, mbs, scoring, groups, routing=rec)
        store = rec.store() if rec else None
        t["old_logprobs"] = time.process_time() - c
        c = time.process_time()
        diag = 0.0
        for i in range(4):
            mb = batch.select(slice(i * per, (i + 1) * per))
            policy.zero_grad()
            policy.train_minibatch(mb, objective, routing=routing.replayer(
                store.select(slice(i * per, (i + 1) * per)), mbs) if replay else None)
            policy.optimizer_step()
            if diagnose:
                d = time.process_time()
                routing_diagnostics(policy.model, routing, mb, store.select(slice(i * per, (i + 1) * per)),
                                    mbs, scoring, groups, objective.clipped_positions)
                diag += time.process_time() - d
        t["update_incl_diag"] = time.process_time() - c
        t["diagnostics"] = diag
        t["total"] = t["old_logprobs"] + t["update_incl_diag"]
        return t

    variants = {"baseline": (False, False), "r2": (True, False), "diagnostics": (False, True),
                "r2+diagnostics": (True, True)}
    step(False, False)  # warm-up
    res = {n: [] for n in variants}
    for _ in range(repeats):
        for n, (r, d) in variants.items():
            res[n].append(step(r, d))
    out = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in res.items()}
    print(f"{'variant':<16}{'old_logprobs':>14}{'update(+diag)':>15}{'diagnostics':>13}{'total':>9}{'vs base':>9}")
    for n, t in out.items():
        t["overhead_vs_baseline"] = t["total"] / out["baseline"]["total"] - 1
        print(f"{n:<16}{t['old_logprobs']:>14.4f}{t['update_incl_diag']:>15.4f}{t['diagnostics']:>13.4f}"
              f"{t['total']:>9.4f}{100 * t['overhead_vs_baseline']:>8.1f}%")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--in-process", action="store_true",
                    help="CPU-time breakdown of the trainer work in this process (no rollouts)")
    ap.add_argument("--init-weights", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "routing_overhead"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from gspo_megatron.tools.provenance import git_commit, utc_now

    record = {"settings": vars(args), "command": " ".join([sys.executable, *sys.argv]),
              "commit": git_commit(), "machine": f"{os.cpu_count()} CPU cores"}
    if args.in_process:
        out = in_process(args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**record, "date": utc_now(), "median_cpu_s": out}, f, indent=2)
        return 0
    rows: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    for rep in range(args.repeats):
        for name in VARIANTS:
            rows[name] += run(name, args.out, args, rep)
    table = {}
    for name, rs in rows.items():
        table[name] = {k: statistics.median([r[k] for r in rs if k in r]) if any(k in r for r in rs)
                       else 0.0 for k in KEYS}
    base = table["baseline"]["perf/step_s"]
    print(f"{'variant':<20}" + "".join(f"{k.split('/')[1]:>24}" for k in KEYS) + f"{'vs baseline':>14}")
    for name, t in table.items():
        t["overhead_vs_baseline"] = t["perf/step_s"] / base - 1
        print(f"{name:<20}" + "".join(f"{t[k]:>24.4f}" for k in KEYS)
              + f"{100 * t['overhead_vs_baseline']:>13.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**record, "date": utc_now(), "median_s": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
