"""CPU fixes for megatron-core 0.16's static text-generation loop, applied once at start-up.

The module-level ``torch`` proxy of :mod:`gspo_megatron.compat.cpu` cannot reach three CUDA-only
spots of ``generate_all_output_tokens_static_batch``; :func:`apply_inference_compat` fixes them
when CUDA is absent (and does nothing otherwise):

* ``torch.zeros(...).cuda()`` (``generated_sequence_lengths``): a *tensor method*, so
  ``torch.Tensor.cuda`` becomes the identity. Process-wide, but only on a machine without CUDA,
  where ``.cuda()`` could only raise ("Torch not compiled with CUDA enabled").
* ``torch.cuda.Event(enable_timing=True).elapsed_time``: the compat no-op event has no timer, so
  the controller module's ``torch.cuda.Event`` becomes a wall-clock event.
* ``communication_utils._is_cuda`` asserts ``tensor.is_cuda`` before the pipeline-parallel logits
  broadcast; it is relaxed to "not None" (the broadcast itself works on gloo).

:func:`silence_static_engine_progress_bar` (CPU and GPU): the static engine draws a tqdm bar per
``generate()`` call (one per RL step), bound in its module at import, so ``TQDM_DISABLE`` only
works if set before tqdm is first imported. ``GSPO_ROLLOUT_PROGRESS=1`` keeps the bars.
"""

from __future__ import annotations

import functools
import os
import types

import torch


def _cuda_identity(self, *args, **kwargs):
    return self


class _TimingEvent:
    """CPU stand-in for ``torch.cuda.Event(enable_timing=True)`` (the static loop times each step)."""

    def __init__(self, *args, **kwargs):
        import time

        self._time = time.perf_counter
        self.t = None

    def record(self, *args, **kwargs):
        self.t = self._time()

    def synchronize(self):
        pass

    def elapsed_time(self, end: "_TimingEvent") -> float:
        return 1e3 * ((end.t or 0.0) - (self.t or 0.0))


def _is_not_none(tensor):
    assert tensor is not None


class _CudaWithTimingEvents:
    Event = _TimingEvent

    def __init__(self, cuda):
        self._cuda = cuda

    def __getattr__(self, name):
        return getattr(self._cuda, name)


class _TorchWithTimingEvents(types.ModuleType):
    def __init__(self, base):
        super().__init__("torch")
        self._base = base
        self.cuda = _CudaWithTimingEvents(base.cuda)

    def __getattr__(self, name):
        return getattr(self._base, name)




def apply_inference_compat() -> bool:
    """Apply the three static-loop fixes (idempotent). False (nothing done) when CUDA is present."""
    if torch.cuda.is_available():
        return False
    from megatron.core.inference import communication_utils as cu
    from megatron.core.inference.text_generation_controllers import (
        text_generation_controller as tgc,
    )

    torch.Tensor.cuda = _cuda_identity
    if not isinstance(tgc.torch, _TorchWithTimingEvents):
        tgc.torch = _TorchWithTimingEvents(tgc.torch)
    cu._is_cuda = _is_not_none
    return True


def silence_static_engine_progress_bar() -> None:
    """Point the static engine module's ``tqdm`` at a disabled bar (idempotent)."""
    from megatron.core.inference.engines import static_engine

    already = isinstance(static_engine.tqdm, functools.partial)
    if os.environ.get("GSPO_ROLLOUT_PROGRESS") != "1" and not already:
        static_engine.tqdm = functools.partial(static_engine.tqdm, disable=True)
