"""Checkpoints written in the background (Megatron-LM's ``--async-save`` machinery) and the server
through which Megatron's checkpoint writers return their results.

:func:`~.checkpoint.save_checkpoint` takes an :class:`AsyncCheckpointWriter`; every training
process starts :func:`start_write_results_server` before its model is built.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time


def _results_server_init(parent: int) -> None:
    """The forked results server's initializer: a fresh process's signal handlers, not the
    trainer's checkpoint-and-exit ones; and, on Linux, killed with its parent (a rank killed
    with SIGKILL would otherwise leave it holding the pages shared at the fork)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server ends with the parent's exit only
        return
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(0)


def start_write_results_server() -> None:
    """Fork now the process through which Megatron's checkpoint writer returns its results.

    megatron-core's filesystem writer (every torch_dist save, synchronous or not) hands its write
    results back through a ``multiprocessing`` Manager queue that it creates at the process's
    first save with the "spawn" start method: a fresh interpreter per rank that re-imports the
    launching module (for ``gspo-train``, torch and what the CLI imports) inside the first
    checkpoint's stall. Measured on a 2-core CPU machine: the first save of a ``gspo-train``
    process waited 3.2 s for it; a script that imports megatron-core at the top, 7.5 s. The same
    server started by fork is ready in ~0.03 s.

    Call it early, before the model is built: a forked process keeps the pages its parent had at
    the fork, so forking while the process is small holds none of the model, optimizer or offload
    buffers allocated later. The server never touches CUDA and ends with its rank. A no-op when
    the queue exists or this megatron-core has no such hook (its own spawned server is then
    used, as before).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(_results_server_init, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()


class AsyncCheckpointWriter:
    """Checkpoints written in the background: Megatron's ``AsyncCallsQueue`` (the
    ``--async-save`` machinery of Megatron-LM), one checkpoint in flight at a time.

    :func:`save_checkpoint` builds the sharded state dict and plans the write on the training
    process (the stall a step sees), then a forked writer process holds the state as it was at
    the fork (on GPU, after Megatron staged the shards to host memory) and writes the shards while
    training goes on. The commit - metadata, the rename of ``iter_XXXXXXX.tmp``, the tracker file,
    pruning - runs on the training ranks in :meth:`wait` (collective), so a write that is killed
    or fails never becomes the latest checkpoint, exactly as in the synchronous path.
    """

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)

    @property
    def pending(self) -> bool:
        """A checkpoint is being written or waits for its commit."""
        return self._queue.get_num_unfinalized_calls() > 0

    def schedule(self, request) -> None:
        if self.pending:
            raise RuntimeError("internal: a checkpoint is already in flight")
        self._queue.schedule_async_request(request)

    def wait(self) -> float:
        """Block until the checkpoint in flight is written, then commit it (collective: every
        rank calls it at the same point). Returns the seconds spent here; 0 when none is pending."""
        if not self.pending:
            return 0.0
        start = time.perf_counter()
        self._queue.maybe_finalize_async_calls(blocking=True)
        return time.perf_counter() - start

    def abort(self) -> None:
        """Kill the writer of an uncommitted checkpoint (after an error): it never becomes the
        latest, and its ``.tmp`` directory is removed by the next save into the same step.
        (``AsyncCallsQueue.close(abort=True)`` leaves non-persistent writers running in
        megatron-core 0.16, so each active call's writer is killed here.)"""
        while self._queue.async_calls:
            self._queue.async_calls.popleft().async_caller.close(abort=True)
