"""Start the tests' training and worker processes from a warm interpreter.

Every end-to-end and distributed test runs real processes: ``python -m gspo_megatron.cli ...`` or a
worker script under ``torch.distributed.run``. On the 2-core CI machine a fresh interpreter spends
~8 s importing torch and megatron-core before it does anything (``python -X importtime``: torch
2.4 s, megatron.core 5 s, much of it torch.distributed.tensor, dynamo and inductor pulled in by
megatron's imports), and a torchrun launch pays it once per rank plus ~2.5 s for the launcher.
Over the suite that was several minutes of imports.

:func:`launch` forks each process instead from one server that imported those libraries once
(multiprocessing's ``forkserver`` with ``set_forkserver_preload``). The child then behaves like
``python -m module args`` / ``python script.py args`` started by ``subprocess``:

* its own session (process group), so ``os.killpg(proc.pid, ...)`` reaches everything it started;
* exactly the given environment and working directory, ``sys.argv`` and ``sys.path`` as Python
  builds them (``-m``: the working directory first; a script: its directory first; then
  ``PYTHONPATH``), stdout/stderr into files;
* the exit code Python would give: 0, ``SystemExit``'s code, 1 with the traceback on stderr for an
  uncaught exception, ``-N`` when killed by signal N; ``atexit`` handlers run.

``nproc > 1`` forks that many ranks under one agent, with the variables ``torch.distributed.run``
sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``...); when a rank
fails the agent kills the others and exits 1, as torchrun does.

Only third-party libraries are preloaded: gspo_megatron (which reads ``GSPO_FAULT`` and other
variables from the environment) is imported fresh in every child, and the CPU compatibility
patches are applied in the child, never in the server. What a warm start does not exercise - the
interpreter start and ``torch.distributed.run`` itself - stays covered by the tests that still
exec ``python -m gspo_megatron.cli`` (bad inputs, the recipe-defaults run) and the SLURM launch
tests.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback

# What a training or worker process imports before it does any work (measured: these are
# ~95 % of the import time of a gspo-train run); transformers for the HF conversion tools.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe.moe_layer",
    "transformers",
]


@functools.cache
def _context():
    """The forkserver context, its server started once per test session with the preload list.

    Started with OMP_NUM_THREADS=1 in its environment: OpenMP reads it when torch is loaded."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


def gloo_context():
    """The multiprocessing context for a test's gloo ranks: the forkserver above.

    Not this process's ``fork``: a child forked from pytest inherits the default process group
    an earlier test initialised here, and cannot initialise its own. Not ``spawn``: every rank
    of every case would import torch and megatron-core again (~8 s a rank on 2 cores). The
    server imported them once and initialised nothing."""
    return _context()


class WarmProcess:
    """The parent's handle on a launched process: the part of ``subprocess.Popen`` tests use."""

    def __init__(self, process, argv, stdout_path: str, stderr_path: str):
        self._process = process
        self.args = argv
        self.pid = process.pid
        self.stdout_path, self.stderr_path = stdout_path, stderr_path

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL everything left in the process's group (helpers it started included)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output(self) -> tuple[str, str]:
        with open(self.stdout_path) as out, open(self.stderr_path) as err:
            return out.read(), err.read()


def launch(argv: list[str], *, env: dict[str, str], cwd: str, nproc: int = 1) -> WarmProcess:
    """Start ``python <argv>`` (``argv`` is ``["-m", module, *args]`` or ``[script, *args]``) on
    ``nproc`` ranks; output goes to fresh temporary files (:meth:`WarmProcess.output`)."""
    log_dir = tempfile.mkdtemp(prefix="gspo_warm_")
    stdout, stderr = os.path.join(log_dir, "stdout"), os.path.join(log_dir, "stderr")
    for path in (stdout, stderr):
        open(path, "a").close()  # there even when the child dies before it writes
    port = 0
    if nproc > 1:
        from gspo_megatron.backends.megatron.parallel import _free_port

        port = _free_port()
    process = _context().Process(target=_child_main,
                                 args=(list(argv), dict(env), str(cwd), stdout, stderr, nproc, port))
    process.start()
    return WarmProcess(process, argv, stdout, stderr)


def run(argv: list[str], *, env: dict[str, str], cwd: str, nproc: int = 1,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """:func:`launch`, wait (``subprocess.TimeoutExpired`` after ``timeout``), then kill whatever
    the run left in its process group (a run that SIGKILLs itself can leave the checkpoint
    writer); the output comes back as strings."""
    proc = launch(argv, env=env, cwd=cwd, nproc=nproc)
    try:
        returncode = proc.wait(timeout)
    finally:
        proc.kill_group()
    out, err = proc.output()
    return subprocess.CompletedProcess(argv, returncode, out, err)


# --- in the forked child ---------------------------------------------------------------------

def _child_main(argv, env, cwd, stdout, stderr, nproc, port):
    os.setsid()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if nproc == 1:
        code = _run_entry(argv, env, cwd)
    else:
        code = _agent(argv, env, cwd, nproc, port)
    os._exit(code)


def _agent(argv, env, cwd, nproc: int, port: int) -> int:
    """torchrun's part: fork the ranks, wait; the first failure kills the others."""
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os._exit(_run_entry(argv, rank_env, cwd))
        ranks[pid] = rank
    failed = False
    while ranks:
        pid, status = os.wait()
        if ranks.pop(pid, None) is None:
            continue
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return 1 if failed else 0


def _run_entry(argv, env, cwd) -> int:
    """Run ``python <argv>`` in this process as the interpreter would; return its exit code."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = [module, *argv[2:]]  # run_module puts the module's file in argv[0]
        sys.path[:0] = [cwd, *extra]
        entry = functools.partial(runpy.run_module, module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[:0] = [os.path.dirname(script), *extra]
        entry = functools.partial(runpy.run_path, script, run_name="__main__")
    try:
        entry()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        _flush()
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
