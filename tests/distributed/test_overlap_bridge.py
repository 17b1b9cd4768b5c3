"""The bridge of ``rollout.placement: separate`` (:mod:`gspo_megatron.rollouts.remote`) on 2 gloo
processes, with no model: one trainer rank, one rollout rank.

* the protocol: the rollout of step ``t`` samples with weights version ``max(0, t - k)`` (the
  weight channel's broadcast of two dtypes' buffers, read whole) and the trainer takes every step
  in order, for ``k`` = 0, 1 and 3;
* a side that dies never leaves the other waiting: a rollout rank killed before it samples step 2
  makes the trainer's ``next`` raise :class:`~gspo_megatron.rollouts.remote.PeerLost` naming the rank and
  what was awaited, within seconds, and a trainer that dies makes the rollout rank raise it
  (the launcher's job: on another node no agent would kill the survivor).
"""

from __future__ import annotations

import os
import time
import types

import pytest
import torch
import torch.multiprocessing as mp

from gspo_megatron.faults import FaultInjector
from gspo_megatron.metrics import Stopwatch
from tests.helpers.dist import free_port

pytestmark = pytest.mark.distributed

STEPS = 6


class _Sampler:
    """A prompt sampler's state: how many batches were drawn."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _weights(version: int):
    """Weights of two dtypes whose every value is ``version``."""
    from gspo_megatron.policy import FlatWeights

    return FlatWeights.of({"b": torch.full((2, 3), version, dtype=torch.bfloat16),
                           "a": torch.full((5,), version, dtype=torch.float32),
                           "c": torch.full((4, 1), version, dtype=torch.float32)})


def _version(weights) -> int:
    """The version every tensor of ``weights`` holds (-1 if they disagree)."""
    values = {int(v) for t in weights.tensors().values() for v in t.flatten().tolist()}
    return values.pop() if len(values) == 1 else -1


class _Samples:
    """What a step's samples carry through the bridge here: the step and the weights version
    the rollout rank had loaded (and the ``metrics`` the trainer's end adds to)."""

    def __init__(self, step: int, weights: int):
        self.step, self.weights, self.metrics = step, weights, {}


class _StepSampler:
    """The rollout rank's :class:`~gspo_megatron.rollouts.sampling.StepSampler` as the server
    uses it: ``sample`` draws one prompt batch and reports the last weights loaded."""

    def __init__(self, die: str, loaded: list):
        self.task = types.SimpleNamespace(sampler=_Sampler(), reward_workers=None)
        self.faults, self.partial, self.die, self.loaded = FaultInjector(), None, die, loaded

    def sample(self, step, watch):
        if self.die == "rollout" and step == 2:
            os._exit(3)  # the process is gone: no message, no clean-up
        self.task.sampler.n += 1
        return _Samples(step, self.loaded[-1])


class _Exporter:
    """A trainer policy whose export is the weights of one version."""

    def __init__(self, version: int):
        self.version = version

    def export_weights(self):
        return _weights(self.version)


def _side(rank: int, port: int, k: int, die: str, queue) -> None:
    from gspo_megatron.rollouts.remote import (PeerLost, Placement, RemoteRollouts, RolloutServer,
                                               start_sides)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", OMP_NUM_THREADS="1")
    placement = Placement(rank, 2, rollout_ranks=1)
    bridge = start_sides(placement, timeout_minutes=1)
    try:
        if placement.is_rollout:
            loaded = []

            def load(weights):  # the channel reuses its buffers: read them now
                assert [key for key, _, _ in weights.layout] == ["a", "b", "c"]
                loaded.append(_version(weights))

            done = RolloutServer(bridge, _StepSampler(die, loaded), load, k, STEPS).serve()
            queue.put((rank, "ok", done))
            return
        groups = types.SimpleNamespace(dp_rank=0, world_size=1)
        prompts = _Sampler()
        rollouts = RemoteRollouts(bridge, placement, groups, prompts, max_staleness=k,
                                  steps=STEPS)
        rollouts.start(0, None)
        rollouts.publish(_Exporter(0), 0, stop=False)
        seen = []
        for step in range(STEPS):
            if die == "trainer" and step == 2:
                os._exit(3)
            t0 = time.monotonic()
            try:
                samples, _ = rollouts.next(step, Stopwatch())
            except PeerLost as exc:
                queue.put((rank, "lost", (str(exc), time.monotonic() - t0)))
                rollouts.close()
                return
            seen.append((samples.step, step - int(samples.metrics["sampling/staleness"]),
                         samples.weights, prompts.n))
            rollouts.publish(_Exporter(step + 1), step + 1, stop=step + 1 == STEPS)
        rollouts.close()
        queue.put((rank, "ok", seen))
    except PeerLost as exc:
        queue.put((rank, "lost", (str(exc), 0.0)))


def _run(k: int, die: str = "") -> dict[int, tuple[str, object]]:
    # spawn, not fork: a forked child inherits the parent's default process group when an
    # earlier test of this pytest process initialised one ("initialize the default process
    # group twice")
    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=_side, args=(r, port, k, die, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks still running (a hang): {alive}"
    out = {}
    while not queue.empty():
        rank, status, value = queue.get()
        out[rank] = (status, value)
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_rollout_t_samples_with_version_t_minus_k(k):
    out = _run(k)
    assert out[1] == ("ok", STEPS)
    status, seen = out[0]
    assert status == "ok"
    # (step, version the rollout rank reports, version it loaded, sampler draws after the step)
    assert seen == [(t, max(0, t - k), max(0, t - k), t + 1) for t in range(STEPS)]


def test_a_rollout_rank_that_dies_stops_the_trainer_with_one_clear_error():
    out = _run(1, die="rollout")
    status, (message, waited) = out[0]
    assert status == "lost"
    # step 1's samples may die with the process before they are sent (the sends are async)
    assert message.startswith(("job rank 1 is gone (waiting for the samples of step 1 from "
                               "rollout rank 0): ", "job rank 1 is gone (waiting for the samples "
                               "of step 2 from rollout rank 0): ")), message
    assert "\n" not in message and "This is typically" not in message and waited < 30
    assert 1 not in out  # the rollout rank died without a word


def test_a_trainer_that_dies_stops_the_rollout_rank():
    out = _run(1, die="trainer")
    status, (message, _) = out[1]
    assert status == "lost"
    # the trainer may die before or after it sent a version's layout, not its tensors
    assert message.startswith("job rank 0 is gone (waiting for weights version"), message
