"""Deterministic fault injection for crash and non-finite tests, passed to the trainer as an object.

:class:`FaultInjector` is a no-op unless built from a spec ``<point>:<step>[,<point>:<step>...]``
(the CLI reads it from ``GSPO_FAULT``; tests set that variable on the ``gspo-train`` they start):

* kill points, the process SIGKILLs itself: ``step_start`` (before the rollout), ``mid_update``
  (after the first optimiser step of the update), ``checkpoint_write`` (checkpoint shards written,
  not yet renamed into place), ``rollout_sample`` (a rollout rank of ``rollout.placement:
  separate``, before it samples the step), ``mid_episode`` (a multi-turn rollout, after the
  environments' first answers: episodes half played, their KV held); ``stop_signal`` sends SIGTERM instead (a trainer rank,
  at the start of the step: SLURM's notice of the end, which the run answers with a checkpoint
  after that step and exit code 75);
* NaN points, a tensor is replaced by NaNs: ``nan_rewards``, ``nan_advantages``, ``nan_logprobs``
  (old-policy log-probs), ``nan_loss`` (the update's log-probs, so the loss), ``nan_grads`` (one
  reduced gradient, before the optimiser step).

The trainer sets :attr:`FaultInjector.step` at the start of every RL step.
"""

from __future__ import annotations

import os
import signal

import torch

KILL_POINTS = ("step_start", "mid_update", "checkpoint_write", "rollout_sample", "stop_signal",
               "mid_episode")
NAN_POINTS = ("nan_rewards", "nan_advantages", "nan_logprobs", "nan_loss", "nan_grads")


class FaultInjector:
    """Kill or poison at ``(point, step)`` pairs; with no spec every call is a no-op."""

    def __init__(self, spec: str | None = None):
        self.step = 0
        self.requests: set[tuple[str, int]] = set()
        for item in (spec or "").split(","):
            point, _, step = item.strip().partition(":")
            if not point:
                continue
            if point not in KILL_POINTS + NAN_POINTS or not step.isdigit():
                raise ValueError(f"GSPO_FAULT: {item.strip()!r} is not <point>:<step> with a point "
                                 f"in {', '.join(KILL_POINTS + NAN_POINTS)}")
            self.requests.add((point, int(step)))

    @classmethod
    def from_env(cls) -> "FaultInjector":
        return cls(os.environ.get("GSPO_FAULT"))

    def requested(self, point: str, step: int | None = None) -> bool:
        return bool(self.requests) and (point, self.step if step is None else step) in self.requests

    def maybe_fail(self, point: str, step: int | None = None) -> None:
        """SIGKILL this process (``stop_signal``: SIGTERM) if ``point`` is requested at ``step``
        (default: the current step)."""
        if self.requested(point, step):
            os.kill(os.getpid(), signal.SIGTERM if point == "stop_signal" else signal.SIGKILL)

    def corrupt(self, point: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` filled with NaN if ``point`` is requested at the current step, else as is."""
        return torch.full_like(tensor, float("nan")) if self.requested(point) else tensor
