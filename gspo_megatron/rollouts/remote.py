"""Rollouts on their own ranks, ``rollout.max_staleness`` steps ahead of training
(``rollout.placement: separate``).

One job of ``W`` ranks: the first ``W - R`` train, the last ``R = rollout.ranks`` only roll out.
Each side has its own ``torch.distributed`` world (Megatron's parallel state sees only its side:
the trainer's TP/EP/PP/CP/DP layout, the rollout ranks' full replicas), and a gloo *bridge* over
all ``W`` ranks carries what crosses (:class:`Bridge`)::

    trainer ranks (W - R)                          rollout ranks (R, one per trainer DP rank)
    ---------------------                          ------------------------------------------
    start(step, in-flight)  --- start message -->  sampler state, first step
    publish(version 0)      --- weights v0 ----->  rollout(t) with weights v = max(0, t - k)
                            (every trainer rank its own shard, in buckets: weight_channel)
    take(t) <------------- samples of step t ----  (prompts, rollout, reward, advantages)
    old log-probs, updates of step t
    publish(version t + 1)  --- weights ------->   ... rollout(t + k + 1)
    ...                     --- stop ---------->   exits

The lag is fixed, so a run does not depend on timing: rollout ``t`` waits for exactly version
``t - k`` (it receives no newer one before it samples). ``k = 0`` alternates as the colocated loop
does and samples the same tokens. The trainer recomputes the old log-probs at its step (decoupled
PPO: the clip is relative to the policy being updated); ``kl/rollout_vs_train`` then measures the
staleness and ``rollout_correction`` corrects for it.

Resume is exact: a checkpoint at step ``S`` holds, per trainer rank, the samples already rolled
out for steps ``S .. S + k - 1`` (received before the save) and the prompt sampler's state after
them; the resumed trainer hands that state to the rollout ranks, which go on at step ``S + k`` with
version ``S``.

The weights go shard by shard, in buckets, from every trainer rank's host memory over gloo:
nothing of a transfer is ever posted on a trainer GPU, so a rollout rank that takes version ``v``
only before rollout ``v + k`` cannot stall the trainer's collectives
(:mod:`gspo_megatron.rollouts.weight_channel` has the rule and its costs).

Nothing here imports Megatron: the trainer's :class:`~gspo_megatron.policy.Policy` names its
pieces of the weights and loads those sent.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.gc_watch import GcWatch
from gspo_megatron.metrics import Stopwatch
from gspo_megatron.rollouts.sampling import StepSampler
from gspo_megatron.rollouts.weight_channel import PeerLost, WeightChannel, first_sentence
from gspo_megatron.stages import SkipStep, StepSamples

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Which side this rank is on (``rollout.placement: separate``)."""

    rank: int
    """This rank in the job (``RANK``)."""
    world_size: int
    """Ranks in the job (``WORLD_SIZE``)."""
    rollout_ranks: int
    """The last ``rollout_ranks`` ranks roll out."""

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainer_ranks

    @property
    def side_rank(self) -> int:
        """This rank within its side's world."""
        return self.rank - self.trainer_ranks if self.is_rollout else self.rank

    @property
    def side_size(self) -> int:
        return self.rollout_ranks if self.is_rollout else self.trainer_ranks

    def rollout_rank(self, j: int) -> int:
        """The job rank of rollout rank ``j``."""
        return self.trainer_ranks + j


def start_sides(placement: Placement, timeout_minutes: int = 30) -> "Bridge":
    """Rendezvous through the launcher's store (``env://``), start this side's own default
    process group (gloo on CPU, NCCL on CUDA) and the gloo bridge over the job (which also
    carries the weights); afterwards ``RANK`` / ``WORLD_SIZE`` name this rank within its side,
    so everything built next (Megatron's parallel state, the logging rank) sees only its
    side."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    side = "rollout" if placement.is_rollout else "trainer"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # a node with fewer GPUs than ranks shares them (a trainer
        # and a rollout rank on one GPU: a small model on a workstation, tools/gpu_check)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, store=dist.PrefixStore(f"{side}/", store),
                            rank=placement.side_rank, world_size=placement.side_size,
                            timeout=timeout)
    # The rollout ranks wait on the bridge through the trainer's warm-up and checkpoints: a long
    # timeout (a rank that dies is stopped by the launcher, which kills every worker).
    long_wait = datetime.timedelta(hours=12)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge/", store), placement.rank,
                                   placement.world_size, long_wait)
    os.environ.update(RANK=str(placement.side_rank), WORLD_SIZE=str(placement.side_size))
    return Bridge(bridge)


class Bridge:
    """Python objects between two ranks of the job over a gloo process group: a pickled message
    is its length (int64) then its bytes. Sends do not wait for the receiver (each side may send
    while the other does: the rollout ranks' samples and the trainer's weights cross); their
    buffers are kept until done. ``weights``: this rank's end of the weight transfer, on the
    same group (:class:`~gspo_megatron.rollouts.weight_channel.WeightChannel`)."""

    def __init__(self, group):
        self.group = group
        self.weights = WeightChannel(group)
        self._sends: list = []

    def send(self, obj: Any, *dsts: int) -> None:
        """``obj`` to each of the job ranks ``dsts``, pickled once."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                   dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self._sends = [(w, bufs) for w, bufs in self._sends if not w.is_completed()]
        for dst in dsts:
            for buf in (size, payload):
                self._sends.append((self.group.send([buf], dst, 0), buf))

    def recv(self, src: int, waiting_for: str = "a message") -> Any:
        """The next object from job rank ``src``; :class:`PeerLost` if ``src`` is gone (gloo sees
        the closed connection at once: a dead peer never leaves this rank waiting)."""
        try:
            size = torch.zeros(1, dtype=torch.int64)
            self.group.recv([size], src, 0).wait()
            payload = torch.empty(int(size), dtype=torch.uint8)
            self.group.recv([payload], src, 0).wait()
        except RuntimeError as exc:
            raise PeerLost(f"job rank {src} is gone (waiting for {waiting_for}): "
                           f"{first_sentence(exc)}") from None
        return pickle.loads(payload.numpy().tobytes())

    def flush(self, quiet: bool = False) -> None:
        """Wait until every send is done (``quiet``: a send to a rank that is gone is dropped:
        the stop sent while failing must not raise over the error being reported)."""
        sends, self._sends = self._sends, []
        sends += self.weights.take_sends()
        for work, _ in sends:
            try:
                work.wait()
            except RuntimeError:
                if not quiet:
                    raise


# ----------------------------------------------------------------------------- trainer's end

class RemoteRollouts:
    """The trainer ranks' :class:`~gspo_megatron.rollouts.source.RolloutSource`: each step's
    samples from the rollout rank of this rank's data-parallel rank, the weights out after every
    optimizer step (each trainer rank its own shard, in buckets of at most ``weight_bucket_bytes``).
    ``prompt_sampler``: the trainer's prompt sampler, kept where the colocated loop's would be (it
    is checkpointed)."""

    placement = "separate"

    def __init__(self, bridge: Bridge, placement: Placement, groups, prompt_sampler,
                 max_staleness: int, steps: int, weight_bucket_bytes: int = 512 << 20):
        self.bridge, self.sides, self.groups = bridge, placement, groups
        self.bucket_bytes = weight_bucket_bytes
        self.prompt_sampler = prompt_sampler
        self.dp_rank = groups.dp_rank
        self.source = placement.rollout_rank(self.dp_rank)
        self.k, self.steps = max_staleness, steps
        self.received: dict[int, dict] = {}
        """Messages of the steps received and not yet trained on, by step."""
        self.sampler_state: Any = None
        """The prompt sampler's state after the last step received (for a checkpoint)."""
        self.partial_state: Any = None
        """``rollout.partial_rollouts``: the rollout rank's groups in flight after the last step
        received (for a checkpoint)."""
        self.next_step = 0
        """The next step the rollout ranks will send."""
        self.checkpointed_at: int | None = None
        """The step of the last checkpoint :meth:`state` was taken for: the weights of that
        version tell the rollout ranks (their next rollout prefills, as a resumed run's does)."""
        self.stopped = False

    def start(self, step: int, state: dict | None) -> None:
        """Tell the rollout ranks where the run is (collective over the trainer ranks): training
        resumes at ``step`` with the checkpoint's ``state`` (None: nothing in flight: the
        rollouts go on from ``step`` with the prompt sampler where this rank's is). The first
        trainer rank of each data-parallel rank sends its rollout rank the start, with the groups
        in flight (and the engine's held requests, after a stop) it saved."""
        dp_ranks = [None] * self.groups.world_size
        torch.distributed.all_gather_object(dp_ranks, self.dp_rank)
        state = state or {}
        self.received = dict(state.get("received") or {})
        self.sampler_state = state.get("sampler") or self.prompt_sampler.state_dict()
        self.partial_state = state.get("partial")
        self.next_step = step + len(self.received)
        # trainer ranks of each data-parallel rank j (rollout rank j sends its samples to them)
        targets = [[r for r, d in enumerate(dp_ranks) if d == j]
                   for j in range(self.sides.rollout_ranks)]
        if self.sides.rank == 0:
            for j in range(self.sides.rollout_ranks):
                self.bridge.send({"start": self.next_step, "sampler": self.sampler_state,
                                  "targets": targets[j], "trainers": self.sides.trainer_ranks},
                                 self.sides.rollout_rank(j))
        if targets[self.dp_rank][0] == self.sides.rank:
            self.bridge.send({"partial": self.partial_state, "engine": state.get("engine")},
                             self.source)

    def publish(self, policy, version: int, stop: bool) -> float:
        """After the optimizer step that made ``version``: trainer rank 0 tells the rollout
        ranks the version (and whether a checkpoint was taken at it), every trainer rank sends
        its own pieces of the weights (its bucket layout first, once per run); or a stop once
        training ends. Returns the seconds it took (this rank's device-to-host copy: the sends
        go on in gloo's threads)."""
        watch = Stopwatch()
        stop = stop or version >= self.steps
        self.stopped = self.stopped or stop
        receivers = list(map(self.sides.rollout_rank, range(self.sides.rollout_ranks)))
        if self.sides.rank == 0:
            self.bridge.send({"version": version, "stop": stop,
                              "checkpoint": self.checkpointed_at == version}, *receivers)
        if stop:
            self.bridge.flush()
            return watch.elapsed()
        pieces, channel = policy.weight_pieces(), self.bridge.weights
        if channel.layout is None:
            self.bridge.send({"pieces": channel.prepare(pieces, self.bucket_bytes)}, *receivers)
        channel.send(pieces, receivers, max_pending=self.k + 1)
        return watch.elapsed()

    def close(self) -> None:
        """Send the stop if it was not sent (a trainer that fails stops the rollout ranks; those
        already gone are skipped)."""
        if not self.stopped and self.sides.rank == 0:
            try:
                self.bridge.send({"version": -1, "stop": True}, *map(
                    self.sides.rollout_rank, range(self.sides.rollout_ranks)))
            except RuntimeError:
                pass
        self.stopped = True
        self.bridge.flush(quiet=True)

    def _receive(self, step: int) -> None:
        while self.next_step <= step:
            msg = self.bridge.recv(self.source, f"the samples of step {self.next_step} from "
                                                f"rollout rank {self.dp_rank}")
            if msg.get("error"):
                raise RuntimeError(f"rollout rank {self.dp_rank}: {msg['error']}")
            if msg["step"] != self.next_step:
                raise RuntimeError(f"rollout rank {self.dp_rank} sent step {msg['step']}, "
                                   f"expected {self.next_step}")
            self.received[msg["step"]] = msg
            self.sampler_state = msg["sampler"]
            self.partial_state = msg.get("partial")
            self.next_step += 1

    def next(self, step: int, watch: Stopwatch) -> tuple[StepSamples, dict[str, float]]:
        """Step ``step``'s samples from the rollout rank (its :class:`SkipStep` raised here) and
        its ``perf/*`` (the rollout rank's seconds), plus ``sampling/staleness`` (optimizer steps
        between the sampling weights and these) and ``perf/rollout_wait_s`` (this rank idle)."""
        self._receive(step)
        msg = self.received.pop(step)
        watch.lap("perf/rollout_wait_s")
        if "skip" in msg:
            raise SkipStep(*msg["skip"])
        sampled: StepSamples = msg["samples"]
        self.prompt_sampler.load_state_dict(msg["sampler"])  # where the colocated loop's would be
        sampled.metrics["sampling/staleness"] = float(step - msg["version"])
        return sampled, dict(msg["perf"])

    def state(self, step: int, stop: bool = False) -> dict:
        """What a checkpoint at ``step`` keeps of this end: the samples of the steps already
        being rolled out (``step .. step + k - 1``, received now), the sampler state and the
        rollout rank's groups in flight after them; at a ``stop``, the rollout rank's engine's
        held requests too (it is idle then: it waits for the weights of version ``step``)."""
        last = min(step + self.k, self.steps) - 1
        if last >= step:
            self._receive(last)
        self.checkpointed_at = step
        out = {"placement": self.placement,
               "received": {s: m for s, m in self.received.items() if s >= step},
               "sampler": self.sampler_state, "partial": self.partial_state, "engine": None}
        if stop:
            if self.sides.rank == 0:
                self.bridge.send({"snapshot": True}, *map(self.sides.rollout_rank,
                                                          range(self.sides.rollout_ranks)))
            reply = self.bridge.recv(self.source, f"rollout rank {self.dp_rank}'s held requests")
            if reply.get("error"):
                raise RuntimeError(f"rollout rank {self.dp_rank}: {reply['error']}")
            out.update(engine=reply["engine"], partial=reply["partial"])
        return out


# ----------------------------------------------------------------------------- rollout's end

class RolloutServer:
    """A rollout rank's whole run: wait for the start, then for every step ``t`` receive weights
    up to version ``max(0, t - k)``, sample step ``t`` (:class:`~gspo_megatron.rollouts.sampling.
    StepSampler`) and send it to the trainer ranks of this rollout rank's data-parallel rank;
    after the last step, drain until the stop. The pool of partial rollouts travels with every
    message (the trainer checkpoints it). ``load_weights``: the replica's
    :meth:`~gspo_megatron.policy.Policy.load_weight_pieces`."""

    TRAINER0 = 0

    def __init__(self, bridge: Bridge, sampler: StepSampler, load_weights: Callable[[Any], None],
                 max_staleness: int, steps: int, gc_freeze: bool = True):
        self.bridge, self.sampler, self.load_weights = bridge, sampler, load_weights
        self.k, self.steps = max_staleness, steps
        self.gc_freeze = gc_freeze
        """``trainer.gc_freeze``: set-up's objects (and the first rollout's) out of the garbage
        collector's scans while this rank serves (:mod:`gspo_megatron.gc_watch`)."""
        self.senders: list | None = None
        """``(job rank, bucket layout)`` of every trainer rank that sends pieces (received with
        the first weights)."""

    def serve(self) -> int:
        """Run until the trainer's stop; returns the number of steps rolled out. Stop signals
        are the trainer ranks' to act on (they checkpoint, then send the stop). An error is sent
        to the trainer ranks (which raise it) before it propagates."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: logger.info(
                "rollout rank: signal %d, the trainer ranks will stop the run", signum))
        bridge, sampler, pool = self.bridge, self.sampler, self.sampler.partial
        start = bridge.recv(self.TRAINER0, "the start from trainer rank 0")
        targets = start["targets"]
        if start["sampler"] is not None:
            sampler.task.sampler.load_state_dict(start["sampler"])
        # what its data-parallel rank's first trainer rank saved in flight
        state = bridge.recv(targets[0], f"the rollouts in flight from trainer rank {targets[0]}")
        if pool is not None and state["partial"]:
            if state["engine"] is not None:
                sampler.generator.restore_held(state["engine"])
            pool.load_state_dict(state["partial"], engine_restored=state["engine"] is not None)
        version, done = -1, 0
        gc_watch, freeze = GcWatch(), self.gc_freeze  # (as the trainer's fit)
        if freeze:
            gc_watch.freeze()
        try:
            for step in range(start["start"], self.steps):
                while version < max(0, step - self.k):
                    msg = bridge.recv(self.TRAINER0, f"weights version {max(0, step - self.k)} "
                                                     f"from trainer rank 0")
                    if msg.get("snapshot"):
                        self._send_held(targets)
                        continue
                    if msg["stop"]:
                        return done
                    self.load_weights(self._weights(start["trainers"], msg["version"]))
                    version = msg["version"]
                    if msg.get("checkpoint") and pool is not None:
                        pool.mark_checkpoint()  # as the run resumed from it: prefill
                bridge.send(self._sample(step, version), *targets)
                done += 1
                if freeze and done == 1:
                    gc_watch.freeze()  # and what the first rollout built (the engine's context)
            while not (msg := bridge.recv(self.TRAINER0, "the stop from trainer rank 0")).get(
                    "stop"):
                if msg.get("snapshot"):
                    self._send_held(targets)
                    continue
                # versions no rollout needs: the trainers' sends complete only once received
                for _ in self._weights(start["trainers"], msg["version"]):
                    pass
            return done
        except PeerLost:  # the trainer is gone: nobody to tell
            raise
        except Exception as exc:
            bridge.send({"error": f"{type(exc).__name__}: {exc}"}, *targets)
            raise
        finally:  # sends to a trainer rank that is gone are dropped: the error above is the news
            gc_watch.close()
            bridge.flush(quiet=True)

    def _weights(self, trainers: int, version: int):
        """Version ``version``'s ``(box, data)`` from every trainer rank that sends any, bucket
        by bucket (:meth:`WeightChannel.receive`); the first time, each of the ``trainers``
        trainer ranks' bucket layout first."""
        if self.senders is None:
            layouts = [(r, self.bridge.recv(r, f"trainer rank {r}'s weight layout")["pieces"])
                       for r in range(trainers)]
            self.senders = [(r, layout) for r, layout in layouts if layout.sizes]
        return self.bridge.weights.receive(self.senders, version)

    def _send_held(self, targets: list[int]) -> None:
        """A stop's checkpoint: the engine's held requests and the pool, to the trainer ranks."""
        pool = self.sampler.partial
        engine = (self.sampler.generator.held_state() if pool is not None and pool.keep_kv
                  else None)
        self.bridge.send({"engine": engine,
                          "partial": None if pool is None else pool.state_dict()}, *targets)

    def close(self) -> None:
        """Stop the reward workers (the only thing a rollout rank starts outside itself)."""
        workers = self.sampler.task.reward_workers
        if workers is not None:
            workers.close()

    def _sample(self, step: int, version: int) -> dict:
        """Step ``step``'s message: the samples (or the skip), ``perf/*``, the weights version
        they were sampled with, the prompt sampler's state and the pool's after them."""
        sampler = self.sampler
        sampler.faults.step = step
        sampler.faults.maybe_fail("rollout_sample")
        watch = Stopwatch()
        try:
            body: dict = {"samples": sampler.sample(step, watch)}
        except SkipStep as skip:
            body = {"skip": (skip.fault, skip.metrics)}
        body["perf"] = {k: v for k, v in watch.laps.items() if k.startswith("perf/")}
        body.update(step=step, version=version, sampler=sampler.task.sampler.state_dict())
        if sampler.partial is not None:
            body["partial"] = sampler.partial.state_dict()
        return body
