"""Deterministic fault injection for crash and non-finite tests.

``GSPO_FAULT=<point>:<step>[,<point>:<step>...]`` (a no-op unless set):

* kill points, the process SIGKILLs itself: ``step_start`` (before the rollout), ``mid_update``
  (after the first optimiser step of the update), ``checkpoint_write`` (checkpoint shards written,
  not yet renamed into place);
* NaN points, a tensor is replaced by NaNs: ``nan_rewards``, ``nan_advantages``, ``nan_logprobs``
  (old-policy log-probs), ``nan_loss`` (the update's log-probs, so the loss), ``nan_grads`` (one
  reduced gradient, before the optimiser step).

The trainer sets the current RL step with :func:`set_step`.
"""

from __future__ import annotations

import os
import signal

import torch

_STEP = 0


def set_step(step: int) -> None:
    global _STEP
    _STEP = step


def _requested(point: str, step: int | None = None) -> bool:
    spec = os.environ.get("GSPO_FAULT")
    if not spec:
        return False
    step = _STEP if step is None else step
    for item in spec.split(","):
        want_point, _, want_step = item.strip().partition(":")
        if want_point == point and want_step.isdigit() and int(want_step) == step:
            return True
    return False


def maybe_fail(point: str, step: int | None = None) -> None:
    """SIGKILL this process if ``point`` is requested at ``step`` (default: the current step)."""
    if _requested(point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_corrupt(point: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` filled with NaN if ``point`` is requested at the current step, else unchanged."""
    if _requested(point):
        return torch.full_like(tensor, float("nan"))
    return tensor
