"""The mismatch frontier's report: the collapse map (source x arm), the mismatch each source makes
against the R3 paper's, the reward curves per arm at the paper's level (Markdown + PNGs +
summary.json).

    python examples/routing_study/mismatch_report.py RUNS_DIR [--out REPORT_DIR]

``RUNS_DIR`` as ``mismatch_frontier.py`` writes it (``mismatch_settings.json``, a run directory
per record). Every run is judged again by :class:`frontier_rules.StabilityRule` against the
warm-up policy's sampled reward, and its numbers are means over its steps up to its collapse
(``frontier_report.judge``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from frontier import Point  # noqa: E402
from frontier_report import judge  # noqa: E402
from frontier_rules import StabilityRule, mean  # noqa: E402
from report import _save  # noqa: E402

from gspo_megatron.tools.routing_report import _matplotlib, read_metrics, series  # noqa: E402

PAPER = {"disagreement": 0.10, "token_disagreement": 0.94, "kl": 1.5e-3}
"""The R3 paper (arXiv 2510.11370) on Qwen3-30B-A3B, bf16 vLLM vs Megatron: router decisions
differing, tokens with a differing route in >= 1 layer, train/inference KL."""
MISMATCH = (  # (stat, metric, column, format)
    ("disagreement", "routing/rollout/change_rate", "routes differing", "{:.2%}"),
    ("token_disagreement", "routing/rollout/token_change_rate", "tokens with a differing route",
     "{:.1%}"),
    ("kl", "kl/rollout_vs_train", "k3 KL rollout vs trainer", "{:.1e}"),
    ("tokens_differ", "mismatch/tokens_differ", "tokens whose log-prob differs, per step", "{:.0f}"),
)
SMOOTH = 5
"""Steps in the reward curves' running mean."""
LEVEL = "fp8_noise"
"""The source at the paper's level of route disagreement: its reward curves are plotted."""


def load(runs_dir: str) -> tuple[dict, list[dict]]:
    path = os.path.join(runs_dir, "mismatch_settings.json")
    if not os.path.exists(path):
        print(f"mismatch report: {runs_dir} has no mismatch_settings.json "
              f"(mismatch_frontier.py writes it)", file=sys.stderr)
        raise SystemExit(2)
    settings = json.load(open(path))
    runs = []
    for seed in settings["seeds"]:
        for source in settings["sources"]:
            for arm in settings["arms"]:
                run_dir = os.path.join(runs_dir, run_dir_of(settings, source, arm, seed))
                verdict = os.path.join(run_dir, "verdict.json")
                if not os.path.exists(verdict):  # not run yet, or still running
                    continue
                summary = os.path.join(run_dir, "summary.json")
                runs.append({"source": source, "arm": arm, "seed": seed,
                             "record": json.load(open(verdict)), "rows": read_metrics(run_dir),
                             "summary": json.load(open(summary)) if os.path.exists(summary)
                             else {}})
    return settings, runs


def run_dir_of(settings: dict, source: str, arm: str, seed: int) -> str:
    """A run's directory under the study's, as ``mismatch_frontier.run_cell`` lays it out:
    ``<source>/<arm>/`` then :meth:`frontier.Point.run_dir` of its base arm."""
    point = Point(settings["base_arms"][arm], settings["lr_factor"], settings["updates"], seed)
    return point.run_dir(os.path.join(source, arm))


def _fmt(values, fmt: str) -> str:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return "-"
    m = fmt.format(sum(vals) / len(vals))
    return m if len(vals) == 1 else f"{m} ({fmt.format(min(vals))}..{fmt.format(max(vals))})"


def plot_map(cells: dict, sources, arms, out: str, plt) -> str:
    fig, ax = plt.subplots(figsize=(1.1 * len(arms) + 2, 0.6 * len(sources) + 1.5))
    share = [[mean(float(r["verdict"].stable) for r in cells.get((s, a), [])) for a in arms]
             for s in sources]
    ax.imshow(share, cmap="RdYlGn", vmin=-0.4, vmax=1.4, aspect="auto")  # light: text reads
    for i, s in enumerate(sources):
        for j, a in enumerate(arms):
            rs = cells.get((s, a), [])
            text = "/".join(str(sum(r["verdict"].status == st for r in rs))
                            for st in ("stable", "degraded", "collapsed"))
            reward = mean(r["verdict"].final_reward for r in rs)
            ax.text(j, i, f"{text}\n{reward:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    ax.set_yticks(range(len(sources)), sources)
    ax.set_title("stable / degraded / collapsed seeds, final reward (mean)")
    return _save(fig, out, "collapse_map.png", plt)


def plot_mismatch(by_source: dict, sources, out: str, plt) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (stat, what, paper) in zip(axes, (
            ("disagreement", "rollout vs trainer routes differing", PAPER["disagreement"]),
            ("kl", "k3 KL rollout vs trainer", PAPER["kl"]))):
        vals = [by_source[s][stat] for s in sources]
        floor = min([v for v in vals if math.isfinite(v) and v > 0] + [paper]) / 10
        ax.bar(range(len(sources)), [v if math.isfinite(v) and v > 0 else 0 for v in vals],
               color="tab:blue")
        for i, v in enumerate(vals):
            if not (math.isfinite(v) and v > 0):  # a log axis has no 0: say it
                ax.text(i, floor * 1.5, "0 (bitwise)" if v == 0 else "n/a", ha="center",
                        fontsize=8)
        top = max([v for v in vals if math.isfinite(v)] + [paper]) * 2
        ax.set_ylim(floor, top)
        ax.axhline(paper, color="tab:red", ls="--", label="R3 paper, Qwen3-30B-A3B")
        ax.set_yscale("log")
        ax.set_xticks(range(len(sources)), sources, rotation=30, ha="right")
        ax.set_title(what)
        ax.legend(fontsize=8)
    return _save(fig, out, "mismatch_per_source.png", plt)


def plot_rewards(runs: list[dict], source: str, arms, start: float, out: str, plt) -> str | None:
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for arm in arms:
        curves = [series(r["rows"], "reward/mean") for r in runs
                  if r["source"] == source and r["arm"] == arm and r["rows"]]
        if not curves:
            continue
        steps = max((c[0] for c in curves), key=len)
        ys = [mean(c[1][i] for c in curves if i < len(c[1])) for i in range(len(steps))]
        # a 5-step running mean: one step's reward is 64 samples' (noisy by ~0.06)
        smooth = [mean(ys[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(ys))]
        ax.plot(steps, smooth, label=arm)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(start, color="grey", ls=":", label="warm-up policy")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"reward (mean over seeds, {SMOOTH}-step running mean)")
    ax.set_title(f"reward per arm, rollouts {source}")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out, f"rewards_{source}.png", plt)


def write_report(runs_dir: str, out: str) -> str:
    settings, runs = load(runs_dir)
    runs = [r for r in runs if r["rows"]]
    if not runs:
        sys.exit(f"mismatch report: no finished runs under {runs_dir}")
    plt = _matplotlib()
    os.makedirs(out, exist_ok=True)
    rule = StabilityRule()
    start = judge(runs, rule, settings.get("start_reward"))
    for run in runs:  # the mismatch numbers over the same steps as judge's stats
        v = run["verdict"]
        upto = run["rows"] if v.status != "collapsed" else \
            [r for r in run["rows"] if r.get("step", 0) <= v.step]
        run["mismatch"] = {stat: mean(r.get(key) for r in upto) for stat, key, _, _ in MISMATCH}
    sources = [s for s in settings["sources"] if any(r["source"] == s for r in runs)]
    arms = [a for a in settings["arms"] if any(r["arm"] == a for r in runs)]
    cells: dict[tuple, list[dict]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        cells.setdefault((run["source"], run["arm"]), []).append(run)
    by_source = {s: {stat: mean(r["mismatch"][stat] for r in runs if r["source"] == s)
                     for stat, _, _, _ in MISMATCH} for s in sources}
    plots = [plot_map(cells, sources, arms, out, plt), plot_mismatch(by_source, sources, out, plt)]
    for level in (LEVEL, f"{LEVEL}_x3"):
        if level in sources:
            plots.append(plot_rewards(runs, level, arms, start, out, plt))

    lr, n = settings["lr"], settings["updates"]
    lines = [f"# Mismatch frontier ({settings['device']}{', smoke' if settings['smoke'] else ''}): "
             f"{len(sources)} sources x {len(arms)} arms x {len(settings['seeds'])} seeds", "",
             f"{len(runs)} of the {len(settings['sources']) * len(settings['arms']) * len(settings['seeds'])} "
             f"planned runs finished (a cell's seeds: those run so far), each up to "
             f"{settings['steps']} RL steps at lr {lr:g} "
             f"(x{settings['lr_factor']:g} of the routing study's), {n} updates per rollout batch; "
             f"the trainer fp32, the rollout engine's numerics per source. Start reward (the "
             f"warm-up policy's sampled reward): {start:.3f}. Rule: as the stability frontier's "
             f"(`frontier_rules.py`): collapsed when a {rule.window}-step window's reward < "
             f"{rule.reward_collapse:g} x the start, its gradient norm > {rule.grad_norm_limit:g}, "
             f"its entropy < {rule.entropy_collapse:g} x step 0's with no reward gain, or anything "
             f"non-finite; degraded when the last {rule.final_window} steps' reward < start - "
             f"{rule.reward_margin:g}.", "",
             "## Collapse map: stable / degraded / collapsed seeds, final reward (mean, min..max)",
             "", "| source | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for s in sources:
        row = []
        for a in arms:
            rs = cells.get((s, a), [])
            counts = "/".join(str(sum(r["verdict"].status == st for r in rs))
                              for st in ("stable", "degraded", "collapsed"))
            row.append(f"{counts}, {_fmt([r['verdict'].final_reward for r in rs], '{:.3f}')}"
                       if rs else "-")
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    lines += ["", "## The mismatch each source makes (mean over its runs' steps, min..max over runs)",
              "", "| source | overrides | " + " | ".join(c for _, _, c, _ in MISMATCH) + " |",
              "|---" * (len(MISMATCH) + 2) + "|"]
    for s in sources:
        rs = [r for r in runs if r["source"] == s]
        lines.append(f"| {s} | `{' '.join(settings['source_overrides'][s])}` | "
                     + " | ".join(_fmt([r["mismatch"][stat] for r in rs], fmt)
                                  for stat, _, _, fmt in MISMATCH) + " |")
    lines.append(f"| R3 paper, Qwen3-30B-A3B | bf16 vLLM vs Megatron | ~{PAPER['disagreement']:.0%} "
                 f"| {PAPER['token_disagreement']:.0%} | {PAPER['kl']:.1e} | - |")
    cal = settings.get("calibration")
    if cal:
        lines += ["", f"## Noise calibration on this warm-up (fp32 rollouts, {cal['steps']} GSPO "
                  f"steps each)", "", "| rollout.router_noise_std | routes differing | tokens with "
                  "a differing route | k3 KL |", "|---|---|---|---|"]
        lines += [f"| {r['std']:g} | {r['disagreement']:.2%} | {r['token_disagreement']:.1%} | "
                  f"{r['kl_rollout_vs_train']:.1e} |" for r in cal["rows"]]
        lines += ["", f"Interpolated (log-log) to {cal['target']:.0%}: **{cal['noise_std']:.4g}** "
                  f"(`fp8_noise`); `fp8_noise_x3`: {3 * cal['noise_std']:.4g}."]
    lines += ["", "## Every cell", "", "| source | arm | s/d/c | steps | clipped token share | "
              "grad norm | held-out after | why |", "|---|---|---|---|---|---|---|---|"]
    for (s, a), rs in sorted(cells.items(), key=lambda kv: (sources.index(kv[0][0]),
                                                            arms.index(kv[0][1]))):
        counts = "/".join(str(sum(r["verdict"].status == st for r in rs))
                          for st in ("stable", "degraded", "collapsed"))
        why = next((f"{r['verdict'].reason} (seed {r['seed']}, step {r['verdict'].step})"
                    for r in rs if r["verdict"].status != "stable"), "")
        lines.append(f"| {s} | {a} | {counts} | {'/'.join(str(r['verdict'].steps) for r in rs)} | "
                     f"{_fmt([r['stats']['clip'] for r in rs], '{:.2%}')} | "
                     f"{_fmt([r['stats']['grad_norm'] for r in rs], '{:.2f}')} | "
                     f"{_fmt([r['stats']['accuracy_after'] for r in rs], '{:.3f}')} | {why} |")
    wall = settings["wall_s"]
    lines += ["", "## How it was run", "", "```bash", settings["command"], "```", "",
              f"Common overrides on `examples/configs/routing_study.yaml`: "
              f"`{' '.join(settings['common'])}`; arms' extra overrides: "
              + "; ".join(f"{a}: `{' '.join(o) or '-'}`" for a, o in settings["arm_overrides"].items())
              + f". {settings['jobs']} runs at a time on {settings['machine']}; wall time "
              f"{wall.get('total', 0) / 60:.1f} min (warm-up {wall.get('sft', 0) / 60:.1f} min, "
              f"0 or absent = reused; calibration {wall.get('calibration', 0) / 60:.1f} min; runs "
              f"{wall.get('runs', 0) / 60:.1f} min; runs already done are not run again). "
              f"Date {settings['date']}, commit {settings['commit']}.", ""]
    lines += [f"![{p}]({p})\n" for p in plots if p]
    path = os.path.join(out, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    record = {"settings": settings, "start_reward": start, "mismatch_per_source": by_source,
              "runs": [{k: r[k] for k in ("source", "arm", "seed", "stats", "mismatch")}
                       | {"verdict": r["verdict"].to_dict(), "record": r["record"]}
                       for r in runs]}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs_dir")
    ap.add_argument("--out", default=None, help="default RUNS_DIR/report")
    args = ap.parse_args(argv)
    print(write_report(args.runs_dir, args.out or os.path.join(args.runs_dir, "report")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
