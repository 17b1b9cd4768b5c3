"""TensorBoard event files read back with TensorBoard's own reader, and what they should hold
for a ``metrics.jsonl`` (the unit and end-to-end tests of ``logging.tensorboard_dir``)."""

from __future__ import annotations

import numpy as np


def tensorboard_scalars(log_dir, purge_orphaned_data=True) -> dict[str, list[tuple[int, float, float]]]:
    """``{tag: [(step, value, wall time), ...]}`` as TensorBoard's reader loads ``log_dir``
    (``purge_orphaned_data``: the reader's default, hiding what a restart's ``purge_step`` hides)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0},
                           purge_orphaned_data=purge_orphaned_data)
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def as_logged(records: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """What the reader should hold for ``metrics.jsonl``'s records: every numeric value (as the
    float32 a TensorBoard scalar stores), at its step and time."""
    out: dict[str, list] = {}
    for r in records:
        for key, value in r.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out.setdefault(key, []).append((r["step"], float(np.float32(value)), r["time"]))
    return out
