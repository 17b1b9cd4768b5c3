"""CPU fix for megatron-core 0.16's inference utilities, applied once at start-up.

:func:`apply_inference_compat`: ``communication_utils._is_cuda`` asserts ``tensor.is_cuda`` before
the pipeline-parallel logits broadcast (``broadcast_from_last_pipeline_stage``, which the rollout
controller calls under PP > 1); without CUDA it is relaxed to "not None" (the broadcast itself works
on gloo). Nothing is done when CUDA is present.

(Megatron's own static-batch loop also needed ``Tensor.cuda`` and CUDA timing events on CPU; the
rollout engine runs its own loop, :class:`~gspo_megatron.backends.megatron.engine.hooks.
RolloutTextGenerationController`, which uses neither, so those process-wide patches are gone.)

:func:`silence_static_engine_progress_bar` (CPU and GPU): the static engine draws a tqdm bar per
``generate()`` call (one per RL step), bound in its module at import, so ``TQDM_DISABLE`` only
works if set before tqdm is first imported. ``GSPO_ROLLOUT_PROGRESS=1`` keeps the bars.
"""

from __future__ import annotations

import functools
import os

import torch


def _is_not_none(tensor):
    assert tensor is not None


def apply_inference_compat() -> bool:
    """Relax the PP broadcast's CUDA assertion (idempotent). False (nothing done) with CUDA."""
    if torch.cuda.is_available():
        return False
    from megatron.core.inference import communication_utils as cu

    cu._is_cuda = _is_not_none
    return True


def silence_static_engine_progress_bar() -> None:
    """Point the static engine module's ``tqdm`` at a disabled bar (idempotent)."""
    from megatron.core.inference.engines import static_engine

    already = isinstance(static_engine.tqdm, functools.partial)
    if os.environ.get("GSPO_ROLLOUT_PROGRESS") != "1" and not already:
        static_engine.tqdm = functools.partial(static_engine.tqdm, disable=True)
