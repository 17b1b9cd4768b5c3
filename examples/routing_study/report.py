"""The routing study's report: every arm over its seeds, bands on every curve (Markdown + PNGs).

    python examples/routing_study/report.py RUNS_DIR --out REPORT_DIR

``RUNS_DIR`` holds ``<arm>/seed_<s>/`` run directories (``metrics.jsonl``, ``summary.json``) as
``run_study.py`` writes them and ``study_settings.json``. A band is the min..max over seeds, the
line their mean; step curves are first smoothed with a centred moving average of
``SMOOTH`` steps (per seed), because one RL step of 64 responses is noisy.

Collapse rule (stated once, applied to every seed): the reward of the last ``WINDOW`` steps is
below half that of the first ``WINDOW``, or held-out accuracy fell by more than half, or any update
was skipped as non-finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from gspo_megatron.tools.routing_report import _matplotlib, layer_keys, read_metrics, series

SMOOTH = 5
"""Steps in the centred moving average applied to each seed's step curve before banding."""
WINDOW = 10
"""Steps in the 'first' and 'last' windows of the table and the collapse rule."""
DEEPEST = 2
"""The table's 'deepest layers' column averages this many last MoE layers."""


# ----------------------------------------------------------------------------- loading

def load_study(runs_dir: str) -> dict[str, list[dict]]:
    """``{arm: [{"seed", "rows", "summary"}, ...]}`` in the order of ``study_settings.json``."""
    settings = json.load(open(os.path.join(runs_dir, "study_settings.json")))
    study: dict[str, list[dict]] = {}
    for arm in settings["arms"]:
        seeds = []
        for seed in settings["seeds"]:
            run = os.path.join(runs_dir, arm, f"seed_{seed}")
            if not os.path.exists(os.path.join(run, "metrics.jsonl")):
                continue
            summary_path = os.path.join(run, "summary.json")
            seeds.append({"seed": seed, "rows": read_metrics(run),
                          "summary": json.load(open(summary_path)) if os.path.exists(summary_path) else {}})
        if seeds:
            study[arm] = seeds
    return study


def _finite(values) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values) -> float:
    values = _finite(values)
    return sum(values) / len(values) if values else float("nan")


def smooth(ys: list[float], width: int = SMOOTH) -> list[float]:
    """Centred moving average (shorter at the ends)."""
    h = width // 2
    return [_mean(ys[max(0, i - h):i + h + 1]) for i in range(len(ys))]


def run_series(run: dict, key: str) -> tuple[list[float], list[float]]:
    """``key`` over the steps of one run; held-out accuracy also gets its before-RL value at x=0
    and its after-RL value at x=steps (``summary.json``)."""
    xs, ys = series(run["rows"], key)
    if key == "eval/accuracy":
        before, after = run["summary"].get("accuracy_before"), run["summary"].get("accuracy_after")
        if before is not None:
            xs, ys = [0, *xs], [before, *ys]
        if after is not None:
            xs, ys = [*xs, len(run["rows"])], [*ys, after]
    return xs, ys


def band(seeds: list[dict], key: str, width: int = SMOOTH):
    """``(steps, mean, low, high)`` of ``key`` over seeds at the steps every seed logged it."""
    per_seed = []
    for run in seeds:
        xs, ys = run_series(run, key)
        per_seed.append(dict(zip(xs, smooth(ys, width) if width > 1 else ys)))
    common = sorted(set.intersection(*(set(d) for d in per_seed))) if per_seed else []
    cols = [[d[x] for d in per_seed] for x in common]
    return common, [_mean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def depth_profile(seeds: list[dict], stem: str) -> tuple[list[int], list[list[float]]]:
    """Layer indices and, per seed, the mean over steps of ``stem/layer_i`` ``[seeds][layers]``."""
    keys = layer_keys(seeds[0]["rows"], stem)
    layers = [int(k.rsplit("_", 1)[1]) for k in keys]
    return layers, [[_mean(series(run["rows"], k)[1]) for k in keys] for run in seeds]


def collapsed(run: dict) -> bool:
    rewards = series(run["rows"], "reward/mean")[1]
    first, last = _mean(rewards[:WINDOW]), _mean(rewards[-WINDOW:])
    before, after = run["summary"].get("accuracy_before"), run["summary"].get("accuracy_after")
    skipped = sum(_finite(series(run["rows"], "faults/skipped_updates")[1]))
    return bool(last < 0.5 * first or (before and after is not None and after < 0.5 * before)
                or skipped > 0)


# ----------------------------------------------------------------------------- table

def _spread(values: list[float], fmt: str) -> str:
    values = _finite(values)
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def summary_rows(study: dict[str, list[dict]]) -> list[tuple[str, str, list[str]]]:
    """``(label, format, [cell per arm])`` rows; a cell is the mean over seeds (min..max)."""
    def col(key, window=None):
        def fn(run):
            ys = series(run["rows"], key)[1]
            return _mean(ys[window] if window else ys)
        return fn

    def deepest(stem):
        def fn(run):
            keys = layer_keys(run["rows"], stem)[-DEEPEST:]
            return _mean([_mean(series(run["rows"], k)[1]) for k in keys])
        return fn

    first, last = slice(0, WINDOW), slice(-WINDOW, None)
    spec = [
        ("seeds", "{:.0f}", lambda run: 1.0),
        ("RL steps", "{:.0f}", lambda run: float(len(run["rows"]))),
        ("routes changed vs the old policy, after 1 update", "{:.2%}",
         col("routing/change_rate/after_update_0")),
        ("routes changed vs the old policy, after 4 updates", "{:.2%}",
         col("routing/change_rate/after_update_3")),
        ("routes changed, mean over the 4 updates, all layers", "{:.2%}", col("routing/change_rate")),
        (f"routes changed, mean over the 4 updates, deepest {DEEPEST} layers", "{:.2%}",
         deepest("routing/change_rate")),
        ("rollout vs trainer routes differing", "{:.2%}", col("routing/rollout/change_rate")),
        (f"rollout vs trainer, deepest {DEEPEST} layers", "{:.2%}",
         deepest("routing/rollout/change_rate")),
        ("abs token log-ratio, route flipped", "{:.4f}", col("routing/abs_log_ratio_changed")),
        ("abs token log-ratio, route kept", "{:.4f}", col("routing/abs_log_ratio_unchanged")),
        ("clipped token share", "{:.3%}", col("clip/token_fraction")),
        ("SAPO gate: mean gradient weight f'(r)", "{:.4f}", col("gate/weight_mean")),
        ("k3 KL rollout vs trainer", "{:.2e}", col("kl/rollout_vs_train")),
        ("grad norm (mean)", "{:.3f}", col("optim/grad_norm")),
        ("grad norm (max)", "{:.3f}", lambda run: max(_finite(series(run["rows"], "optim/grad_norm")[1]) or [math.nan])),
        (f"reward, first {WINDOW} steps", "{:.3f}", col("reward/mean", first)),
        (f"reward, last {WINDOW} steps", "{:.3f}", col("reward/mean", last)),
        ("held-out accuracy before RL", "{:.3f}", lambda run: run["summary"].get("accuracy_before", math.nan)),
        ("held-out accuracy after RL", "{:.3f}", lambda run: run["summary"].get("accuracy_after", math.nan)),
        ("response length (tokens)", "{:.1f}", col("response/mean_length")),
        ("seeds collapsed", "{:.0f}", lambda run: float(collapsed(run))),
        ("step time (s)", "{:.2f}", col("perf/step_s", slice(1, None))),
    ]
    rows = []
    for label, fmt, fn in spec:
        cells = []
        for seeds in study.values():
            values = [fn(run) for run in seeds]
            if label in ("seeds", "seeds collapsed"):
                cells.append(f"{sum(values):.0f}")
            else:
                cells.append(_spread(values, fmt))
        rows.append((label, fmt, cells))
    return rows


# ----------------------------------------------------------------------------- plots

CURVES = [
    ("reward/mean", "reward (mean over the rollout batch)", False),
    ("eval/accuracy", "held-out accuracy (greedy)", False),
    ("routing/change_rate", "routes changed vs the old policy (all layers)", False),
    ("clip/token_fraction", "clipped token share (log scale)", True),
    ("optim/grad_norm", "gradient norm (before clipping)", False),
    ("kl/rollout_vs_train", "k3 KL, rollout engine vs trainer (log)", True),
]


def _plot_band(ax, xs, mean, low, high, label, style):
    if not xs:
        return
    line, = ax.plot(xs, mean, label=label, **style)
    ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.18, linewidth=0)


def _styles(arms: list[str]) -> dict[str, dict]:
    """A colour per arm, the staleness arms (``grpo_s1``) in their arm's colour: dashed at
    staleness 1, dotted beyond; the stress arms dashed."""
    bases = list(dict.fromkeys(re.sub(r"_s\d+$", "", a) for a in arms))

    def style(arm: str) -> dict:
        m = re.match(r"^(.+?)_s(\d+)$", arm)
        base, k = (m[1], int(m[2])) if m else (arm, 0)
        line = "--" if "stress" in arm or k == 1 else ":" if k > 1 else "-"
        return {"linestyle": line, "color": f"C{bases.index(base) % 10}"}

    return {arm: style(arm) for arm in arms}


def plot_curves(study, arms: list[str], out: str, name: str, title: str, plt) -> str:
    styles = _styles(list(study))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (key, label, log) in zip(axes.flat, CURVES):
        for arm in arms:
            width = 1 if key == "eval/accuracy" else SMOOTH
            _plot_band(ax, *band(study[arm], key, width), arm, styles[arm])
        ax.set_title(label, fontsize=10)
        if log:
            ax.set_yscale("log")
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _save(fig, out, name, plt)


def plot_depth(study, out: str, plt) -> str:
    styles = _styles(list(study))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for ax, stem, title in (
            (axes[0], "routing/change_rate", "routes changed vs the old policy (mean over the 4 updates), by depth"),
            (axes[1], "routing/rollout/change_rate", "rollout engine vs trainer routes differing, by depth")):
        for arm, seeds in study.items():
            layers, profiles = depth_profile(seeds, stem)
            if not layers:
                continue
            cols = list(zip(*profiles))
            _plot_band(ax, layers, [_mean(c) for c in cols], [min(c) for c in cols],
                       [max(c) for c in cols], arm, {**styles[arm], "marker": "o", "markersize": 3})
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("MoE layer (0 = first)")
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, out, "depth_profile.png", plt)


def plot_flip_ratio(study, out: str, plt) -> str:
    arms = list(study)
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    for ax, (changed, kept, title) in zip(axes, (
            ("routing/abs_log_ratio_changed", "routing/abs_log_ratio_unchanged",
             "mean |token log-ratio| after an update"),
            ("routing/clipfrac_changed", "routing/clipfrac_unchanged", "clipped share of tokens"))):
        for j, (key, label) in enumerate(((changed, "route flipped"), (kept, "route kept"))):
            values = [[_mean(series(run["rows"], key)[1]) for run in study[arm]] for arm in arms]
            means = [_mean(v) for v in values]
            err = [[m - min(_finite(v) or [m]) for m, v in zip(means, values)],
                   [max(_finite(v) or [m]) - m for m, v in zip(means, values)]]
            ax.bar([i + 0.38 * j for i in range(len(arms))], means, 0.38, yerr=err, capsize=3,
                   label=label)
        ax.set_xticks([i + 0.19 for i in range(len(arms))], arms, rotation=20, fontsize=8)
        ax.set_title(title + " (bars: mean over seeds, whiskers: min..max)", fontsize=10)
        ax.legend(fontsize=8)
    return _save(fig, out, "flip_vs_ratio.png", plt)


def plot_heatmaps(study, out: str, plt) -> str:
    """Route change rate per layer over steps, seed-averaged, one panel per arm."""
    arms = list(study)
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.2), squeeze=False)
    grids = {}
    for arm in arms:
        keys = layer_keys(study[arm][0]["rows"], "routing/change_rate")
        grids[arm] = [band(study[arm], k, SMOOTH)[1] for k in keys]
    vmax = max((max(r) for g in grids.values() for r in g if r), default=1e-9)
    for ax, arm in zip(axes[0], arms):
        im = ax.imshow(grids[arm], aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=vmax)
        ax.set_title(arm, fontsize=10)
        ax.set_xlabel("RL step")
    axes[0][0].set_ylabel("MoE layer")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="routes changed vs the old policy")
    return _save(fig, out, "change_rate_heatmap.png", plt)


def _save(fig, out: str, name: str, plt) -> str:
    fig.savefig(os.path.join(out, name), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return name


# ----------------------------------------------------------------------------- report

def write_report(runs_dir: str, out: str) -> str:
    plt = _matplotlib()
    os.makedirs(out, exist_ok=True)
    settings = json.load(open(os.path.join(runs_dir, "study_settings.json")))
    study = load_study(runs_dir)
    if not study:
        sys.exit(f"report: no runs under {runs_dir}")
    main_arms = [a for a in study if "stress" not in a]
    stress_arms = [a for a in study if "stress" in a]
    plots = [plot_depth(study, out, plt),
             plot_curves(study, main_arms, out, "curves.png", "main arms", plt)]
    if stress_arms:
        plots.append(plot_curves(study, stress_arms + [a.replace("_stress", "") for a in stress_arms
                                                       if a.replace("_stress", "") in study],
                                 out, "stress.png", "stress setting (dashed) vs base", plt))
    plots += [plot_flip_ratio(study, out, plt), plot_heatmaps(study, out, plt)]

    arms = list(study)
    lines = [f"# {settings['title']}", "",
             "Cells: mean over seeds, (min..max) across seeds. Route statistics are measured after "
             "each optimiser step on the minibatch it used, against the old policy's routes; "
             "rollout-vs-trainer on every token of the rollout batch (docs/routing.md). "
             f"Curves: centred {SMOOTH}-step moving average per seed, band = min..max over seeds.", "",
             "| metric | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    table = summary_rows(study)
    for label, _, cells in table:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Arms", "", "| arm | overrides on top of the base recipe |", "|---|---|"]
    for arm in arms:
        lines.append(f"| {arm} | `{' '.join(settings['arm_overrides'][arm]) or '(none)'}` |")
    lines += ["", "## How it was run", "", "```bash", settings["command"], "```", "",
              f"Base recipe `{settings['recipe']}` with `{' '.join(settings['common'])}`; "
              f"seeds {settings['seeds']}; {settings['jobs']} runs at a time, one thread each, on "
              f"{settings['machine']}. Wall time: {settings['wall_s']['total'] / 60:.1f} min "
              f"(SFT warm-up {settings['wall_s']['sft'] / 60:.1f} min). Date {settings['date']}, "
              f"commit {settings['commit']}.", ""]
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    path = os.path.join(out, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:  # the record: how, where, what
        json.dump({"settings": settings,
                   "table": {label: dict(zip(arms, cells)) for label, _, cells in table}},
                  f, indent=1)
    return path


def main(argv=None, write=write_report, doc: str = __doc__) -> int:
    """``RUNS_DIR --out DIR``: ``write(runs_dir, out)`` (this report, or another study's that
    reads the same command line) and print the path it wrote."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("runs_dir")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    print(write(args.runs_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
