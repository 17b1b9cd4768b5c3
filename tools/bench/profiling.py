"""Where a GPU benchmark's time goes: one call under ``torch.profiler``, summarised per unit of
work (a decoding step of the rollout engine, a training step of the MFU slice).

What it reports, per unit: the host's and the device's busy time (their sum of self times, so a
device total well under the wall time means the host's launches and waits set the pace), the ops
with the most self time on each side, the count of what makes the host wait for the device, and
the device time split into GEMMs, attention and the rest by kernel name. On CPU the device columns
are zero and the host ones still run, so the test suite exercises the code of a GPU run.
"""

from __future__ import annotations

import re
import time
from typing import Callable

from gspo_megatron.metrics import wait_for_device

WAITS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
         "cudaDeviceSynchronize")
"""Ops that block the host until the device is done: ``.item()`` / ``.tolist()`` of a device
tensor, ``nonzero`` (its output size), explicit synchronisations."""

KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm\d+_\w*mma|grouped_mm|cublas", re.I)),
)
"""Device kernels by name, first match wins: flash / memory-efficient attention (checked first:
their names carry ``cutlass::`` template arguments), then cuBLAS / CUTLASS / nvjet GEMMs;
everything else (elementwise, reductions, copies, the log-softmax, sorts) is ``other``."""


def _device_us(e) -> float:
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))


def _is_kernel(e) -> bool:
    """A device-side row (a kernel, memcpy or memset). A host op's row carries the device time of
    the kernels it launched as its own self device time too, so device totals sum these rows only
    (as ``torch.profiler``'s own table footer does)."""
    from torch.autograd import DeviceType

    return e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)


def kernel_kind(name: str) -> str:
    """``gemm``, ``attention`` or ``other`` for a device kernel's name (:data:`KERNEL_KINDS`)."""
    for kind, pattern in KERNEL_KINDS:
        if pattern.search(name):
            return kind
    return "other"


def profile_call(fn: Callable[[], object], units: Callable[[object], int] | int = 1,
                 top: int = 12) -> dict:
    """Run ``fn()`` once under ``torch.profiler`` (CPU, and CUDA where present).

    ``units``: how many units of work the call did (an int, or a function of ``fn``'s result,
    e.g. the decoding steps of a ``generate``); every figure is per unit. ``top_host`` ranks
    every row by host self time, ``top_device`` the device-side rows (kernels) by device time;
    ``device_by_kind_us_per_unit`` sums the kernels' device time by :func:`kernel_kind`;
    ``ops_per_unit`` counts host ops; ``wall_us_per_unit`` is the call's wall time under the
    profiler (which adds host overhead of its own: compare it with the device total, not with an
    unprofiled run).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    wait_for_device()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        out = fn()
        wait_for_device()
        wall = time.perf_counter() - t
    n = max(int(units(out) if callable(units) else units), 1)
    return summarize(prof.key_averages(), n, wall, top)


def summarize(rows, n: int, wall: float, top: int = 12) -> dict:
    """:func:`profile_call`'s record from ``torch.profiler``'s averaged rows (``key_averages()``)
    of a call that did ``n`` units of work in ``wall`` seconds."""
    kernels = [e for e in rows if _is_kernel(e)]

    def table(events, key) -> list[dict]:
        return [{"op": e.key, "count_per_unit": e.count / n,
                 "self_host_us_per_unit": e.self_cpu_time_total / n,
                 "self_device_us_per_unit": _device_us(e) / n}
                for e in sorted(events, key=key, reverse=True)[:top]]

    by_kind = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in kernels:
        by_kind[kernel_kind(e.key)] += _device_us(e) / n
    return {"units": n,
            "wall_us_per_unit": 1e6 * wall / n,
            "host_us_per_unit": sum(e.self_cpu_time_total for e in rows) / n,
            "device_us_per_unit": sum(_device_us(e) for e in kernels) / n,
            "device_by_kind_us_per_unit": by_kind,
            "ops_per_unit": sum(e.count for e in rows if not _is_kernel(e)) / n,
            "waits_per_unit": {e.key: e.count / n for e in rows if e.key in WAITS},
            "top_host": table(rows, lambda e: e.self_cpu_time_total),
            "top_device": table(kernels, _device_us)}
