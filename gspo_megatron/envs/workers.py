"""Where environments run: worker processes with a per-call timeout (as the reward workers), or
in the trainer's process.

An episode's environment is an object with state, so every call of one episode goes to the same
worker (episode ``key`` -> worker ``key % num_workers``), which keeps the instance between calls.
A call past ``timeout_s`` is stopped by killing its worker (SIGKILL; a new one takes its place):
the episodes that worker held are *lost* and end with reward 0 (their next call answers
"environment lost"), the others go on. Workers are started once per run (``spawn``) and resolve
the class from its config name, as ``gspo-train`` does (the recipe's directory searched too).

:class:`InProcessEnvs` is the same interface in the caller's process (``multi_turn.num_workers:
0``; tests): no timeout, exceptions still caught.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from typing import Any, Sequence

from gspo_megatron.rewards.workers import ProcessWorker, WorkerPool, serve

logger = logging.getLogger(__name__)

__all__ = ["EnvWorkers", "InProcessEnvs", "resolve_env_class"]

BUILTIN_ENVS = {
    "tool_arithmetic": "gspo_megatron.envs.arithmetic:ToolArithmeticEnv",
}
"""``multi_turn.env`` names of the built-in environments -> their ``module:Class``."""

Call = tuple[str, int, Any]
"""``(method, episode key, argument)``: ``("reset", key, example)``, ``("step", key, text)``."""


def resolve_env_class(spec: str, search_dirs: Sequence[str] = ()) -> type:
    """The environment class ``spec`` names (a built-in name or ``module:Class``). Raises
    ``ValueError`` (one line naming ``multi_turn.env``) when it cannot be imported or lacks
    ``reset`` / ``step``."""
    from gspo_megatron.rewards.registry import import_dotted

    path = BUILTIN_ENVS.get(spec, spec)
    if ":" not in path and "." not in path:
        raise ValueError(f"multi_turn.env '{spec}' is neither a built-in environment "
                         f"({', '.join(sorted(BUILTIN_ENVS))}) nor 'package.module:Class'")
    cls = import_dotted(path, search_dirs, what="multi_turn.env")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"multi_turn.env '{spec}' must be a class with reset() and step() "
                         f"(missing: {', '.join(missing) or 'not a class'})")
    return cls


def _call(envs: dict, cls: type, method: str, key: int, arg: Any) -> Any:
    """One environment call (an ``async def`` method run to completion)."""
    if method == "reset":
        envs[key] = cls()
        out = envs[key].reset(arg)
    elif method == "step":
        if key not in envs:
            raise RuntimeError("environment lost (its worker was stopped at another episode's "
                               "timeout)")
        out = envs[key].step(arg)
    else:
        raise ValueError(f"unknown environment method {method!r}")
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


async def _await(awaitable):
    return await awaitable


def _worker_main(conn, spec: str, search_dirs: Sequence[str],
                 parent_pid: int) -> None:  # pragma: no cover - child
    messages = serve(conn, parent_pid, lambda: resolve_env_class(spec, search_dirs))
    cls = next(messages, None)
    envs: dict[int, Any] = {}
    for msg in messages:
        if msg[0] == "drop":
            for key in msg[1]:
                envs.pop(key, None)
            continue
        _, index, (method, key, arg) = msg
        try:
            value = _call(envs, cls, method, key, arg)
            try:
                conn.send(("done", index, value, None))
            except Exception as e:  # noqa: BLE001 - an answer that cannot be pickled
                conn.send(("done", index, None, f"answer cannot be sent: {type(e).__name__}: {e}"))
        except BaseException as e:  # noqa: BLE001 - any failure of the user's code
            envs.pop(key, None)
            conn.send(("done", index, None, f"{type(e).__name__}: {e}"))


class InProcessEnvs:
    """Environments in the caller's process, one instance per episode key; no timeout."""

    timeout_s = None

    def __init__(self, spec: str | type, search_dirs: Sequence[str] = ()) -> None:
        self.cls = spec if isinstance(spec, type) else resolve_env_class(spec, search_dirs)
        self._envs: dict[int, Any] = {}
        self.lost = 0

    def run(self, calls: Sequence[Call]) -> list[tuple[Any, str | None, bool]]:
        """One ``(value, error, timed_out)`` per call, in order."""
        out = []
        for method, key, arg in calls:
            try:
                out.append((_call(self._envs, self.cls, method, key, arg), None, False))
            except Exception as e:  # noqa: BLE001 - never crash the rollout
                self._envs.pop(key, None)
                out.append((None, f"{type(e).__name__}: {e}", False))
        return out

    def drop(self, keys: Sequence[int]) -> None:
        """Forget the episodes ``keys`` (ended)."""
        for key in keys:
            self._envs.pop(key, None)

    def close(self) -> None:
        self._envs.clear()


class EnvWorkers(WorkerPool):
    """``num_workers`` processes running the environment ``spec`` with a per-call timeout (the
    module docstring). Raises ``RuntimeError`` at start when a worker cannot resolve the class."""

    what = "environment worker"
    _target = staticmethod(_worker_main)

    def __init__(self, spec: str, num_workers: int, timeout_s: float,
                 search_dirs: Sequence[str] = ()) -> None:
        super().__init__(spec, num_workers, timeout_s, search_dirs)
        self.lost = 0
        """Episodes lost with a worker stopped at a timeout, over the pool's life."""

    def _spawn(self) -> ProcessWorker:
        w = super()._spawn()
        w.keys = set()  # episodes whose environment this worker holds
        w.queue = deque()  # indices of the calls waiting for it
        return w

    def _replace(self, i: int) -> None:
        old = self._workers[i]
        self.lost += len(old.keys)
        old.kill()
        self._workers[i] = self._spawn()

    def _send(self, i: int, calls: Sequence[Call]) -> None:
        w = self._workers[i]
        index = w.queue.popleft()
        self._await_ready(w)
        w.conn.send(("call", index, tuple(calls[index])))
        w.call = (index, time.monotonic() + self.timeout_s)

    def run(self, calls: Sequence[Call]) -> list[tuple[Any, str | None, bool]]:
        """One ``(value, error, timed_out)`` per call, in order; each call gets ``timeout_s``
        from the moment its worker takes it. Calls of one worker run one after another."""
        self.start()
        n = len(self._workers)
        outcomes: list[Any] = [None] * len(calls)
        for index, (_, key, _) in enumerate(calls):
            self._workers[key % n].queue.append(index)
        while any(w.queue or w.call for w in self._workers):
            for i, w in enumerate(self._workers):
                if w.call is None and w.queue:
                    if not w.process.is_alive():
                        self._replace(i)
                        self._workers[i].queue = w.queue
                    self._send(i, calls)
            ready, now = self._wait()
            for i, w, index, deadline in self._busy():
                method, key, _ = calls[index]
                if w.conn in ready:
                    try:
                        _, got, value, error = w.conn.recv()
                    except EOFError:
                        outcomes[index] = (None, "environment worker died during the call", False)
                        queue = w.queue
                        self._replace(i)
                        self._workers[i].queue = queue
                        continue
                    assert got == index
                    outcomes[index] = (value, error, False)
                    if error is None and method == "reset":
                        w.keys.add(key)
                    elif error is not None:
                        w.keys.discard(key)
                    w.call = None
                elif now >= deadline:
                    outcomes[index] = (None, None, True)
                    w.keys.discard(key)
                    logger.warning("environment %s of episode %d exceeded multi_turn.timeout_s="
                                   "%g s: its worker was stopped (%d other episodes lost)",
                                   method, key, self.timeout_s, len(w.keys))
                    queue = w.queue
                    self._replace(i)
                    self._workers[i].queue = queue
        return outcomes

    def drop(self, keys: Sequence[int]) -> None:
        """Forget the episodes ``keys`` (ended): their instances are freed in the workers."""
        n = len(self._workers)
        by_worker: dict[int, list[int]] = {}
        for key in keys:
            by_worker.setdefault(key % n, []).append(key)
        for i, ks in by_worker.items():
            w = self._workers[i]
            w.keys.difference_update(ks)
            if w.ready and w.process.is_alive():
                try:
                    w.conn.send(("drop", ks))
                except OSError:
                    pass


def start_envs(spec: str, num_workers: int, timeout_s: float, search_dirs: Sequence[str] = ()):
    """The run's environment runner: :class:`EnvWorkers` (``num_workers`` > 0) or
    :class:`InProcessEnvs`. Raises ``ValueError`` when the class cannot be resolved."""
    resolve_env_class(spec, search_dirs)  # one line, before any process starts
    if num_workers < 1:
        return InProcessEnvs(spec, search_dirs)
    return EnvWorkers(spec, num_workers, timeout_s, search_dirs).start()
