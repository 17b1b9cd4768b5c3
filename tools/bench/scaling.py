"""Benchmark: how the RL step and its stages grow with response length and group size.

    python -m tools.bench.scaling [--steps 2] [--lengths 16,64,256] [--groups 4,8,16]

TRL's workload of :mod:`tools.bench.trl_peer` (random Qwen3-MoE, hidden 64, 2 layers, 8 experts
top-2; 16 prompts; 4 optimiser steps per generation; fp32, one thread) with every response
``max_new_tokens`` long (``rollout.ignore_eos``; TRL: ``min_new_tokens``), so the token count is
exactly prompts x group x length: response length 16 -> 256 at group 8, group 4 -> 16 at length 16.
Each point runs our trainer in a fresh process (1 warm-up step, ``--steps`` timed) and, when TRL
is installed, TRL's ``GRPOTrainer`` the same way. Per point: the median step and each stage
(rollout, reward, old log-probs, updates); then each stage's growth factor over the range, so the
stage that grows fastest is visible.
"""

from __future__ import annotations

STAGES = ("rollout", "reward", "old_logprobs", "update")


def run(smoke: bool = False, steps: int = 2, lengths: str = "16,64,256",
        groups: str = "4,8,16") -> dict:
    from tools.bench.common import make_result, median, row, run_child
    from tools.bench.trl_peer import GROUP, NEW_TOKENS, trl_available

    lens = [int(x) for x in str(lengths).split(",")]
    grps = [int(x) for x in str(groups).split(",")]
    if smoke:
        steps, lens, grps = 1, [2], [2]
    points = [(n, GROUP) for n in lens] + [(NEW_TOKENS, g) for g in grps if g != GROUP]
    if smoke:
        points = [(2, 2)]
    sides = ("ours", "trl") if trl_available() and not smoke else ("ours",)
    results: dict[str, dict] = {}
    for new_tokens, group in points:
        for side in sides:
            args = ["--side", side, "--steps", str(steps), "--new-tokens", str(new_tokens),
                    "--group", str(group), "--full-length"] + (["--smoke"] if smoke else [])
            results[f"{side} n={new_tokens} G={group}"] = run_child("tools.bench.trl_peer", args)
    rows, config = [], {"points": points, "steps": steps, "sides": list(sides)}
    med: dict[tuple, dict[str, float]] = {}
    for (new_tokens, group) in points:
        for side in sides:
            rec = results[f"{side} n={new_tokens} G={group}"]
            m = {"step": median(rec["step_s"]), "rollout": median(rec["rollout_s"]),
                 "tokens": median(rec["rollout_tokens"])}
            if side == "ours":
                m.update({k: median(v) for k, v in rec["stages_s"].items()})
            else:
                m["rest"] = median(rec["updates_s"])
            med[(side, new_tokens, group)] = m
            label = f"{side} n={new_tokens} G={group}"
            rows.append(row(f"{label}: step", m["step"], "s"))
            if side == "ours":
                rows += [row(f"{label}: {k}", m[k], "s") for k in STAGES]
            else:
                rows += [row(f"{label}: rollout", m["rollout"], "s"),
                         row(f"{label}: rest (reward, old log-probs, updates)", m["rest"], "s")]
            rows.append(row(f"{label}: rollout tokens/s", m["tokens"] / m["rollout"], "tok/s"))
        if "trl" in sides:
            ratio = med[("ours", new_tokens, group)]["step"] / med[("trl", new_tokens, group)]["step"]
            rows.append(row(f"n={new_tokens} G={group}: step, ours / TRL", ratio, "x"))
    ratios = {}
    for name, lo, hi in (("length", (min(lens), GROUP), (max(lens), GROUP)),
                         ("group", (NEW_TOKENS, min(grps)), (NEW_TOKENS, max(grps)))):
        if lo == hi or ("ours", *lo) not in med or ("ours", *hi) not in med:
            continue
        a, b = med[("ours", *lo)], med[("ours", *hi)]
        span = f"{name} {lo[0] if name == 'length' else lo[1]} -> {hi[0] if name == 'length' else hi[1]}"
        for k in ("step", *STAGES):
            growth = b[k] / a[k]
            ratios[f"ours_{name}_growth_{k}"] = growth
            rows.append(row(f"ours, {span}: {k} grows", growth, "x"))
        if "trl" in sides:
            growth = med[("trl", *hi)]["step"] / med[("trl", *lo)]["step"]
            ratios[f"trl_{name}_growth_step"] = growth
            rows.append(row(f"TRL, {span}: step grows", growth, "x"))
    config["per_point"] = results
    return make_result(
        "scaling", "RL step and stages vs response length and group size (TRL's workload)",
        "breakdown only (no target)", None, rows, ratios, config=config,
        notes=[f"every response max_new_tokens long; median of {steps} timed steps after 1 "
               "warm-up, one fresh process per point and side; fp32, 1 thread"])


def _args(ap) -> None:
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lengths")
    ap.add_argument("--groups")


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
