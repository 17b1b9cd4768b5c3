"""Shared pieces of the benchmarks: the result record, side-by-side timing, machine description.

Every ratio is measured side by side: the variants run interleaved (A, B, A, B, ...) in one
process, and the ratio reported is the median of the per-round ratios, so a change of machine load
during a run shifts both sides of a round alike.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

os.environ.setdefault("TQDM_DISABLE", "1")  # Megatron's static engine draws a bar per call

SCHEMA_VERSION = 1
ROW_KEYS = ("metric", "value", "unit")
RESULT_KEYS = ("name", "title", "target", "met", "rows", "ratios", "config", "notes", "seconds")


def make_result(name: str, title: str, target: str, met: bool | None, rows: list[dict],
                ratios: dict[str, float] | None = None, config: dict | None = None,
                notes: list[str] | None = None, seconds: float = 0.0) -> dict:
    """One benchmark's record. ``met``: None when the target could not be measured here."""
    return {"name": name, "title": title, "target": target, "met": met, "rows": rows,
            "ratios": dict(ratios or {}), "config": dict(config or {}),
            "notes": list(notes or []), "seconds": round(float(seconds), 2)}


def row(metric: str, value, unit: str = "") -> dict:
    if isinstance(value, float):
        value = float(f"{value:.4g}")
    return {"metric": metric, "value": value, "unit": unit}


def validate_result(res: dict) -> None:
    """Raise ``ValueError`` if ``res`` is not a well-formed result record (schema, not timings)."""
    missing = [k for k in RESULT_KEYS if k not in res]
    if missing:
        raise ValueError(f"result {res.get('name')!r} lacks {missing}")
    if res["met"] not in (True, False, None):
        raise ValueError(f"result {res['name']!r}: met must be true/false/null")
    if not isinstance(res["rows"], list) or not res["rows"]:
        raise ValueError(f"result {res['name']!r}: no rows")
    for r in res["rows"]:
        if set(r) != set(ROW_KEYS):
            raise ValueError(f"result {res['name']!r}: bad row {r}")
        if r["value"] is not None and not isinstance(r["value"], (int, float, str)):
            raise ValueError(f"result {res['name']!r}: bad value in {r}")
    for k, v in res["ratios"].items():
        if v is not None and not isinstance(v, (int, float)):
            raise ValueError(f"result {res['name']!r}: ratio {k} is not a number")


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                reset: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Wall-clock seconds of each callable, run round-robin ``rounds`` times after ``warmup``
    untimed rounds. The order inside a round alternates so neither side always runs first."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            if reset is not None:
                reset()
            t = time.perf_counter()
            fns[n]()
            dt = time.perf_counter() - t
            if r >= warmup:
                times[n].append(dt)
    return times


def median_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of ``time[num] / time[den]`` (both measured in the same round)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def median(xs) -> float:
    return statistics.median(list(xs))


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        info["ram_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
        info["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001 - informational only
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def run_child(module: str, args: list[str], timeout: float = 900) -> dict:
    """``python -m module args`` in a fresh process; its last stdout line is a JSON object."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TQDM_DISABLE", "1")
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {' '.join(args)} failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def run_cli(args: list[str], nproc: int, timeout: float = 1800, bind_cores: bool = False) -> None:
    """``gspo-train args`` on ``nproc`` gloo ranks under ``torch.distributed.run`` (a free local
    port), one thread each; raises with the tail of its stderr when it fails. ``bind_cores``:
    local rank r runs on core r only (``taskset``, as a CPU launcher binds ranks; where the
    machine has the cores and taskset), so two busy ranks never share a core or migrate."""
    import shutil
    import socket

    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    entry = ["-m", "gspo_megatron.cli", *args]
    if bind_cores and shutil.which("taskset") and nproc <= (os.cpu_count() or 1):
        # torchrun --no-python runs the program as given, with LOCAL_RANK in its environment
        entry = ["--no-python", "bash", "-c", 'exec taskset -c "$LOCAL_RANK" "$0" "$@"',
                 sys.executable, *entry]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                           *entry], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"gspo-train {' '.join(args)} failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")


def run_layout(module: str, spec: dict, nproc: int, timeout: float = 1800) -> dict:
    """Benchmark ``module``'s ``--child`` with ``spec`` (JSON) in a fresh process, or on ``nproc``
    gloo ranks under ``torch.distributed.run`` (a free local port for the rendezvous); the JSON
    object rank 0 printed."""
    import socket

    args = ["--child", json.dumps(spec)]
    if nproc == 1:
        return run_child(module, args)
    with socket.socket() as s:  # a free port on this machine for the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return run_child("torch.distributed.run", ["--nproc-per-node", str(nproc), "--master-addr",
                                               "127.0.0.1", "--master-port", str(port), "-m",
                                               module, *args], timeout=timeout)


def layout_main(run: Callable[..., dict], child: Callable[[dict], dict]) -> None:
    """``__main__`` of a benchmark with :func:`run_layout` children: ``--child SPEC`` runs
    ``child(spec)`` and rank 0 prints its JSON; otherwise :func:`module_main` with ``--rounds``."""
    if "--child" in sys.argv:
        res = child(json.loads(sys.argv[sys.argv.index("--child") + 1]))
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(res), flush=True)
    else:
        module_main(run, extra_args=lambda ap: ap.add_argument("--rounds", type=int))


@contextlib.contextmanager
def tiny_trainer(overrides: list[str]):
    """``gspo-train``'s trainer (``build(cfg, prepare(cfg))``, in this process) on
    ``examples/configs/tiny_gspo.yaml`` with ``overrides`` and a temporary run directory. Yields
    ``(trainer, run_dir)``; afterwards the trainer is closed, the distributed state destroyed and
    the directory removed."""
    import shutil
    import tempfile

    from gspo_megatron.backends.megatron.parallel import destroy_distributed
    from gspo_megatron.cli import build, prepare
    from gspo_megatron.config.loader import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_dir = tempfile.mkdtemp(prefix="gspo_bench_")
    try:
        cfg = load_config(os.path.join(root, "examples", "configs", "tiny_gspo.yaml"),
                          [f"logging.run_dir={run_dir}", "logging.progress=false", *overrides])
        trainer = build(cfg, prepare(cfg))
        try:
            yield trainer, run_dir
        finally:
            trainer.close()
            destroy_distributed()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def quiet_megatron() -> None:
    """Silence the import-time and per-call warnings Megatron prints on CPU."""
    import logging
    import warnings

    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def module_main(run: Callable[..., dict], argv: list[str] | None = None, extra_args=None) -> None:
    """``python -m tools.bench.<name> [--smoke] [--json-out F] [extra]``: run one benchmark."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="toy sizes (checks the code, not timings)")
    ap.add_argument("--json-out", default=None)
    if extra_args is not None:
        extra_args(ap)
    args = vars(ap.parse_args(argv))
    smoke, out = args.pop("smoke"), args.pop("json_out")
    t = time.perf_counter()
    res = run(smoke=smoke, **{k: v for k, v in args.items() if v is not None})
    res["seconds"] = round(time.perf_counter() - t, 2)
    validate_result(res)
    text = json.dumps(res)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text, flush=True)
