"""The one seam between the RL loop and where a step's samples come from.

The :class:`~gspo_megatron.trainer.Trainer` asks a :class:`RolloutSource` for each step's
samples, hands it the weights after every optimizer step and checkpoints its state; it never asks
where the rollouts run. Two implementations:

* :class:`LocalRollouts` (``rollout.placement: colocated``): this process samples with the live
  policy, owning the partial-rollout pool (:class:`~gspo_megatron.rollouts.sampling.StepSampler`);
* :class:`~gspo_megatron.rollouts.remote.RemoteRollouts` (``rollout.placement: separate``): the
  rollout ranks sample ``rollout.max_staleness`` steps ahead; the weights go to them.

What a checkpoint keeps of a source (:meth:`RolloutSource.state`) names its placement, so a run
resumed under another placement either takes it over or is refused in one line
(:func:`check_resumable`).
"""

from __future__ import annotations

from typing import Protocol

from gspo_megatron.metrics import Stopwatch
from gspo_megatron.policy import Policy
from gspo_megatron.rollouts.sampling import StepSampler
from gspo_megatron.stages import StepSamples


class RolloutSource(Protocol):
    """Where the samples of each RL step come from."""

    placement: str
    """``rollout.placement`` of this source (recorded in its checkpoint state)."""

    def start(self, step: int, state: dict | None) -> None:
        """Training begins (or resumes) at ``step``; ``state``: what :meth:`state` returned at the
        checkpoint resumed from (None: a fresh run, or a checkpoint without rollout state)."""

    def next(self, step: int, watch: Stopwatch) -> tuple[StepSamples, dict[str, float]]:
        """Step ``step``'s samples and the ``perf/*`` of the process that sampled them (empty:
        this process's laps on ``watch``); raises :class:`~gspo_megatron.stages.SkipStep`."""

    def state(self, step: int, stop: bool = False) -> dict:
        """What a checkpoint at ``step`` keeps of the rollouts (in flight, not yet trained on).
        The next rollout after it runs as a run resumed from it will: continued prefixes are
        prefilled again, except at a ``stop`` (a signal: the run not stopped would have gone on
        without a checkpoint), where the engine's held requests are kept whole instead."""

    def publish(self, policy: Policy, version: int, stop: bool) -> float | None:
        """The weights after the optimizer step that made ``version``, for the next rollouts; or
        ``stop`` once training ends (collective over the trainer ranks). Returns the seconds it
        took, None when there is nothing to publish (the rollouts read the live policy)."""

    def close(self) -> None:
        """Release what the source started (after an error too)."""


class LocalRollouts:
    """``rollout.placement: colocated``: this rank samples each step itself, with the live
    policy (nothing to publish)."""

    placement = "colocated"

    def __init__(self, sampler: StepSampler):
        self.sampler = sampler

    def start(self, step: int, state: dict | None) -> None:
        pool = self.sampler.partial
        if pool is not None and state and state.get("partial"):
            engine = state.get("engine")
            if engine is not None:
                self.sampler.generator.restore_held(engine)
            pool.load_state_dict(state["partial"], engine_restored=engine is not None)

    def next(self, step: int, watch: Stopwatch) -> tuple[StepSamples, dict[str, float]]:
        return self.sampler.sample(step, watch), {}

    def state(self, step: int, stop: bool = False) -> dict:
        pool = self.sampler.partial
        if pool is None:
            return {"placement": self.placement, "partial": None}
        engine = self.sampler.generator.held_state() if stop and pool.keep_kv else None
        return {"placement": self.placement, "engine": engine,
                "partial": pool.checkpoint_state(engine_saved=engine is not None)}

    def publish(self, policy: Policy, version: int, stop: bool) -> float | None:
        return None

    def close(self) -> None:
        pass


def placement_of(state: dict | None) -> str:
    """The placement a checkpoint's rollout state was written by (checkpoints before it was
    recorded: the trainer's end of a separate placement kept ``received``)."""
    if not state:
        return "colocated"
    return state.get("placement") or ("separate" if "received" in state else "colocated")


def check_resumable(state: dict | None, placement: str, partial_rollouts: bool) -> None:
    """Refuse, in one line, a resume that cannot honour what the checkpoint has in flight:
    samples the rollout ranks already produced (``rollout.placement: separate`` with
    ``max_staleness`` > 0) resumed colocated (their prompts would be drawn again, the samples
    lost), or groups of partial rollouts in flight resumed without partial rollouts. Partial
    groups move between placements (the pool is the same), and a checkpoint with nothing in
    flight resumes under any placement."""
    was = placement_of(state)
    received = (state or {}).get("received") or {}
    if received and placement != "separate":
        raise ValueError(
            f"rollout.placement: the checkpoint was written by a separate placement with the "
            f"samples of {len(received)} step(s) already rolled out (steps {min(received)}.."
            f"{max(received)}), which a {placement} run cannot train on; resume with "
            f"--rollout.placement=separate (and the same rollout.max_staleness)")
    groups = ((state or {}).get("partial") or {}).get("groups")
    if groups and not partial_rollouts:
        raise ValueError(
            f"rollout.partial_rollouts: the checkpoint ({was} placement) holds {len(groups)} "
            f"group(s) of partial rollouts in flight, which a run without partial rollouts "
            f"would drop; resume with --rollout.partial_rollouts=true")
