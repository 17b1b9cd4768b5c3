"""The frontier study's report: per arm the largest stable setting, the stability map, route
change vs learning rate and per-layer route-change heatmaps (Markdown + PNGs + summary.json).

    python examples/routing_study/frontier_report.py RUNS_DIR --out REPORT_DIR

``RUNS_DIR`` as ``frontier.py`` writes it: ``frontier_settings.json`` and
``<arm>/lr_x<f>/updates_<n>/seed_<s>/`` (``metrics.jsonl``, ``verdict.json``, ``summary.json``).
Every run is judged again here by the settings' :class:`frontier_rules.StabilityRule`, with one
start reward for the whole study: the warm-up policy's sampled reward that ``frontier.py``
measured (without it, the mean over seeds of step 0's reward: every run samples step 0 from the
same warm-up weights; one batch of 64 answers is too noisy to be a run's own reference). A run's routing numbers are means over its steps up to the step its
rule fired (all of them when it did not): what led to the collapse, not the wreck after it.
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from frontier_rules import StabilityRule, largest_stable, mean  # noqa: E402
from report import _save  # noqa: E402
from report import main as report_main  # noqa: E402

from gspo_megatron.tools.routing_report import _matplotlib, layer_keys, read_metrics, series  # noqa: E402

STATS = (  # (name, metric, what, format)
    ("route_change_1", "routing/drift/after_1_updates", "routes changed after 1 update", "{:.2%}"),
    ("route_change", "routing/drift/change_rate", "routes changed, mean over the updates", "{:.2%}"),
    ("rollout_disagreement", "routing/rollout/change_rate", "rollout vs trainer routes differing",
     "{:.2%}"),
    ("clip", "clip/token_fraction", "clipped token share", "{:.2%}"),
    ("gate", "gate/weight_mean", "SAPO gate f'(r), mean", "{:.3f}"),
    ("abs_log_ratio_flipped", "routing/abs_log_ratio_changed", "abs token log-ratio, route flipped",
     "{:.4f}"),
    ("abs_log_ratio_kept", "routing/abs_log_ratio_unchanged", "abs token log-ratio, route kept",
     "{:.4f}"),
    ("kl_rollout", "kl/rollout_vs_train", "k3 KL rollout vs trainer", "{:.1e}"),
    ("grad_norm", "optim/grad_norm", "grad norm", "{:.2f}"),
    ("entropy", "entropy/mean", "token entropy", "{:.3f}"),
)
MARKS = {"stable": "", "degraded": "v", "collapsed": "x"}


# ----------------------------------------------------------------------------- loading

def load_runs(runs_dir: str) -> tuple[dict, list[dict]]:
    """``(settings, runs)``: one dict per run directory that has metrics (``arm``, ``lr_factor``,
    ``updates``, ``seed``, ``rows``, ``record``: its ``verdict.json`` or {} while it runs,
    ``summary``)."""
    settings = json.load(open(os.path.join(runs_dir, "frontier_settings.json")))
    size = settings["size"]
    runs = []
    for arm in size["arms"]:
        for f in size["lr_factors"]:
            for n in size["updates"]:
                for s in size["seeds"]:
                    run = os.path.join(runs_dir, arm, f"lr_x{f:g}", f"updates_{n}", f"seed_{s}")
                    rec_path = os.path.join(run, "verdict.json")
                    if not os.path.exists(rec_path):  # not run, or still running
                        continue
                    summ = os.path.join(run, "summary.json")
                    runs.append({"arm": arm, "lr_factor": f, "updates": n, "seed": s,
                                 "rows": read_metrics(run), "record": json.load(open(rec_path)),
                                 "summary": json.load(open(summ)) if os.path.exists(summ) else {}})
    return settings, runs


def study_start_reward(runs: list[dict]) -> float:
    """Mean over seeds of step 0's reward (every run's step 0 samples the warm-up policy)."""
    per_seed: dict[int, list[float]] = {}
    for run in runs:
        if run["rows"]:
            per_seed.setdefault(run["seed"], []).append(run["rows"][0].get("reward/mean"))
    return mean(mean(v) for v in per_seed.values())


def judge(runs: list[dict], rule: StabilityRule, start: float | None = None) -> float:
    """Attach ``verdict`` and ``stats`` to every run; returns the start reward: ``start`` (the
    study's measurement of the warm-up policy) or, without one, :func:`study_start_reward`."""
    start = study_start_reward(runs) if start is None else start
    for run in runs:
        v = rule.verdict(run["rows"], start_reward=start, failed=bool(run["record"].get("failed")))
        run["verdict"] = v
        upto = run["rows"] if v.status != "collapsed" else \
            [r for r in run["rows"] if r.get("step", 0) <= v.step]
        run["stats"] = {name: mean(r.get(key) for r in upto) for name, key, _, _ in STATS}
        run["stats"]["accuracy_after"] = run["summary"].get("accuracy_after", math.nan)
    return start


# ----------------------------------------------------------------------------- frontier

def grid(runs: list[dict]) -> dict[tuple, list[dict]]:
    """``{(arm, lr_factor, updates): [runs in seed order]}``."""
    out: dict[tuple, list[dict]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        out.setdefault((run["arm"], run["lr_factor"], run["updates"]), []).append(run)
    return out


def arm_frontier(runs: list[dict], arm: str, lr_factors, updates) -> dict:
    """Per arm: the largest stable lr at each updates value and the largest stable updates at
    each lr, for all seeds and per seed, and the number of grid points where every seed was
    stable. Over the seeds that ran every updates value at the smallest lr, and the lr factors
    those seeds ran at every updates value (a study cut short, or a factor added later and not
    run to the end, leaves a factor out: ``left_out``)."""
    ok = {(r["lr_factor"], r["updates"], r["seed"]): r["verdict"].stable
          for r in runs if r["arm"] == arm}
    seeds = sorted({s for (_, _, s) in ok if all((lr_factors[0], n, s) in ok for n in updates)})
    lrs = [f for f in lr_factors if seeds and all((f, n, s) in ok for n in updates for s in seeds)]
    if not lrs:
        return {"seeds": seeds, "complete": False}

    def axis(values, key):
        best, per_seed = largest_stable({v: [ok[key(v) + (s,)] for s in seeds] for v in values})
        return {"all_seeds": best, "per_seed": per_seed}

    return {
        "seeds": seeds, "complete": True, "lr_factors": lrs,
        "left_out": [f for f in lr_factors if f not in lrs],
        "largest_stable_lr": {n: axis(lrs, lambda f, n=n: (f, n)) for n in updates},
        "largest_stable_updates": {f: axis(updates, lambda n, f=f: (f, n)) for f in lrs},
        "stable_points": sum(all(ok[(f, n, s)] for s in seeds) for f in lrs for n in updates),
        "stable_points_per_seed": [sum(ok[(f, n, s)] for f in lrs for n in updates) for s in seeds],
        "points": len(lrs) * len(updates),
    }


def _x(v) -> str:
    return "-" if v is None else f"x{v:g}"


def _range(per_seed: list, fmt=_x) -> str:
    """``x3 (x1..x10)`` style: the per-seed range, None (not even the smallest) first."""
    order = sorted(per_seed, key=lambda v: -math.inf if v is None else v)
    return fmt(order[0]) if order[0] == order[-1] else f"{fmt(order[0])}..{fmt(order[-1])}"


# ----------------------------------------------------------------------------- plots

def plot_map(cells: dict, arms, lr_factors, updates, seeds, out: str, plt) -> str:
    """Per arm: lr (x) by updates (y), each cell one stripe per seed coloured by its final reward;
    x = collapsed, v = degraded (ended below its start)."""
    rewards = [r["verdict"].final_reward for rs in cells.values() for r in rs]
    vmax = max([v for v in rewards if math.isfinite(v)] or [1.0])
    k = len(seeds)
    fig, axes = plt.subplots(1, len(arms), figsize=(3.3 * len(arms), 3.4), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        img = [[math.nan] * (len(lr_factors) * k) for _ in updates]
        for i, n in enumerate(updates):
            for j, f in enumerate(lr_factors):
                for run in cells.get((arm, f, n), []):
                    c = j * k + seeds.index(run["seed"])
                    img[i][c] = run["verdict"].final_reward
                    mark = MARKS[run["verdict"].status]
                    if mark:
                        ax.text(c, i, mark, ha="center", va="center", color="white", fontsize=11,
                                fontweight="bold")
        im = ax.imshow(img, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=vmax,
                       interpolation="nearest")
        for j in range(1, len(lr_factors)):
            ax.axvline(j * k - 0.5, color="white", linewidth=2)
        for i in range(1, len(updates)):
            ax.axhline(i - 0.5, color="white", linewidth=2)
        ax.set_xticks([j * k + (k - 1) / 2 for j in range(len(lr_factors))],
                      [f"x{f:g}" for f in lr_factors])
        ax.set_yticks(range(len(updates)), [str(n) for n in updates])
        ax.set_xlabel("lr (x 5e-5); one stripe a seed", fontsize=9)
        ax.set_title(arm, fontsize=10)
    axes[0][0].set_ylabel("updates per rollout batch")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.85,
                 label="final reward (x collapsed, v ended below start; white: not run)")
    return _save(fig, out, "stability_map.png", plt)


PANELS = (("route_change_1", "routes changed after 1 update"),
          ("rollout_disagreement", "rollout vs trainer routes differing"),
          ("abs_log_ratio_flipped", "abs token log-ratio, flipped routes"))


def plot_vs_lr(cells: dict, arms, lr_factors, updates, out: str, plt) -> str:
    """Rows: route change per update, rollout/trainer disagreement, |log-ratio| on flipped routes;
    columns: updates per batch; x: lr factor. Mean over seeds, whiskers min..max; a hollow
    marker where any seed collapsed."""
    fig, axes = plt.subplots(len(PANELS), len(updates), figsize=(4.2 * len(updates), 9),
                             squeeze=False, sharex=True)
    for col, n in enumerate(updates):
        for row, (stat, label) in enumerate(PANELS):
            ax = axes[row][col]
            for c, arm in enumerate(arms):
                xs, ys, lo, hi, hollow = [], [], [], [], []
                for f in lr_factors:
                    vals = [r["stats"][stat] for r in cells.get((arm, f, n), [])]
                    vals = [v for v in vals if math.isfinite(v)]
                    if not vals:
                        continue
                    m = sum(vals) / len(vals)
                    xs.append(f), ys.append(m), lo.append(m - min(vals)), hi.append(max(vals) - m)
                    hollow.append(any(r["verdict"].status == "collapsed"
                                      for r in cells.get((arm, f, n), [])))
                if not xs:
                    continue
                ax.errorbar(xs, ys, yerr=[lo, hi], color=f"C{c}", label=arm, capsize=2,
                            marker="o", markersize=4)
                ax.scatter([x for x, h in zip(xs, hollow) if h], [y for y, h in zip(ys, hollow) if h],
                           s=70, facecolors="white", edgecolors=f"C{c}", zorder=3)
            ax.set_xscale("log")
            if stat != "rollout_disagreement":  # that one stays within a few %: linear
                ax.set_yscale("log")
            if row < 2:  # shares of routes
                ax.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
            ax.set_xticks(lr_factors, [f"x{f:g}" for f in lr_factors])
            ax.xaxis.set_minor_locator(plt.matplotlib.ticker.NullLocator())
            if row == 0:
                ax.set_title(f"{n} updates per rollout batch", fontsize=10)
            if col == 0:
                ax.set_ylabel(label, fontsize=9)
            if row == len(PANELS) - 1:
                ax.set_xlabel("learning rate (x 5e-5)")
    from matplotlib.lines import Line2D

    fig.legend([Line2D([], [], color=f"C{c}", marker="o") for c in range(len(arms))], arms,
               loc="upper right", fontsize=8, ncol=len(arms), bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("mean over seeds (whiskers: min..max), up to each run's collapse; "
                 "hollow: some seed collapsed", fontsize=10, x=0.3)
    fig.tight_layout()
    return _save(fig, out, "route_change_vs_lr.png", plt)


def heatmap_pair(cells: dict, arms, lr_factors, updates) -> tuple[dict, dict] | None:
    """A stable run and a collapsing one that differ only in the learning rate (the largest
    stable lr and the next), GRPO without replay first, the fewest updates first."""
    order = sorted(arms, key=lambda a: a != "grpo")
    for arm in order:
        for n in updates:
            for lo, hi in zip(lr_factors, lr_factors[1:]):
                for a in cells.get((arm, lo, n), []):
                    for b in cells.get((arm, hi, n), []):
                        if a["seed"] == b["seed"] and a["verdict"].stable \
                                and b["verdict"].status == "collapsed":
                            return a, b
    return None


def plot_layer_heatmaps(pair: tuple[dict, dict], out: str, plt) -> str:
    """Route change per update (``routing/drift/change_rate/layer_l``) by layer and step, one
    shared log colour scale; a dashed line at the step the rule fired."""
    from matplotlib.colors import LogNorm

    grids = []
    for run in pair:
        keys = layer_keys(run["rows"], "routing/drift/change_rate")
        steps = [r["step"] for r in run["rows"]]
        grid_ = [[r.get(k, math.nan) for r in run["rows"]] for k in keys]
        grids.append((steps, grid_))
    vals = [v for _, g in grids for row in g for v in row if isinstance(v, float) and v > 0]
    last = max(steps[-1] for steps, _ in grids)
    norm = LogNorm(vmin=max(min(vals, default=1e-4), 1e-4), vmax=max(vals, default=1e-1))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, run, (steps, g) in zip(axes, pair, grids):
        im = ax.imshow([[max(v, norm.vmin) if isinstance(v, float) and math.isfinite(v) else math.nan
                         for v in row] for row in g], aspect="auto", origin="lower", cmap="magma",
                       norm=norm, extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(g) - 0.5))
        v = run["verdict"]
        if v.status == "collapsed":
            ax.axvline(v.step, color="cyan", linestyle="--")
        ax.set_title(f"{run['arm']}, lr x{run['lr_factor']:g}, {run['updates']} updates, seed "
                     f"{run['seed']}: {v.status}", fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_xlim(-0.5, last + 0.5)  # the same steps in both: a stopped run ends early
        ax.set_yticks(range(len(g)))
    axes[0].set_ylabel("MoE layer")
    fig.colorbar(im, ax=axes.tolist(), shrink=0.85, label="routes changed, mean over the updates")
    return _save(fig, out, "layer_heatmaps.png", plt)


# ----------------------------------------------------------------------------- report

def _cell(runs: list[dict], stat: str, fmt: str) -> str:
    vals = [r["stats"][stat] for r in runs if math.isfinite(r["stats"][stat])]
    if not vals:
        return "-"
    m = fmt.format(sum(vals) / len(vals))
    return m if len(vals) == 1 else f"{m} ({fmt.format(min(vals))}..{fmt.format(max(vals))})"


def write_report(runs_dir: str, out: str) -> str:
    if not os.path.exists(os.path.join(runs_dir, "frontier_settings.json")):
        print(f"frontier report: {runs_dir} has no frontier_settings.json (frontier.py writes it)",
              file=sys.stderr)
        raise SystemExit(2)
    plt = _matplotlib()
    os.makedirs(out, exist_ok=True)
    settings, runs = load_runs(runs_dir)
    if not runs:
        sys.exit(f"frontier report: no finished runs under {runs_dir}")
    size = settings["size"]
    rule = StabilityRule(**settings["rule"])
    start = judge(runs, rule, settings.get("start_reward"))
    arms = [a for a in size["arms"] if any(r["arm"] == a for r in runs)]
    lrs, ups, seeds = size["lr_factors"], size["updates"], size["seeds"]
    cells = grid(runs)
    frontier = {arm: arm_frontier(runs, arm, lrs, ups) for arm in arms}

    plots = [plot_map(cells, arms, lrs, ups, seeds, out, plt),
             plot_vs_lr(cells, arms, lrs, ups, out, plt)]
    pair = heatmap_pair(cells, arms, lrs, ups)
    if pair:
        plots.append(plot_layer_heatmaps(pair, out, plt))

    lines = [f"# {settings['title']}", "",
             f"{len(runs)} runs. Start reward (the warm-up policy's sampled reward): "
             f"{start:.3f}. Rule: collapsed when a {rule.window}-step window's reward < "
             f"{rule.reward_collapse:g} x the start, its gradient norm > {rule.grad_norm_limit:g}, "
             f"its entropy < {rule.entropy_collapse:g} x step 0's with no reward gain, or "
             f"anything non-finite (the run is stopped there); degraded when the last "
             f"{rule.final_window} steps' reward < start - {rule.reward_margin:g}; stable "
             f"otherwise (`frontier_rules.py`).", "",
             "## Frontier: largest stable setting (every seed stable there and below; per-seed "
             "range in brackets)", "",
             "| arm | " + " | ".join(f"lr at {n} updates" for n in ups) + " | "
             + " | ".join(f"updates at lr x{f:g}" for f in lrs) + " | stable points |",
             "|---" * (1 + len(ups) + len(lrs) + 1) + "|"]
    for arm in arms:
        fr = frontier[arm]
        if not fr["complete"]:
            lines.append(f"| {arm} | " + " | ".join(["incomplete"] * (len(ups) + len(lrs) + 1)) + " |")
            continue
        cells_lr = [f"{_x(fr['largest_stable_lr'][n]['all_seeds'])} "
                    f"({_range(fr['largest_stable_lr'][n]['per_seed'])})" for n in ups]
        num = lambda v: "-" if v is None else f"{v}"  # noqa: E731
        cells_up = [f"{num(fr['largest_stable_updates'][f]['all_seeds'])} "
                    f"({_range(fr['largest_stable_updates'][f]['per_seed'], num)})"
                    if f in fr["lr_factors"] else "not run on every seed" for f in lrs]
        per = fr["stable_points_per_seed"]
        lines.append(f"| {arm} | " + " | ".join(cells_lr + cells_up)
                     + f" | {fr['stable_points']} / {fr['points']} (per seed {min(per)}..{max(per)}; "
                     f"seeds {', '.join(map(str, fr['seeds']))}"
                     + (f"; lr x{', x'.join(f'{f:g}' for f in fr['left_out'])} left out"
                        if fr["left_out"] else "") + ") |")
    lines += ["", "## Every point", "",
              "Status counts over seeds: s stable, d degraded, c collapsed (first rule and step of "
              "the first collapsed seed). Cells: mean over seeds (min..max), over each run's "
              "steps up to its collapse.", "",
              "| arm | lr | updates | s/d/c | final reward | steps | "
              + " | ".join(what for _, _, what, _ in STATS) + " | why |",
              "|---" * (6 + len(STATS) + 1) + "|"]
    for (arm, f, n), rs in sorted(cells.items(), key=lambda kv: (arms.index(kv[0][0]), kv[0][1], kv[0][2])):
        counts = "/".join(str(sum(r["verdict"].status == s for r in rs)) for s in ("stable", "degraded", "collapsed"))
        why = next((f"{r['verdict'].reason} (step {r['verdict'].step})" for r in rs
                    if r["verdict"].status == "collapsed"), "")
        rewards = [r["verdict"].final_reward for r in rs]
        lines.append(f"| {arm} | x{f:g} | {n} | {counts} | "
                     f"{mean(rewards):.3f} ({min(rewards):.3f}..{max(rewards):.3f}) | "
                     f"{'/'.join(str(r['verdict'].steps) for r in rs)} | "
                     + " | ".join(_cell(rs, name, fmt) for name, _, _, fmt in STATS) + f" | {why} |")
    wall = settings["wall_s"]
    lines += ["", "## How it was run", "", "```bash", settings["command"], "```", "",
              f"Common overrides on `examples/configs/routing_study.yaml`: `{' '.join(settings['common'])}`; "
              f"{size['jobs']} runs at a time on {settings['machine']}. Wall time of the last "
              f"invocation " + (f"{wall['total'] / 60:.1f} min" if "total" in wall else "(still running)")
              + f" (SFT warm-up {wall['sft'] / 60:.1f} min; 0 = reused; points already run are not "
              f"run again); the {len(runs)} runs' own wall times add up to "
              f"{sum(r['record'].get('wall_s', 0) for r in runs) / 60:.0f} min. "
              f"Date {settings['date']}, commit {settings['commit']}.", ""]
    if pair:
        lines += [f"Heatmaps: {pair[0]['arm']} at {pair[0]['updates']} updates, seed "
                  f"{pair[0]['seed']}, lr x{pair[0]['lr_factor']:g} (stable) vs "
                  f"x{pair[1]['lr_factor']:g} ({pair[1]['verdict'].reason}).", ""]
    lines += [f"![{p}]({p})\n" for p in plots]
    path = os.path.join(out, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    record = {"settings": settings, "start_reward": start, "frontier": frontier,
              "runs": [{k: run[k] for k in ("arm", "lr_factor", "updates", "seed", "stats")}
                       | {"verdict": run["verdict"].to_dict(), "record": run["record"]}
                       for run in runs]}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path


def main(argv=None) -> int:
    return report_main(argv, write=write_report, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
