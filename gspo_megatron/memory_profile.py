"""Where a CUDA run's memory peak comes from (``logging.memory_profile_steps``).

``gspo-plan`` predicts each phase's peak from the parts it knows (weights, gradients, optimizer
state, activations, log-prob logits, KV cache); a measured peak above it means something else is
live at the peak. :class:`MemoryProfile` records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``) over the first RL steps, then
:func:`peak_allocations` replays it: the largest number of allocated bytes, and the allocations
live at that moment grouped by the code that made them (their first stack frame in this
project, Megatron or ``torch.optim``), largest first. The summary is written as
``<run_dir>/memory_profile.json``: a few KiB, where the allocator's own snapshot is tens of MiB.

Only CUDA has the history; on CPU the profile is off with one warning.
"""

from __future__ import annotations

import json
import logging
import os

import torch

logger = logging.getLogger(__name__)

SITE_MARKERS = ("gspo_megatron/", "megatron/core/", "torch/optim/", "tools/")
"""An allocation's site is its first stack frame (innermost first) in one of these, else its
innermost frame: the code of ours or Megatron's that asked for the memory, not the torch
operator that allocated it."""


def allocation_site(frames: list[dict]) -> str:
    """``file:line function`` of the frame that stands for an allocation (:data:`SITE_MARKERS`);
    ``?`` without frames."""
    if not frames:
        return "?"
    chosen = next((f for f in frames if any(m in f.get("filename", "") for m in SITE_MARKERS)),
                  frames[0])
    name = chosen.get("filename", "?")
    for marker in SITE_MARKERS:
        if marker in name:
            name = marker + name.split(marker, 1)[1]
            break
    return f"{name}:{chosen.get('line', '?')} {chosen.get('name', '?')}"


def peak_allocations(trace: list[dict], top: int = 15) -> dict:
    """Replay one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``:
    events with ``action`` ``alloc`` / ``free_completed`` (``free_requested`` where a trace has no
    completed frees), ``addr``, ``size`` and ``frames``) and return the peak of allocated bytes
    (``peak_bytes``, ``peak_event``: its index), and the allocations live at it grouped by site
    (``sites``: ``[{"site", "bytes", "count"}]``, the ``top`` largest; ``other_bytes`` the rest).
    Allocations made before the trace began are not in it: the peak is over what the trace saw
    (:class:`MemoryProfile` adds what was allocated when it began)."""
    frees = ("free_completed",) if any(e.get("action") == "free_completed" for e in trace) \
        else ("free_requested",)
    live: dict[int, dict] = {}
    allocated = peak = 0
    peak_event, at_peak = -1, {}
    for i, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            allocated += event["size"]
            if allocated > peak:
                peak, peak_event, at_peak = allocated, i, dict(live)
        elif action in frees and event.get("addr") in live:
            allocated -= live.pop(event["addr"])["size"]
    sites: dict[str, list[int]] = {}
    for event in at_peak.values():
        acc = sites.setdefault(allocation_site(event.get("frames") or []), [0, 0])
        acc[0] += event["size"]
        acc[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {"peak_bytes": peak, "peak_event": peak_event, "events": len(trace),
            "sites": [{"site": s, "bytes": b, "count": c} for s, (b, c) in ranked[:top]],
            "other_bytes": sum(b for _, (b, _) in ranked[top:])}


class MemoryProfile:
    """The allocator's history over the first ``steps`` RL steps of a CUDA run, summarised into
    ``path`` (:func:`peak_allocations`). ``start()`` before the first step, ``step_done(i)``
    after each (the summary is written after step ``steps - 1``, or by ``close()`` if the run
    ends first)."""

    def __init__(self, steps: int, path: str, max_entries: int = 1_000_000):
        self.steps, self.path, self.max_entries = int(steps), path, max_entries
        self.recording = False
        self.start_bytes = 0
        """``torch.cuda.memory_allocated()`` when recording began (weights, gradient buffers,
        the optimizer's main copy: not in the trace)."""

    def start(self) -> None:
        if self.steps <= 0:
            return
        if not torch.cuda.is_available():
            logger.warning("logging.memory_profile_steps=%d: the allocator history needs CUDA; off",
                           self.steps)
            return
        self.start_bytes = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        self.recording = True

    def step_done(self, steps_done: int) -> None:
        if self.recording and steps_done >= self.steps:
            self.close()

    def close(self) -> None:
        """Write the summary and stop recording (nothing when not recording)."""
        if not self.recording:
            return
        self.recording = False
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        device = torch.cuda.current_device()
        traces = snapshot.get("device_traces") or [[]]
        summary = peak_allocations(traces[device] if device < len(traces) else [])
        summary.update(steps=self.steps, start_bytes=self.start_bytes,
                       peak_total_bytes=self.start_bytes + summary["peak_bytes"],
                       max_memory_allocated=torch.cuda.max_memory_allocated())
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(summary, f, indent=1)
        logger.info("memory profile of the first %d RL steps: peak %.2f GiB, written to %s",
                    self.steps, summary["peak_bytes"] / 2**30, self.path)
