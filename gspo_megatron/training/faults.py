"""Deterministic fault injection for crash tests: ``GSPO_FAULT=<point>:<step>`` makes the process
SIGKILL itself when it reaches ``point`` at RL step ``step``.

Points: ``step_start`` (before the rollout), ``mid_update`` (after the first optimiser step of the
update), ``checkpoint_write`` (checkpoint shards written, not yet renamed into place).
A no-op unless the variable is set.
"""

from __future__ import annotations

import os
import signal


def maybe_fail(point: str, step: int) -> None:
    spec = os.environ.get("GSPO_FAULT")
    if not spec:
        return
    want_point, _, want_step = spec.partition(":")
    if want_point == point and want_step.isdigit() and int(want_step) == step:
        os.kill(os.getpid(), signal.SIGKILL)
