"""The bridge of ``rollout.placement: separate`` (:mod:`gspo_megatron.rollouts.remote`) on 3 gloo
processes, with no model: two trainer ranks (a TP=2 layout: each holds its half of two tensors
and one of them the main replica of a third) and one rollout rank holding the tensors whole.

* the protocol: the rollout of step ``t`` samples with weights version ``max(0, t - k)`` and the
  trainer takes every step in order, for ``k`` = 0, 1 and 3; each trainer rank sends its own
  pieces in buckets of 40 bytes (tensors larger than that split), the rollout rank loads them
  into its whole tensors; host memory stays within ``k + 1`` snapshots of a trainer rank's shard
  and one bucket on the rollout rank;
* a side that dies never leaves the other waiting: a rollout rank killed before it samples step 2
  makes the trainer's ``next`` raise :class:`~gspo_megatron.rollouts.remote.PeerLost` naming the
  rank and what was awaited, within seconds, and a trainer that dies makes the rollout rank raise
  it (the launcher's job: on another node no agent would kill the survivor).
"""

from __future__ import annotations

import os
import time
import types

import pytest
import torch

from gspo_megatron.faults import FaultInjector
from gspo_megatron.metrics import Stopwatch
from tests.helpers import warm
from tests.helpers.dist import free_port

pytestmark = pytest.mark.distributed

STEPS = 6
WORLD = 3  # trainer ranks 0 and 1, rollout rank 2


class _Sampler:
    """A prompt sampler's state: how many batches were drawn."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


BUCKET = 40


def _pieces(rank: int, version: int):
    """Trainer rank ``rank``'s main-replica pieces, every value ``version``: its row of a bf16
    ``b`` [2, 3], its half of a float64 ``c`` [4, 6] along axis 1 (96 bytes: split), and on rank
    0 a float32 ``a`` [5] (replicated; rank 0 holds the main replica)."""
    from gspo_megatron.weight_pieces import WeightPiece

    out = [WeightPiece("b", (2, 3), (rank, 0), torch.full((1, 3), version, dtype=torch.bfloat16)),
           WeightPiece("c", (4, 6), (0, 3 * rank),
                       torch.full((4, 3), version, dtype=torch.float64))]
    if rank == 0:
        out.append(WeightPiece("a", (5,), (0,), torch.full((5,), float(version))))
    return out


def _replica():
    """The rollout rank's whole tensors."""
    from gspo_megatron.weight_pieces import WeightPiece

    return [WeightPiece("a", (5,), (0,), torch.zeros(5)),
            WeightPiece("b", (2, 3), (0, 0), torch.zeros(2, 3, dtype=torch.bfloat16)),
            WeightPiece("c", (4, 6), (0, 0), torch.zeros(4, 6, dtype=torch.float64))]


def _version(pieces) -> int:
    """The version every value of ``pieces`` holds (-1 if they disagree)."""
    values = {int(v) for p in pieces for v in p.tensor.flatten().tolist()}
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


class _Policy:
    """A trainer rank's policy holding the weights of one version."""

    def __init__(self, rank: int, version: int):
        self.rank, self.version = rank, version

    def weight_pieces(self):
        return _pieces(self.rank, self.version)


def _side(rank: int, port: int, k: int, die: str, queue) -> None:
    from gspo_megatron.rollouts.remote import (PeerLost, Placement, RemoteRollouts, RolloutServer,
                                               start_sides)
    from gspo_megatron.weight_pieces import PieceLoader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    placement = Placement(rank, WORLD, rollout_ranks=1)
    bridge = start_sides(placement, timeout_minutes=1)
    try:
        if placement.is_rollout:
            loaded, replica, loader = [], _replica(), PieceLoader()

            def load(pieces):  # each bucket's views read before the next bucket is received
                loader.load(replica, pieces)
                loaded.append(_version(replica))

            done = RolloutServer(bridge, _StepSampler(die, loaded), load, k, STEPS).serve()
            queue.put((rank, "ok", (done, bridge.weights.host_bytes)))
            return
        groups = types.SimpleNamespace(dp_rank=0, world_size=WORLD - 1)  # TP=2: one DP rank
        prompts = _Sampler()
        rollouts = RemoteRollouts(bridge, placement, groups, prompts, max_staleness=k,
                                  steps=STEPS, weight_bucket_bytes=BUCKET)
        rollouts.start(0, None)
        rollouts.publish(_Policy(rank, 0), 0, stop=False)
        seen, held = [], 0
        for step in range(STEPS):
            if die == "trainer" and step == 2 and rank == 0:
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
            held = max(held, bridge.weights.host_bytes)
            rollouts.publish(_Policy(rank, step + 1), step + 1, stop=step + 1 == STEPS)
        rollouts.close()
        layout = bridge.weights.layout
        boxes = sum(len(bucket) for bucket in layout.buckets)
        queue.put((rank, "ok", (seen, held, layout.total, layout.sizes, boxes)))
    except PeerLost as exc:
        queue.put((rank, "lost", (str(exc), 0.0)))


def _run(k: int, die: str = "") -> dict[int, tuple[str, object]]:
    ctx = warm.gloo_context()  # (not fork: tests.helpers.warm.gloo_context says why)
    queue, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=_side, args=(r, port, k, die, queue)) for r in range(WORLD)]
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
    assert out[2] == ("ok", (STEPS, BUCKET))  # the rollout rank held one bucket of host memory
    for rank, shard in ((0, 3 * 2 + 12 * 8 + 5 * 4), (1, 3 * 2 + 12 * 8)):
        status, (seen, held, total, sizes, boxes) = out[rank]
        assert status == "ok"
        # (step, version the rollout rank reports, version it loaded, sampler draws after it)
        assert seen == [(t, max(0, t - k), max(0, t - k), t + 1) for t in range(STEPS)]
        # buckets of at most 40 bytes, c split; the shard (plus alignment) in <= k + 1 snapshots
        assert max(sizes) <= BUCKET and boxes > 3 - rank and shard <= total < shard + 16 * boxes
        assert total <= held <= (k + 1) * total


def test_a_rollout_rank_that_dies_stops_the_trainer_with_one_clear_error():
    out = _run(1, die="rollout")
    for rank in (0, 1):
        status, (message, waited) = out[rank]
        assert status == "lost"
        # step 1's samples may die with the process before they are sent (the sends are async)
        assert message.startswith(("job rank 2 is gone (waiting for the samples of step 1 from "
                                   "rollout rank 0): ", "job rank 2 is gone (waiting for the "
                                   "samples of step 2 from rollout rank 0): ")), message
        assert "\n" not in message and "This is typically" not in message and waited < 30
    assert 2 not in out  # the rollout rank died without a word


def test_a_trainer_that_dies_stops_the_rollout_rank():
    out = _run(1, die="trainer")
    status, (message, _) = out[2]
    assert status == "lost"
    # the sends are async: the versions trainer rank 0 sent before it died may die with it
    assert message.startswith("job rank 0 is gone (waiting for weights version"), message
