"""Run a function on N gloo processes (forked from the warm server of :mod:`tests.helpers.warm`:
``fn`` must be a module-level function)."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # pickled here, whole: the queue's own pickler would pass tensors as file descriptors
        # that the parent must fetch from this process, which may have exited by then
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report any failure to the parent with its traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args, timeout: float = 120.0):
    """Call ``fn(rank, world_size, *args)`` on each rank; return the per-rank results in rank order."""
    from tests.helpers import warm

    ctx = warm.gloo_context()
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world_size):
        rank, status, value = queue.get()
        if status == "error":
            for p in procs:
                p.kill()
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results[rank] = pickle.loads(value)
    for p in procs:
        p.join(timeout)
    return [results[r] for r in range(world_size)]
