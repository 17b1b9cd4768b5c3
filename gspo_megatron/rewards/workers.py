"""A persistent pool of reward worker processes whose per-call timeout actually stops the call.

Why processes: a reward such as math-verify is CPU-bound Python; threads share the GIL (no
speed-up) and a thread cannot be stopped, so a hung call ran on forever and was only counted.
A worker process runs one call at a time; a call past its deadline is stopped by killing its
worker (SIGKILL), which is replaced at once, and scores 0 as a timeout. Workers are started once
per run (``spawn``: nothing of the trainer's torch/Megatron state is inherited) and serve every
RL step; each resolves the reward by its config name (``reward.fn`` and the recipe's directory),
so a user's reward module is imported in the worker exactly as ``gspo-train`` imports it.

Cost: one pipe round trip per call (~0.1 ms), which is why cheap rewards (registered with
``cheap=True``: exact-match string checks) never come here and run inline.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections import deque
from typing import Any, Callable, Iterator, Sequence

from gspo_megatron.rewards.base import Outcome, is_cheap, to_float, warmup_call

logger = logging.getLogger(__name__)

__all__ = ["Outcome", "ProcessWorker", "RewardWorkers", "WorkerPool", "die_with_parent", "serve",
           "start_reward_workers"]


_STARTUP_TIMEOUT_S = 120.0  # a worker must import and resolve the reward within this


def die_with_parent(parent_pid: int) -> None:  # pragma: no cover - child
    """The trainer owns its workers: Ctrl-C reaches the whole process group but only the trainer
    acts on it, and a worker whose trainer dies (even SIGKILLed, mid-call) is killed by the
    kernel (Linux ``PR_SET_PDEATHSIG``; elsewhere it exits when its pipe closes, after the
    call)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(0)


def serve(conn, parent_pid: int, resolve: Callable[[], Any]) -> Iterator[tuple]:
    """A worker's life (the child side of :class:`WorkerPool`): tied to its parent, it resolves
    what it serves (``resolve()``; its exception is sent as ``("fail", why)``), says
    ``("ready", None)``, then yields each message until told to stop or the pipe closes. The
    resolved object is the generator's first item."""
    die_with_parent(parent_pid)
    try:
        obj = resolve()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("fail", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    yield obj
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        yield msg


def _resolve_reward(spec: str, search_dirs: Sequence[str]):
    from gspo_megatron.rewards.registry import get_reward_fn

    fn = get_reward_fn(spec, search_dirs)
    warm = warmup_call(fn)
    if warm is not None:  # math-verify: seconds of imports and parser set-up on the first
        fn(*warm)         # call, which must not count against that call's timeout
    return fn


def _worker_main(conn, spec: str, search_dirs: Sequence[str],
                 parent_pid: int) -> None:  # pragma: no cover - child
    """Resolve the reward, say ready (or why not), then answer calls until told to stop."""
    messages = serve(conn, parent_pid, lambda: _resolve_reward(spec, search_dirs))
    fn = next(messages, None)
    for _, index, args in messages:
        try:
            value = fn(*args)
            out = to_float(value)
            conn.send(("done", index, out, None if out is not None else f"{value!r:.80}", None))
        except BaseException as e:  # noqa: BLE001 - any failure of the user's code scores 0
            conn.send(("done", index, None, None, f"{type(e).__name__}: {e}"))


class ProcessWorker:
    """One spawned worker process running ``target(conn, *args, parent_pid)`` and the pipe to it;
    ``call``: ``(index, deadline)`` of the call it runs, None when idle."""

    def __init__(self, ctx, target, args: tuple, name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args, os.getpid()),
                                   daemon=True, name=name)
        self.process.start()
        child.close()
        self.ready = False
        self.call: tuple[int, float] | None = None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class WorkerPool:
    """Worker processes that resolve ``spec`` at start-up and say ready (or why not): what the
    reward and environment pools share. A subclass sets ``what`` and ``_target`` (the child's
    main: resolve, send ``("ready", None)`` or ``("fail", why)``, answer calls)."""

    what = "worker"
    _target = None

    def __init__(self, spec: str, num_workers: int, timeout_s: float,
                 search_dirs: Sequence[str] = ()) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec, self.timeout_s, self.search_dirs = spec, float(timeout_s), list(search_dirs)
        self._ctx = multiprocessing.get_context("spawn")
        self._workers = [self._spawn() for _ in range(num_workers)]

    def _spawn(self) -> ProcessWorker:
        return ProcessWorker(self._ctx, type(self)._target, (self.spec, self.search_dirs),
                             f"gspo-{self.what.replace(' ', '-')}")

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _await_ready(self, worker: ProcessWorker) -> None:
        if worker.ready:
            return
        if not worker.conn.poll(_STARTUP_TIMEOUT_S):
            raise RuntimeError(f"{self.what} for {self.spec!r} did not start within "
                               f"{_STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, detail = worker.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.what} for {self.spec!r} exited at start-up") from None
        if kind != "ready":
            raise RuntimeError(f"{self.what} cannot load {self.spec!r}: {detail}")
        worker.ready = True

    def start(self):
        """Wait until every worker has resolved ``spec`` (raises if one cannot)."""
        try:
            for w in self._workers:
                self._await_ready(w)
        except RuntimeError:
            self.close()
            raise
        return self

    def _wait(self) -> tuple[list, float]:
        """Wait until a busy worker answers or the earliest deadline passes; returns the
        connections that can be read and the time."""
        busy = [w for w in self._workers if w.call]
        wait_s = max(0.0, min(w.call[1] for w in busy) - time.monotonic())
        ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=wait_s)
        return ready, time.monotonic()

    def _busy(self):
        """``(i, worker, call index, deadline)`` of each worker running a call (a snapshot:
        the loop may replace workers)."""
        for i, w in enumerate(list(self._workers)):
            if w.call is not None:
                yield (i, w, *w.call)

    def close(self) -> None:
        for w in self._workers:
            if w.process.is_alive() and w.call is None:
                try:
                    w.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
        for w in self._workers:
            w.process.join(2)
            w.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class RewardWorkers(WorkerPool):
    """``num_workers`` processes scoring ``spec`` (a ``reward.fn`` value) with a per-call timeout.

    ``run(calls)`` returns one :data:`Outcome` per ``(response, answer, example)`` call, in order.
    Raises ``RuntimeError`` at start-up if the workers cannot resolve the reward (the caller then
    scores in-process). ``close()`` stops the workers; a daemon worker also dies with the trainer.
    """

    what = "reward worker"
    _target = staticmethod(_worker_main)

    def __init__(self, spec: str, num_workers: int, timeout_s: float,
                 search_dirs: Sequence[str] = ()) -> None:
        super().__init__(spec, num_workers, timeout_s, search_dirs)
        self.killed = 0
        """Workers killed at a timeout (and replaced) over the pool's life."""

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._spawn()

    def run(self, calls: Sequence[tuple[Any, ...]]) -> list[Outcome]:
        """Score every call; each gets ``timeout_s`` from the moment a worker takes it."""
        self.start()
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.call for w in self._workers):
            for i, w in enumerate(self._workers):
                if w.call is None and pending:
                    if not w.process.is_alive():  # died while idle (OOM killer, a signal)
                        self._replace(i)
                        w = self._workers[i]
                    self._await_ready(w)  # a replacement may still be starting
                    index = pending.popleft()
                    try:
                        w.conn.send(("call", index, tuple(calls[index])))
                    except OSError:  # it died just now: the call goes to its replacement
                        pending.appendleft(index)
                        self._replace(i)
                        continue
                    w.call = (index, time.monotonic() + self.timeout_s)
            ready, now = self._wait()
            for i, w, index, deadline in self._busy():
                if w.conn in ready:
                    try:
                        _, got, value, invalid, error = w.conn.recv()
                    except EOFError:  # the worker died inside the call (os._exit, a crash)
                        outcomes[index] = (None, "worker process died during the call", False)
                        self._replace(i)
                        continue
                    assert got == index
                    outcomes[index] = (value if invalid is None else _Invalid(invalid), error, False)
                    w.call = None
                elif now >= deadline:
                    outcomes[index] = (None, None, True)
                    self.killed += 1
                    logger.warning("reward call %d exceeded reward.timeout_s=%g s: its worker was "
                                   "stopped and replaced", index, self.timeout_s)
                    self._replace(i)
        return outcomes  # type: ignore[return-value]


class _Invalid:
    """A non-numeric return value, carried as its repr (it may not be picklable)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def start_reward_workers(spec: str, fn, num_workers: int, timeout_s: float,
                         search_dirs: Sequence[str] = ()) -> RewardWorkers | None:
    """The run's reward pool, or None where rewards run in-process: ``num_workers`` 0, a cheap
    reward (inline), or workers that cannot load the reward (one warning; threads then)."""

    if num_workers < 1 or is_cheap(fn):
        return None
    try:
        return RewardWorkers(spec, num_workers, timeout_s, search_dirs).start()
    except RuntimeError as e:
        logger.warning("%s; scoring rewards in threads of the trainer instead", e)
        return None
