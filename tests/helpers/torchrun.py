"""Run a worker script the way ``torch.distributed.run`` would (gloo on CPU) from a test."""

from __future__ import annotations

import os

from tests.helpers import warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240) -> str:
    """Run ``script`` on ``nproc`` ranks on a free port, forked from the warm interpreter
    (:mod:`tests.helpers.warm`); return its stdout, fail with the tail of its output if it exits
    non-zero."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = warm.run([script, *args], env=env, cwd=os.getcwd(), nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout
