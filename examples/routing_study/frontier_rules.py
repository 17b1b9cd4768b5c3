"""The frontier study's stability rule and frontier selection: pure Python on ``metrics.jsonl`` rows.

A run is judged by :class:`StabilityRule` (stated once, applied to every run, as it goes and at
its end):

* **collapsed** (the run is stopped as soon as the rule fires) at the first step where
  - any of ``reward/mean``, ``loss/total``, ``optim/grad_norm``, ``entropy/mean`` is non-finite,
    or the trainer skipped an update as non-finite (``faults/skipped_updates`` > 0), or
  - the reward of the last ``window`` steps averages below ``reward_collapse`` x the start
    reward (the warm-up policy's sampled reward, measured once for the whole study; else step
    0's), or
  - the gradient norm (before clipping) of the last ``window`` steps averages above
    ``grad_norm_limit``, or
  - the token entropy of the last ``window`` steps averages below ``entropy_collapse`` x step 0's
    while their reward is no better than the start (a policy that sharpens as it learns is not
    collapsed: healthy runs here halve their entropy while the reward rises);
* **degraded**: it ran to the end, but its final reward (the last ``final_window`` steps) is below
  the start reward by more than ``reward_margin``;
* **stable** otherwise.

The online rule uses a halving of the reward, not "below its start": one rollout batch of 64
answers is noisy (its mean has a standard error of ~0.06 here), and a run that dips at step 5 and
recovers is not collapsed. The end-of-run comparison uses the whole final window. The reference is
measured once (``frontier.py``: 16 samples on each held-out problem) rather than taken from a run's
step 0 for the same reason: step 0 alone was 0.19, 0.22 and 0.39 on three seeds of one policy
whose reward is 0.27. The gradient limit is absolute: step 0's norm can be near 0 (a batch of
tied groups), and 10 is 10x the clip threshold of 1.0 (healthy runs here average 0.5-1.0).

A setting is stable when every seed run at it is stable. Along an ordered axis (learning rate,
updates per rollout batch) the largest stable value of a seed is the largest value at which that
seed and every smaller value are stable (a stable run above an unstable one does not extend it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

FINITE_KEYS = ("reward/mean", "loss/total", "optim/grad_norm", "entropy/mean")
"""Metrics that must stay finite (a NaN/Inf here is a collapse)."""
STATUSES = ("stable", "degraded", "collapsed")


@dataclass(frozen=True)
class StabilityRule:
    """Thresholds of the rule above (the study's defaults; every one is a stated choice)."""

    window: int = 5
    """Steps in the rolling window of the online rules (from the first full window, steps
    0..window-1, on)."""
    final_window: int = 10
    """Steps whose mean reward is the run's final reward (a longer window: less noise)."""
    reward_collapse: float = 0.5
    """Collapsed: window reward < this x the start reward (step 0)."""
    grad_norm_limit: float = 10.0
    """Collapsed: window mean gradient norm (before clipping) > this."""
    entropy_collapse: float = 0.1
    """Collapsed: window mean token entropy < this x step 0's, with the window reward <= start."""
    reward_margin: float = 0.05
    """Degraded: final reward < start - this (absolute; ~ one standard error of a start batch)."""

    def __post_init__(self):
        if self.window < 1 or self.final_window < 1:
            raise ValueError(f"windows must be >= 1, got {self.window}, {self.final_window}")

    def collapse(self, rows: Sequence[Mapping], start_reward: float | None = None
                 ) -> tuple[str, int] | None:
        """The first rule ``rows`` (one dict per RL step, in order) break: ``(reason, step)``,
        or None. Evaluated step by step, so the step does not depend on when it is called.
        ``start_reward``: the reward reference (None: step 0's)."""
        start = dict(rows[0]) if rows else {}
        if start_reward is not None:
            start["reward/mean"] = start_reward
        for i, row in enumerate(rows):
            step = int(row.get("step", i))
            bad = [k for k in FINITE_KEYS if k in row and not _is_finite(row[k])]
            if bad:
                return f"non-finite {bad[0]}", step
            if (row.get("faults/skipped_updates") or 0) > 0:
                return "update skipped as non-finite", step
            if i + 1 < self.window or i == 0:
                continue
            win = rows[i + 1 - self.window:i + 1]
            for key, factor, below, what in (
                    ("reward/mean", self.reward_collapse, True, "reward"),
                    ("optim/grad_norm", self.grad_norm_limit, False, "gradient norm"),
                    ("entropy/mean", self.entropy_collapse, True, "entropy")):
                ref = 1.0 if key == "optim/grad_norm" else start.get(key)  # the limit is absolute
                now = mean(r.get(key) for r in win)
                if ref is None or not _is_finite(ref) or not _is_finite(now):
                    continue
                if key == "entropy/mean" and not mean(r.get("reward/mean") for r in win) \
                        <= start.get("reward/mean", math.inf):
                    continue  # sharper and better: learning, not a collapse
                if (now < factor * ref) if below else (now > factor * ref):
                    return (f"{what} {now:.3g} {'<' if below else '>'} {factor:g}"
                            + ("" if key == "optim/grad_norm" else f" x start {ref:.3g}")), step
        return None

    def verdict(self, rows: Sequence[Mapping], start_reward: float | None = None,
                failed: bool = False) -> "Verdict":
        """Judge a finished (or stopped) run. ``start_reward``: the reference for "fell below its
        start" (None: the run's own step 0); ``failed``: the trainer itself stopped on
        non-finite values (its exit code)."""
        if not rows:
            return Verdict("collapsed" if failed else "degraded", "no metrics", -1, math.nan,
                           math.nan, 0)
        start = rows[0].get("reward/mean", math.nan) if start_reward is None else start_reward
        final = mean(r.get("reward/mean") for r in rows[-self.final_window:])
        hit = self.collapse(rows, start_reward)
        if hit is None and failed:
            hit = ("the trainer stopped on non-finite values", int(rows[-1].get("step", len(rows) - 1)))
        if hit is not None:
            return Verdict("collapsed", hit[0], hit[1], start, final, len(rows))
        if _is_finite(start) and _is_finite(final) and final < start - self.reward_margin:
            return Verdict("degraded", f"final reward {final:.3f} < start {start:.3f} - "
                           f"{self.reward_margin:g}", len(rows) - 1, start, final, len(rows))
        return Verdict("stable", "", -1, start, final, len(rows))


@dataclass(frozen=True)
class Verdict:
    """What :meth:`StabilityRule.verdict` says of one run."""

    status: str
    """One of ``STATUSES``."""
    reason: str
    step: int
    """The step the rule fired at (-1: stable)."""
    start_reward: float
    final_reward: float
    """Mean reward of the last ``final_window`` steps it logged."""
    steps: int
    """RL steps it logged."""

    @property
    def stable(self) -> bool:
        return self.status == "stable"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def largest_stable(stable: Mapping[Hashable, Sequence[bool]]) -> tuple[Hashable | None, list]:
    """The frontier along one ordered axis. ``stable``: ``{value: [stable per seed]}`` (every
    value the same seeds, in the same order; values sorted ascending by the caller's order).

    Returns ``(all_seeds, per_seed)``: the largest value at which every seed is stable at it and
    at every smaller value (None: not even the smallest), and the same per seed ``[seeds]``."""
    values = list(stable)
    n = len(next(iter(stable.values()))) if stable else 0
    per_seed: list = []
    for s in range(n):
        best = None
        for v in values:
            if not stable[v][s]:
                break
            best = v
        per_seed.append(best)
    best_all = None
    for v in values:
        if not all(stable[v]):
            break
        best_all = v
    return best_all, per_seed


def mean(values) -> float:
    """Mean of the finite numbers among ``values`` (NaN when there are none)."""
    vals = [float(v) for v in values if _is_finite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
