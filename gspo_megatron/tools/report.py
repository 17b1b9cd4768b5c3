"""``gspo-report RUN_DIR [RUN_DIR ...] [--out DIR] [--names a,b]``: the plots of one or more
``gspo-train`` runs, as PNGs and one self-contained HTML page.

    gspo-report runs/demo                      # -> runs/demo/report/report.html + PNGs
    gspo-report runs/gspo runs/grpo --out cmp  # two runs on the same axes

Each RUN_DIR holds ``metrics.jsonl`` (one record per RL step) and, when the run got that far,
``summary.json`` (held-out accuracy before and after RL) and ``config.yaml``. The page shows reward
and held-out accuracy, response length, clip fraction, ``kl/rollout_vs_train``, gradient norm,
time per phase of the step, route change per MoE layer (a heatmap, where the run logged
``routing/*/layer_i``: ``routing.diagnostics`` or ``routing.replay``) and expert load; several runs
share axes, one colour each. A plot whose metrics no run logged is left out with a line saying
why. The images are embedded (base64): the page needs no network and no other file.

Bad input (not a run directory, no ``metrics.jsonl``, a malformed line) is one line naming the file
and line, exit code 2, nothing written. Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

import yaml

from gspo_megatron.tools.routing_report import layer_keys, load_matrix, series

PROG = "gspo-report"

# Phases of a step in the order they run (``perf/*_s`` laps of the trainer's stopwatch, then what
# the step waits on outside them); any other ``perf/*_s`` follows, alphabetically.
PHASES = ("perf/rollout_s", "perf/rollout_wait_s", "perf/reward_s", "perf/balance_s",
          "perf/old_logprobs_s", "perf/checkpoint_wait_s", "perf/update_s",
          "perf/routing_diagnostics_s", "perf/checkpoint_s", "perf/publish_weights_s")
# Per-layer route change metrics (gspo_megatron/routing/stats.py, backends/megatron/routing/):
# vs the old policy after each update (diagnostics), in the update forwards themselves (drift),
# rollout engine vs trainer.
ROUTE_CHANGE_STEMS = ("routing/change_rate", "routing/drift/change_rate",
                      "routing/rollout/change_rate")
ROUTE_CHANGE_TITLES = {"routing/change_rate": "after each update vs the old policy",
                       "routing/drift/change_rate": "in the update forwards vs the old policy",
                       "routing/rollout/change_rate": "rollout engine vs trainer"}


class ReportError(ValueError):
    """Bad input; the message names the file (and line)."""


@dataclass
class Run:
    """One run directory, read."""

    name: str
    path: str
    rows: list[dict]
    """``metrics.jsonl``'s records in step order (a step logged twice: the later record)."""
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- reading

def read_metrics_file(path: str) -> list[dict]:
    """Records of a ``metrics.jsonl``, each checked: a JSON object with an integer ``step``."""
    by_step: dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))  # (columns within the line)
                except json.JSONDecodeError as exc:
                    raise ReportError(f"{path}:{number}: not a JSON object ({exc.msg}, column "
                                      f"{exc.colno})") from None
                step = record.get("step") if isinstance(record, dict) else None
                if not isinstance(step, int) or isinstance(step, bool):
                    raise ReportError(f"{path}:{number}: not a metrics record (no integer 'step')")
                by_step[step] = record
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a text file") from None
    except OSError as exc:
        raise ReportError(f"{path}: cannot read it ({exc.strerror})") from None
    if not by_step:
        raise ReportError(f"{path}: no steps logged")
    return [by_step[s] for s in sorted(by_step)]


def _read_optional(path: str, kind: str) -> dict:
    """``summary.json`` (``kind`` json) / ``config.yaml`` (yaml) as a dict; {} when absent."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if kind == "json" else yaml.safe_load(f)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ReportError(f"{path}{where}: not valid YAML "
                          f"({getattr(exc, 'problem', None) or exc})") from None
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a text file") from None
    except OSError as exc:
        raise ReportError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: not a mapping")
    return data


def load_run(path: str, name: str) -> Run:
    if not os.path.isdir(path):
        raise ReportError(f"{path}: not a directory")
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise ReportError(f"{path}: no metrics.jsonl (not a gspo-train run directory?)")
    return Run(name, path, read_metrics_file(metrics),
               _read_optional(os.path.join(path, "summary.json"), "json"),
               _read_optional(os.path.join(path, "config.yaml"), "yaml"))


def run_names(paths: list[str]) -> list[str]:
    """Each run's directory name; as many trailing path parts as it takes to tell them apart."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [f"{p[-1]} ({i + 1})" for i, p in enumerate(parts)]  # the same directory twice


# ----------------------------------------------------------------------------- plots
# Each plot function takes (runs, plt) and returns a matplotlib figure, or a string: why it is
# left out.

def _color(i: int) -> str:
    return f"C{i % 10}"


def _finish(ax, title: str, xlabel: str = "RL step", legend: bool = True) -> None:
    """Title and x label; a line plot's grid, whole-number step ticks and legend."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    if xlabel.startswith("RL step"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    if legend:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)


def smooth(ys: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def draw_series(ax, xs: list[int], ys: list[float], color: str, label: str) -> None:
    """A metric over steps: past 50 steps the raw values faint and a trailing mean over 2 % of
    the steps on top (per-step RL metrics are noisy: 128 samples a step in the demo)."""
    if len(ys) <= 50:
        ax.plot(xs, ys, color=color, label=label)
        return
    ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
    window = max(2, len(ys) // 50)
    ax.plot(xs, smooth(ys, window), color=color, label=f"{label} (mean of {window})")


def _log_scale_if_positive(ax, values: list[float]) -> None:
    """Log y for quantities spanning decades (KL, gradient norm) when every value is > 0."""
    if values and min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")


def line_plot(key: str, title: str):
    """A plot of ``key`` over RL steps, one line per run."""
    def plot(runs: list[Run], plt):
        if not any(series(r.rows, key)[0] for r in runs):
            return f"no run logged {key}"
        fig, ax = plt.subplots(figsize=(7, 3.4))
        values = []
        for i, run in enumerate(runs):
            xs, ys = series(run.rows, key)
            values += ys
            if xs:
                draw_series(ax, xs, ys, _color(i), run.name)
        _log_scale_if_positive(ax, values)
        _finish(ax, title)
        return fig
    return plot


def reward_and_accuracy(runs: list[Run], plt):
    has_reward = any(series(r.rows, "reward/mean")[0] for r in runs)
    has_acc = any(series(r.rows, "eval/accuracy")[0] or "accuracy_before" in r.summary
                  or "accuracy_after" in r.summary for r in runs)
    if not (has_reward or has_acc):
        return "no run logged reward/mean, eval/accuracy or a summary.json with accuracies"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    for i, run in enumerate(runs):
        draw_series(left, *series(run.rows, "reward/mean"), _color(i), run.name)
        # x = RL updates done: the record of step k is logged after update k (k + 1 done);
        # the summary's accuracies are before the first update and after the last.
        xs, ys = series(run.rows, "eval/accuracy")
        points = [(x + 1, y) for x, y in zip(xs, ys)]
        if "accuracy_before" in run.summary:
            points.insert(0, (run.summary.get("start_step", 0), run.summary["accuracy_before"]))
        if "accuracy_after" in run.summary:
            points.append((run.summary.get("steps", run.rows[-1]["step"] + 1),
                           run.summary["accuracy_after"]))
        if points:
            right.plot(*zip(*points), color=_color(i), marker="o", label=run.name)
    _finish(left, "reward/mean (training rollouts)")
    _finish(right, "held-out accuracy (greedy): before RL, eval/accuracy, after RL",
            xlabel="RL steps done")
    if not has_acc:
        right.text(0.5, 0.5, "no held-out evaluation logged", ha="center", transform=right.transAxes)
    return fig


def phase_times(runs: list[Run], plt):
    found = {k for r in runs for row in r.rows for k in row if k.startswith("perf/")
             and k.endswith("_s") and not k.endswith("_per_s")
             and k not in ("perf/step_s", "perf/gc_s")}  # (the whole step; time inside phases)
    if not found:
        return "no run logged perf/*_s"
    phases = [p for p in PHASES if p in found] + sorted(found - set(PHASES))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8),
                                      gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        medians = [statistics.median(series(run.rows, p)[1] or [0.0]) for p in phases]
        left.bar([j + (i - (len(runs) - 1) / 2) * width for j in range(len(phases))], medians,
                 width=width, color=_color(i), label=run.name)
        draw_series(right, *series(run.rows, "perf/step_s"), _color(i), run.name)
    left.set_xticks(range(len(phases)), [p.removeprefix("perf/").removesuffix("_s")
                                         for p in phases], rotation=20, fontsize=8)
    left.set_ylabel("seconds (median over steps)")
    _finish(left, "time per phase of a step (perf/*_s)", xlabel="")
    right.set_ylabel("seconds")
    _finish(right, "perf/step_s (whole step)")
    return fig


def _route_stems(runs: list[Run]) -> list[str]:
    return [s for s in ROUTE_CHANGE_STEMS if any(layer_keys(r.rows, s) for r in runs)]


def route_change(runs: list[Run], plt):
    stems = _route_stems(runs)
    if not stems:
        return ("no run logged routing/*/change_rate/layer_i (per MoE layer: routing.diagnostics "
                "or routing.replay)")
    import matplotlib
    import numpy as np

    # (constrained layout: a colour bar per row beside panels that tight_layout would overlap)
    fig, axes = plt.subplots(len(stems), len(runs), figsize=(5.2 * len(runs) + 1, 2.8 * len(stems)),
                             squeeze=False, layout="constrained")
    for row, stem in enumerate(stems):
        # one scale per row, so that runs compare; 0-1 when nothing changed at all
        vmax = max([max(series(r.rows, k)[1] or [0.0]) for r in runs for k in layer_keys(r.rows, stem)]
                   or [0.0]) or 1.0
        image = None
        for col, run in enumerate(runs):
            ax = axes[row][col]
            keys = layer_keys(run.rows, stem)
            if not keys:
                ax.set_axis_off()
                ax.set_title(f"{run.name}: no {stem}", fontsize=9)
                continue
            steps = [r["step"] for r in run.rows]
            grid = np.array([[_number(r.get(k)) for r in run.rows] for k in keys])
            # grey: steps the metric was not logged at (routing.diagnostics_interval)
            cmap = matplotlib.colormaps["magma"].with_extremes(bad="#dddddd")
            # pcolormesh over step edges: right however the logged steps are spaced
            edges = [s - 0.5 for s in steps] + [steps[-1] + 0.5]
            image = ax.pcolormesh(edges, np.arange(len(keys) + 1) - 0.5,
                                  np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=vmax)
            ax.set_yticks(range(len(keys)), [k.rsplit("_", 1)[1] for k in keys])
            ax.set_ylabel("MoE layer")
            _finish(ax, f"{run.name}: {stem}\n({ROUTE_CHANGE_TITLES[stem]})", legend=False)
        if image is not None:
            fig.colorbar(image, ax=list(axes[row]), label="share changed")
    return fig


def expert_load(runs: list[Run], plt):
    loads = [load_matrix(r.rows) for r in runs]
    has_imbalance = any(series(r.rows, "routing/load_imbalance")[0] for r in runs)
    if not any(loads) and not has_imbalance:
        return "no run logged routing/load/layer_i/expert_e or routing/load_imbalance (routing.diagnostics)"
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.2 * (len(runs) + 1), 3.2), squeeze=False,
                             layout="constrained")
    for ax, run, matrix in zip(axes[0], runs, loads):
        if not matrix:
            ax.set_axis_off()
            ax.set_title(f"{run.name}: no routing/load/*", fontsize=9)
            continue
        image = ax.imshow(matrix, aspect="auto", origin="lower", cmap="viridis", vmin=0)
        fig.colorbar(image, ax=ax, label="share of routes")
        ax.set_ylabel("MoE layer")
        _finish(ax, f"{run.name}: mean expert load", xlabel="expert", legend=False)
    ax = axes[0][-1]
    for i, run in enumerate(runs):
        draw_series(ax, *series(run.rows, "routing/load_imbalance"), _color(i), run.name)
    _finish(ax, "routing/load_imbalance (max/mean, mean over layers)")
    return fig


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else float("nan")


@dataclass(frozen=True)
class Plot:
    file: str
    title: str
    draw: Callable


PLOTS = (
    Plot("reward_accuracy.png", "Reward and held-out accuracy", reward_and_accuracy),
    Plot("response_length.png", "Response length",
         line_plot("response/mean_length", "response/mean_length (tokens)")),
    Plot("clip_fraction.png", "Clip fraction",
         line_plot("clip/fraction", "clip/fraction (the loss's unit: sequences for GSPO, "
                   "tokens for GRPO)")),
    Plot("kl_rollout_vs_train.png", "Rollout engine vs trainer",
         line_plot("kl/rollout_vs_train", "kl/rollout_vs_train (k3, the engine's log-probs "
                   "vs the trainer's)")),
    Plot("grad_norm.png", "Gradient norm",
         line_plot("optim/grad_norm", "optim/grad_norm (before clipping, mean over the "
                   "step's updates)")),
    Plot("phase_time.png", "Time per phase", phase_times),
    Plot("route_change.png", "Route change per MoE layer", route_change),
    Plot("expert_load.png", "Expert load", expert_load),
)


# ----------------------------------------------------------------------------- the page

def _fmt(v, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _setting(run: Run) -> str:
    """A few config values that tell runs apart (config.yaml)."""
    c = run.config
    def get(section, key):
        value = (c.get(section) or {}).get(key) if isinstance(c.get(section), dict) else None
        return "-" if value is None else str(value)
    if not c:
        return "-"
    return (f"{get('loss', 'variant')}, model {get('model', 'preset')}, G={get('rollout', 'group_size')}"
            f" x {get('rollout', 'prompts_per_step')} prompts, replay {get('routing', 'replay')}")


def runs_table(runs: list[Run]) -> str:
    head = ("run", "directory", "steps logged", "reward/mean (last 10 %)",
            "held-out accuracy before", "after", "setting (config.yaml)")
    lines = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for i, run in enumerate(runs):
        rewards = series(run.rows, "reward/mean")[1]
        tail = rewards[-max(1, len(rewards) // 10):]
        cells = (f'<span style="color:{_HEX[i % 10]}">&#9632;</span> {html.escape(run.name)}',
                 html.escape(run.path),
                 f"{len(run.rows)} ({run.rows[0]['step']}-{run.rows[-1]['step']})",
                 _fmt(sum(tail) / len(tail) if tail else None),
                 _fmt(run.summary.get("accuracy_before")), _fmt(run.summary.get("accuracy_after")),
                 html.escape(_setting(run)))
        lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(lines + ["</table>"])


_HEX = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        "#bcbd22", "#17becf")  # matplotlib's C0-C9
_STYLE = """body{font-family:sans-serif;margin:24px;max-width:1300px;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:8px 24px}.plot{max-width:100%}
img{max-width:100%;border:1px solid #eee}h2{margin:20px 0 6px;font-size:17px}.skipped{color:#666}"""


def html_page(runs: list[Run], figures: list[tuple[Plot, bytes]], skipped: list[tuple[Plot, str]]) -> str:
    title = "gspo-report: " + ", ".join(r.name for r in runs)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             runs_table(runs)]
    parts.append("<div class='plots'>")
    for plot, png in figures:
        data = base64.b64encode(png).decode("ascii")
        parts += [f"<div class='plot'><h2>{html.escape(plot.title)}</h2>",
                  f"<img alt='{html.escape(plot.title)}' src='data:image/png;base64,{data}'></div>"]
    parts.append("</div>")
    if skipped:
        parts.append("<h2>Not plotted</h2><ul class='skipped'>")
        parts += [f"<li>{html.escape(plot.title)}: {html.escape(why)}</li>" for plot, why in skipped]
        parts.append("</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def render(runs: list[Run], plt) -> tuple[list[tuple[Plot, bytes]], list[tuple[Plot, str]]]:
    """Every plot drawn as PNG bytes, or the reason it is left out."""
    figures, skipped = [], []
    for plot in PLOTS:
        fig = plot.draw(runs, plt)
        if isinstance(fig, str):
            skipped.append((plot, fig))
            continue
        buf = io.BytesIO()
        if not fig.get_constrained_layout():
            fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        figures.append((plot, buf.getvalue()))
    return figures, skipped


def write_report(runs: list[Run], out: str, plt) -> str:
    """The PNGs and ``report.html`` into ``out``; a PNG of an earlier report whose plot is left
    out this time is removed (the directory matches the page). Returns the page's path."""
    figures, skipped = render(runs, plt)
    os.makedirs(out, exist_ok=True)
    for plot, png in figures:
        with open(os.path.join(out, plot.file), "wb") as f:
            f.write(png)
    for plot, why in skipped:
        stale = os.path.join(out, plot.file)
        if os.path.isfile(stale):
            os.remove(stale)
        print(f"{PROG}: not plotted: {plot.title}: {why}")
    page = os.path.join(out, "report.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(html_page(runs, figures, skipped))
    print(f"{PROG}: wrote {page} ({len(figures)} plots)")
    return page


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display); None when missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="gspo-train run directories")
    ap.add_argument("--out", default=None,
                    help="report directory (default: report/ in the first RUN_DIR)")
    ap.add_argument("--names", default=None, help="comma-separated run names for the legends "
                                                  "(default: the directory names)")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else run_names(args.runs)
    if len(names) != len(args.runs):
        return _user_error(f"--names gives {len(names)} names for {len(args.runs)} runs")
    out = args.out or os.path.join(args.runs[0], "report")
    try:
        runs = [load_run(path, name) for path, name in zip(args.runs, names)]
        if os.path.exists(out) and not os.path.isdir(out):
            raise ReportError(f"--out {out}: not a directory")
    except ReportError as exc:
        return _user_error(str(exc))
    plt = _pyplot()
    if plt is None:
        return _user_error("matplotlib is not installed (pip install matplotlib); no report "
                           "written", code=1)
    write_report(runs, out, plt)
    return 0


def _user_error(msg: str, code: int = 2) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
