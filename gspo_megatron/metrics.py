"""Where step metrics go: ``metrics.jsonl`` in the run directory, a progress line, wandb and
TensorBoard.

Only the logging rank writes. What each metric means is registered in
:mod:`gspo_megatron.metric_docs` (``docs/reference/metrics.md`` is generated from it). wandb and
TensorBoard are imported lazily (a warning when asked for and not installed); wandb runs online
when the user is logged in (:func:`wandb_mode`: one line says which), offline otherwise, and tests
disable it (``WANDB_MODE=disabled``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

from gspo_megatron.progress import Progress

logger = logging.getLogger(__name__)

# Shown in the progress line, in this order, when present.
_PROGRESS_KEYS = (
    ("reward/mean", "reward"), ("reward/accuracy", "acc"), ("loss/policy", "loss"),
    ("clip/fraction", "clip"), ("gate/weight_mean", "gate"), ("kl/rollout_vs_train", "kl_rt"),
    ("eval/accuracy", "heldout"),
    ("perf/step_s", "s"),
)


def wandb_mode(env, wandb) -> tuple[str, str]:
    """``(mode, why)`` for ``wandb.init``: the user's ``WANDB_MODE`` when set; online when logged
    in (``WANDB_API_KEY``, a netrc entry for the wandb host as ``wandb login`` writes, or a key
    ``wandb.api.api_key`` finds in wandb's settings); else offline, to be synced later."""
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"], "WANDB_MODE"
    if env.get("WANDB_API_KEY"):
        return "online", "logged in: WANDB_API_KEY"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if os.path.isfile(path) and netrc.netrc(path).authenticators(host):
            return "online", f"logged in: {path}"
    except (netrc.NetrcParseError, OSError):
        pass  # wandb's own lookup below
    try:
        if getattr(getattr(wandb, "api", None), "api_key", None):
            return "online", "logged in: wandb settings"
    except Exception:  # noqa: BLE001 - a settings lookup that fails means: not logged in
        pass
    return "offline", ("not logged in: no WANDB_API_KEY, no `wandb login`; the run is kept "
                       "under the run directory's wandb/ for `wandb sync`")


class MetricsLogger:
    """Append one JSON object per step to ``<run_dir>/metrics.jsonl``, and to wandb and
    TensorBoard if configured."""

    def __init__(self, run_dir: str, enabled: bool, progress: Progress | None = None,
                 wandb_project: str | None = None, run_config: dict | None = None,
                 resume_step: int | None = None,
                 extra_progress: tuple[tuple[str, str], ...] = (),
                 tensorboard_dir: str | None = None):
        """``progress``: the RL steps' display, told each step's line (None: no line).
        ``extra_progress``: more ``(metric, short name)`` pairs for that line, shown after the
        standard ones (e.g. the sampled evaluation's ``eval/pass@k``). ``resume_step``: the last
        step a resumed run keeps (-1: none); later ones are dropped from ``metrics.jsonl`` and
        hidden in ``tensorboard_dir``, since the run logs them again."""
        self.enabled = enabled
        self.progress = progress
        self.progress_keys = _PROGRESS_KEYS + tuple(extra_progress)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._wandb = None
        self._tensorboard = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        if tensorboard_dir:
            self._tensorboard = _tensorboard_writer(tensorboard_dir, resume_step)
        if wandb_project and os.environ.get("WANDB_MODE") != "disabled":
            try:
                import wandb
            except ImportError:
                logger.warning("logging.wandb_project is set but wandb is not installed; skipping")
            else:
                mode, why = wandb_mode(os.environ, wandb)
                print(f"wandb: {mode} ({why})", flush=True)
                self._wandb = wandb.init(project=wandb_project, dir=run_dir, config=run_config,
                                         mode=mode, resume="allow")

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines for steps after the checkpoint (they will be redone)."""
        if not os.path.isfile(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    if json.loads(line).get("step", -1) <= step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a line cut by a crash ends the usable log
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                value = value.item() if hasattr(value, "item") else value
                if isinstance(value, (int, float)):  # (non-finite ones too: TensorBoard shows them)
                    self._tensorboard.add_scalar(key, float(value), step, walltime=record["time"])
            # Every step on disk at once: a killed run keeps the steps its checkpoint covers.
            self._tensorboard.flush()
        if self.progress is not None:
            parts = [f"step {step}"] + [
                f"{short} {record[key]:.4g}" for key, short in self.progress_keys
                if isinstance(record.get(key), (int, float))]
            self.progress.update(step + 1, " | ".join(parts))

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _tensorboard_writer(log_dir: str, resume_step: int | None):
    """A ``SummaryWriter`` into ``log_dir``; None (one warning) without the tensorboard package.
    ``purge_step`` = the first step this process logs: TensorBoard's readers then drop the events
    an earlier process wrote for it and later steps (a run resumed from a checkpoint redoes them),
    as ``metrics.jsonl`` is truncated; the event files themselves are append-only."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning("logging.tensorboard_dir is set but tensorboard is not installed "
                       "(pip install tensorboard); no TensorBoard events")
        return None
    return SummaryWriter(log_dir, purge_step=None if resume_step is None else resume_step + 1)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: str) -> list[dict]:
    """All records of a ``metrics.jsonl``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for_device() -> None:
    """Block until queued CUDA work is done, so a lap measures the GPU's time, not the launches'
    (one synchronize per lap: a few per step)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class MemoryPeaks:
    """This rank's peak CUDA memory allocated by torch (GiB) per phase of a step, the figures
    ``gspo-plan`` predicts one by one: ``phase(key)`` records the peak since the previous phase
    (or construction) under ``key`` and starts a new one; :meth:`metrics` adds
    ``perf/peak_mem_gib``, the step's peak (the largest phase). Per step, not per process: the
    first step after a resume used to report the checkpoint load's peak (+3.5 GiB on the
    Qwen3-30B-A3B slice, docs/benchmarks.md section 6). Empty without CUDA."""

    def __init__(self):
        import torch

        self.on = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.peaks: dict[str, float] = {}
        if self.on:
            torch.cuda.reset_peak_memory_stats()

    def phase(self, key: str) -> None:
        if not self.on:
            return
        import torch

        self.peaks[key] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()

    def metrics(self) -> dict[str, float]:
        if not self.peaks:
            return {}
        return {**self.peaks, "perf/peak_mem_gib": max(self.peaks.values())}


class Stopwatch:
    """Wall-clock laps of a step: ``lap(key)`` records the seconds since the previous lap (or the
    start) under ``key``; ``total(key)`` adds the seconds since the start and returns every lap.
    With CUDA each lap first waits for the GPU."""

    def __init__(self):
        wait_for_device()
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, key: str) -> float:
        """Seconds since the previous lap, added to ``key`` (a stage run several times in a step,
        e.g. rollout under dynamic sampling, accumulates)."""
        wait_for_device()
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.laps[key] = self.laps.get(key, 0.0) + seconds
        return seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def total(self, key: str) -> dict[str, float]:
        wait_for_device()
        self.laps[key] = self.elapsed()
        return dict(self.laps)
