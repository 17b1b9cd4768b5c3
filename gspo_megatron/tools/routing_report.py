"""Markdown + PNG report of MoE routing diagnostics from one or more runs' ``metrics.jsonl``.

    gspo-routing-report RUN_DIR [RUN_DIR ...] --out REPORT_DIR [--names a,b,c]

Each RUN_DIR holds ``metrics.jsonl`` (flat keys per step, as written by gspo-train) and optionally
``summary.json`` (held-out accuracy before/after). Writes ``REPORT_DIR/README.md`` and plots:
``change_rate_heatmap.png`` (route change rate per MoE layer over steps, one panel per run),
``change_rate.png`` (overall change rate, Jaccard, replay gap), ``expert_load.png`` (mean share of
each expert per layer, and load imbalance over steps), ``clip_fraction.png``, ``reward.png``,
``route_vs_ratio.png`` (mean |log ratio| and clip fraction of positions with/without a changed
route), ``rollout_mismatch.png`` (rollout engine vs trainer: ``kl/rollout_vs_train``, the
share of routes and tokens whose routes differ, per MoE layer, and the mismatch correction's
truncated / masked shares; with R3 or diagnostics, docs/routing.md). Runs are shown side by side. Needs matplotlib (``pip install matplotlib``); the rest of
gspo_megatron does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        sys.exit("gspo-routing-report: matplotlib is required for the plots: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: str) -> list[dict]:
    """Steps of ``metrics.jsonl`` in order; a step logged twice (after a resume) keeps the last."""
    path = os.path.join(run_dir, "metrics.jsonl")
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals) if vals else float("nan")


def layer_keys(rows: list[dict], stem: str) -> list[str]:
    pat = re.compile(re.escape(stem) + r"/layer_(\d+)$")
    found = {int(m.group(1)) for r in rows for k in r if (m := pat.match(k))}
    return [f"{stem}/layer_{i}" for i in sorted(found)]


def load_matrix(rows: list[dict]) -> list[list[float]]:
    """Mean share of each expert per layer over the run ``[layers][experts]``."""
    pat = re.compile(r"routing/load/layer_(\d+)/expert_(\d+)$")
    sums: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if m := pat.match(k):
                sums.setdefault((int(m.group(1)), int(m.group(2))), []).append(v)
    if not sums:
        return []
    L = 1 + max(l for l, _ in sums)
    E = 1 + max(e for _, e in sums)
    return [[_mean(sums.get((l, e), [])) for e in range(E)] for l in range(L)]


def _fmt(v: float, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def summarize(name: str, run_dir: str, rows: list[dict]) -> dict:
    def col(key, last=None):
        _, ys = series(rows, key)
        return _mean(ys[-last:] if last else ys)

    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    n = len(rows)
    k = max(1, min(10, n // 4))
    return {
        "run": name, "steps": n,
        "change_rate": col("routing/change_rate"),
        "change_rate_last": col("routing/change_rate", k),
        "drift_1": col("routing/drift/after_1_updates"),
        "drift": col("routing/drift/change_rate"),
        "jaccard": col("routing/jaccard"),
        "token_change_rate": col("routing/token_change_rate"),
        "abs_lr_changed": col("routing/abs_log_ratio_changed"),
        "abs_lr_unchanged": col("routing/abs_log_ratio_unchanged"),
        "clip_changed": col("routing/clipfrac_changed"),
        "clip_unchanged": col("routing/clipfrac_unchanged"),
        "replay_gap_abs": col("routing/replay_gap_abs_logprob"),
        "replay_gap_k3": col("routing/replay_gap_k3"),
        "entropy": col("routing/entropy"),
        "imbalance": col("routing/load_imbalance"),
        "clip_fraction": col("clip/fraction"),
        "clip_token_fraction": col("clip/token_fraction"),
        "reward_first": _mean(series(rows, "reward/mean")[1][:k]),
        "reward_last": _mean(series(rows, "reward/mean")[1][-k:]),
        "acc_before": summary.get("accuracy_before", float("nan")),
        "acc_after": summary.get("accuracy_after", float("nan")),
        "kl_rollout": col("kl/rollout_vs_train"),
        "rollout_change_rate": col("routing/rollout/change_rate"),
        "rollout_token_change_rate": col("routing/rollout/token_change_rate"),
        "rollout_abs_changed": col("routing/rollout/abs_log_ratio_changed"),
        "rollout_abs_unchanged": col("routing/rollout/abs_log_ratio_unchanged"),
        "correction_weight_max": col("correction/weight_max"),
        "correction_truncated": col("correction/truncated_fraction"),
        "correction_masked": col("correction/masked_fraction"),
        "step_s": _mean(series(rows, "perf/step_s")[1][1:]),
        "diag_s": col("perf/routing_diagnostics_s"),
        "window": k,
    }


def plot_all(runs: list[tuple[str, str, list[dict]]], out: str) -> list[str]:
    plt = _matplotlib()
    files = []
    n = len(runs)

    # 1. change-rate heatmap per layer
    fig, axes = plt.subplots(1, n + 1, figsize=(4.5 * n + 0.6, 3.2), squeeze=False,
                             gridspec_kw={"width_ratios": [1] * n + [0.05]})
    cax = axes[0][n]
    vmax = max([max(series(rows, k)[1] or [0]) for _, _, rows in runs
                for k in layer_keys(rows, "routing/change_rate")] or [1e-9]) or 1e-9
    im = None
    for ax, (name, _, rows) in zip(axes[0][:n], runs):
        keys = layer_keys(rows, "routing/change_rate")
        if not keys:
            ax.set_title(f"{name}: no routing metrics")
            continue
        steps = [r["step"] for r in rows]
        grid = [[r.get(k, float("nan")) for r in rows] for k in keys]
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=vmax,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(keys) - 0.5))
        ax.set_yticks(range(len(keys)))
        ax.set_title(f"{name}: route change rate")
        ax.set_xlabel("RL step")
        ax.set_ylabel("MoE layer")
    if im is not None:
        fig.colorbar(im, cax=cax, label="share changed")
    files.append(_save(fig, out, "change_rate_heatmap.png", plt))

    # 2. overall change rate, Jaccard, replay gap
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
    for name, _, rows in runs:
        axes[0].plot(*series(rows, "routing/change_rate"), label=name)
        axes[1].plot(*series(rows, "routing/jaccard"), label=name)
        axes[2].plot(*series(rows, "routing/replay_gap_abs_logprob"), label=name)
    for ax, t in zip(axes, ("route change rate (all layers)", "top-k Jaccard overlap",
                            "replay gap: mean |logp free - logp replayed|")):
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=8)
    files.append(_save(fig, out, "change_rate.png", plt))

    # 3. expert load: mean share heatmap per run + imbalance over steps
    fig, axes = plt.subplots(1, n + 1, figsize=(4 * (n + 1), 3.2), squeeze=False)
    for ax, (name, _, rows) in zip(axes[0], runs):
        mat = load_matrix(rows)
        if mat:
            im = ax.imshow(mat, aspect="auto", origin="lower", cmap="viridis", vmin=0)
            fig.colorbar(im, ax=ax, shrink=0.8)
            ax.set_xlabel("expert")
            ax.set_ylabel("MoE layer")
        ax.set_title(f"{name}: mean expert share", fontsize=10)
    ax = axes[0][n]
    for name, _, rows in runs:
        ax.plot(*series(rows, "routing/load_imbalance"), label=name)
    ax.set_title("load imbalance (max/mean, mean over layers)", fontsize=10)
    ax.set_xlabel("RL step")
    ax.legend(fontsize=8)
    files.append(_save(fig, out, "expert_load.png", plt))

    # 4. clip fractions
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, _, rows in runs:
        axes[0].plot(*series(rows, "clip/fraction"), label=name)
        axes[1].plot(*series(rows, "clip/token_fraction"), label=name)
    axes[0].set_title("clip/fraction (loss's unit: sequences for GSPO, tokens for GRPO)", fontsize=9)
    axes[1].set_title("clip/token_fraction (token-weighted)", fontsize=9)
    for ax in axes:
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=8)
    files.append(_save(fig, out, "clip_fraction.png", plt))

    # 5. reward
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, _, rows in runs:
        ax.plot(*series(rows, "reward/mean"), label=name, alpha=0.8)
    ax.set_title("reward/mean (training rollouts)", fontsize=10)
    ax.set_xlabel("RL step")
    ax.legend(fontsize=8)
    files.append(_save(fig, out, "reward.png", plt))

    # 6. route changes vs log-ratios and clipping
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (name, _, rows) in enumerate(runs):
        c = f"C{i}"
        axes[0].plot(*series(rows, "routing/abs_log_ratio_changed"), color=c, label=f"{name} changed")
        axes[0].plot(*series(rows, "routing/abs_log_ratio_unchanged"), color=c, ls="--",
                     label=f"{name} unchanged")
        axes[1].plot(*series(rows, "routing/clipfrac_changed"), color=c, label=f"{name} changed")
        axes[1].plot(*series(rows, "routing/clipfrac_unchanged"), color=c, ls="--",
                     label=f"{name} unchanged")
    axes[0].set_title("mean |log pi/pi_old| of positions by route change", fontsize=10)
    axes[1].set_title("clip fraction of positions by route change", fontsize=10)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7)
    files.append(_save(fig, out, "route_vs_ratio.png", plt))
    if any(series(rows, "routing/rollout/change_rate")[1] or series(rows, "correction/weight_mean")[1]
           for _, _, rows in runs):
        files.append(_plot_rollout_mismatch(runs, out, plt))
    return files


def _plot_rollout_mismatch(runs, out: str, plt) -> str:
    """Rollout engine vs trainer (R3, mismatch correction): the KL, route disagreement over steps
    and per MoE layer, and the correction's truncated / masked shares."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.4))
    width = 0.8 / max(len(runs), 1)
    for i, (name, _, rows) in enumerate(runs):
        c = f"C{i}"
        axes[0].plot(*series(rows, "kl/rollout_vs_train"), color=c, label=name)
        axes[1].plot(*series(rows, "routing/rollout/change_rate"), color=c, label=f"{name} routes")
        axes[1].plot(*series(rows, "routing/rollout/token_change_rate"), color=c, ls="--",
                     label=f"{name} tokens")
        keys = layer_keys(rows, "routing/rollout/change_rate")
        axes[2].bar([j + i * width for j in range(len(keys))],
                    [_mean(series(rows, k)[1]) for k in keys], width=width, color=c, label=name)
        axes[3].plot(*series(rows, "correction/truncated_fraction"), color=c,
                     label=f"{name} truncated")
        axes[3].plot(*series(rows, "correction/masked_fraction"), color=c, ls="--",
                     label=f"{name} masked")
    axes[0].set_yscale("log")
    n_layers = max((len(layer_keys(rows, "routing/rollout/change_rate")) for _, _, rows in runs),
                   default=0)
    axes[2].set_xticks([j + width * (len(runs) - 1) / 2 for j in range(n_layers)],
                       [str(j) for j in range(n_layers)])
    titles = ("kl/rollout_vs_train (k3, engine vs trainer)",
              "routes (solid) / tokens (dashed) differing", "routes differing per MoE layer (mean)",
              "correction: truncated (solid) / masked (dashed)")
    for ax, t in zip(axes, titles):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("MoE layer" if ax is axes[2] else "RL step")
        ax.legend(fontsize=7)
    return _save(fig, out, "rollout_mismatch.png", plt)


def _save(fig, out, name, plt) -> str:
    import warnings

    with warnings.catch_warnings():  # colorbars shared by several panels: layout is approximate
        warnings.simplefilter("ignore")
        fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return name


def markdown(summaries: list[dict], files: list[str], title: str) -> str:
    cols = [
        ("run", "run", None), ("steps", "steps", None),
        ("change_rate", "route change rate", 4), ("change_rate_last", "change rate (last steps)", 4),
        ("drift_1", "drift after 1 update (every step)", 4),
        ("drift", "drift, mean over updates (every step)", 4),
        ("jaccard", "top-k Jaccard", 4), ("token_change_rate", "positions with a change", 4),
        ("abs_lr_changed", "mean abs log-ratio, changed", 4),
        ("abs_lr_unchanged", "mean abs log-ratio, unchanged", 4),
        ("clip_changed", "clip frac, changed", 4), ("clip_unchanged", "clip frac, unchanged", 4),
        ("replay_gap_abs", "replay gap mean abs dlogp", 4), ("replay_gap_k3", "replay gap k3", 6),
        ("entropy", "router entropy (nats)", 3), ("imbalance", "load max/mean", 3),
        ("clip_fraction", "clip/fraction", 4), ("clip_token_fraction", "clip/token_fraction", 4),
        ("reward_first", "reward, first steps", 3), ("reward_last", "reward, last steps", 3),
        ("acc_before", "held-out acc before", 3), ("acc_after", "held-out acc after", 3),
        ("kl_rollout", "kl/rollout_vs_train", 6),
        ("rollout_change_rate", "rollout vs trainer: routes differing", 4),
        ("rollout_token_change_rate", "rollout vs trainer: tokens with a differing route", 4),
        ("rollout_abs_changed", "abs dlogp rollout vs trainer, route differs", 4),
        ("rollout_abs_unchanged", "abs dlogp rollout vs trainer, same route", 4),
        ("correction_weight_max", "correction: max weight", 4),
        ("correction_truncated", "correction: truncated share", 4),
        ("correction_masked", "correction: masked share", 4),
        ("step_s", "step time (s)", 3), ("diag_s", "diagnostics time per step (s)", 3),
    ]
    lines = [f"# {title}", "",
             "Means over all RL steps unless noted; 'first/last steps' average the first/last "
             f"{summaries[0]['window'] if summaries else '-'} steps. Route statistics are measured "
             "after each optimiser step on the minibatch it used, against the old policy's routes; "
             "'drift' rows come from the update forwards themselves, on every step "
             "(docs/routing.md).", ""]
    lines.append("| metric | " + " | ".join(s["run"] for s in summaries) + " |")
    lines.append("|---|" + "---|" * len(summaries))
    for key, label, digits in cols[1:]:
        vals = [s[key] if digits is None else _fmt(s[key], digits) for s in summaries]
        lines.append(f"| {label} | " + " | ".join(str(v) for v in vals) + " |")
    lines.append("")
    for f in files:
        lines += [f"![{f}]({f})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gspo-routing-report", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--names", default=None, help="comma-separated display names")
    ap.add_argument("--out", required=True, help="report directory (README.md + PNGs)")
    ap.add_argument("--title", default="Routing report")
    ap.add_argument("--no-plots", action="store_true", help="Markdown table only (no matplotlib)")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else [os.path.basename(os.path.normpath(r))
                                                       for r in args.runs]
    if len(names) != len(args.runs):
        ap.error("--names needs one name per run")
    os.makedirs(args.out, exist_ok=True)
    runs = [(n, d, read_metrics(d)) for n, d in zip(names, args.runs)]
    summaries = [summarize(n, d, rows) for n, d, rows in runs]
    files = [] if args.no_plots else plot_all(runs, args.out)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(markdown(summaries, files, args.title))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summaries, f, indent=2)
    print(f"wrote {os.path.join(args.out, 'README.md')} and {len(files)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
