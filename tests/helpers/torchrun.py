"""Run a worker script under ``torch.distributed.run`` (gloo on CPU) from a test."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240) -> str:
    """Run ``script`` on ``nproc`` processes on a free port; return its stdout, fail with the tail
    of its output if it exits non-zero."""
    from gspo_megatron.backends.megatron.parallel import _free_port

    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", script, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout
