"""Run megatron-core 0.16.x on a machine without CUDA (gloo backend, fp32).

megatron-core assumes a CUDA device in a few dozen places. None of them is about the maths: they
allocate small buffers "on the current CUDA device", create side streams, or seed the CUDA RNG.
This module makes those places resolve to the CPU, and nothing else.

How (and how far each fix reaches):

* ``_TorchOnCpu`` is a stand-in for the ``torch`` *module-level name* inside a short, explicit list
  of megatron modules (``_PATCHED_MODULES``). Inside those modules, and only there,
  ``torch.cuda.current_device()`` returns the CPU device, CUDA streams/events are no-ops, the CUDA RNG
  calls use the CPU generator, and tensor factories given ``device="cuda"`` allocate on the CPU.
  Everything else is the real ``torch``. Code outside those modules (ours, the user's, torch
  itself) is untouched, so this is not a global monkeypatch of ``torch.cuda``.
* Three module functions are replaced by CPU equivalents where no narrower fix exists (the RNG
  state getters/setters of ``tensor_parallel.random`` and the fp32 grad-clip helper that asserts the
  type string ``torch.cuda.FloatTensor``).
* :func:`keep_freed_memory` (speed only, not applied here: the CPU rollout engine calls it).
* ``torch.compile`` (megatron's ``jit_fuser``) is set to run eagerly with
  ``torch.compiler.set_stance("force_eager")``. That switch is process-wide: it costs ~17 s and a C++
  toolchain per process on first use, and buys nothing at the sizes a CPU runs.

Every fix is applied once, by :func:`apply_cpu_compat` (through
:func:`gspo_megatron.compat.apply_compat`, which the distributed initialisation calls); it does
nothing when CUDA is available. Each entry says which failure it fixes and for which
megatron-core versions it was checked.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import time
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)



def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, int) to CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    """Wrap a tensor factory so that ``device=<cuda>`` allocates on the CPU (and
    ``pin_memory=True``, which needs CUDA, is dropped: the dynamic engine's host buffers)."""

    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    wrapped.__name__ = getattr(factory, "__name__", "factory")
    return wrapped


class _NoOpStream:
    """A CUDA stream/event stand-in: on CPU every op is already ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _WallClockEvent(_NoOpStream):
    """A CUDA timing event on the host clock: the dynamic engine times every step with
    ``Event(enable_timing=True)`` and ``elapsed_time`` (failure 12)."""

    def __init__(self, *args, **kwargs):
        self.t = time.perf_counter()

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA reports


class _CudaOnCpu(types.SimpleNamespace):
    """``torch.cuda`` as megatron's buffer/stream/RNG code sees it on a CPU-only machine."""

    Stream = _NoOpStream
    Event = _WallClockEvent

    @staticmethod
    def current_device():
        # Failure 1: buffers allocated at torch.cuda.current_device() (router, TP mappings, rotary).
        return torch.device("cpu")

    @staticmethod
    def current_stream(*args, **kwargs):
        # Failure 2: the alltoall dispatcher and the shared expert overlap use side streams.
        return _NoOpStream()

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(*args, **kwargs):
        pass

    @staticmethod
    def memory_stats(*args, **kwargs) -> dict:
        # Failure 13: the dynamic engine logs allocator stats around suspend / resume (no CUDA
        # allocator here: every figure reads 0).
        return collections.defaultdict(int)

    # Failure 3: the CUDA RNG tracker seeds/saves/restores the CUDA generator. On CPU the tracker
    # forks the CPU generator instead, which is what dropout and init draw from there.
    get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _as_int_list(split_sizes: Any) -> Any:
    """Tensor / numpy split sizes -> list[int] (gloo's all_to_all_single takes only lists)."""
    if split_sizes is None or isinstance(split_sizes, list):
        return split_sizes
    if hasattr(split_sizes, "tolist"):
        return [int(x) for x in split_sizes.tolist()]
    return [int(x) for x in split_sizes]


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended along dim 0 up to ``rows``."""
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


class _DistributedOnCpu(types.SimpleNamespace):
    """``torch.distributed`` as the MoE dispatcher and the TP mappings see it on gloo.

    Failure 8: with EP>1 the alltoall dispatcher passes its split sizes as CPU tensors (on GPU they
    are numpy arrays from a device-to-host copy); gloo's ``all_to_all_single`` accepts only lists.

    Failure 9: with expert-TP>1 and EP>1 the dispatcher gathers / reduce-scatters a different
    number of tokens per rank through the list forms of ``all_gather`` / ``reduce_scatter``, which
    gloo refuses for unequal sizes. Those calls are padded along dim 0 to the largest size and
    trimmed afterwards: same result, one extra copy (CPU test sizes only).
    """

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return torch.distributed.all_to_all_single(
            output, input, output_split_sizes=_as_int_list(output_split_sizes),
            input_split_sizes=_as_int_list(input_split_sizes), group=group, async_op=async_op)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] for t in tensor_list]
        if len(set(rows + [tensor.shape[0]])) == 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("uneven async all_gather on CPU")
        most = max(rows)
        padded = [_padded_rows(t, most) for t in tensor_list]
        torch.distributed.all_gather(padded, _padded_rows(tensor, most), group=group)
        for out, got, n in zip(tensor_list, padded, rows):
            out.copy_(got[:n])
        return None

    @staticmethod
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None,
                       async_op=False):
        rows = [t.shape[0] for t in input_list]
        if len(set(rows + [output.shape[0]])) == 1:
            return torch.distributed.reduce_scatter(output, input_list, op=op, group=group,
                                                    async_op=async_op)
        if async_op:
            raise NotImplementedError("uneven async reduce_scatter on CPU")
        most = max(rows)
        padded_out = _padded_rows(output, most).clone()
        torch.distributed.reduce_scatter(padded_out, [_padded_rows(t, most) for t in input_list],
                                         op=op, group=group)
        output.copy_(padded_out[:output.shape[0]])
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm",
    "linspace", "eye", "triu", "tril", "empty_strided", "as_tensor", "empty_like", "zeros_like",
    "ones_like", "full_like",
)


class _TorchOnCpu(types.ModuleType):
    """The ``torch`` name inside a patched megatron module; see the module docstring."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        self.distributed = _DistributedOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups skip __getattr__
        return value


# Modules whose ``torch`` name is redirected, and why. Paths are relative to ``megatron.core``.
_PATCHED_MODULES = {
    "transformer.moe.router": "router buffers and aux-loss scalars at current_device()",
    "transformer.moe.moe_utils": "MoE metric tracker with device='cuda'; record_stream",
    "transformer.moe.token_dispatcher": "alltoall dispatcher's device-to-host stream",
    "transformer.moe.experts": "expert weights allocated at current_device()",
    "transformer.moe.shared_experts": "shared-expert overlap stream",
    "transformer.utils": "causal mask built with device='cuda' (failure 5)",
    "transformer.attention": "buffers at current_device()",
    "transformer.dot_product_attention": "buffers at current_device()",
    "transformer.transformer_layer": "buffers at current_device()",
    "transformer.module": "buffers at current_device()",
    "tensor_parallel.mappings": "all-gather / reduce-scatter outputs at current_device()",
    "tensor_parallel.layers": "weights and SP gather buffers at current_device()",
    "tensor_parallel.random": "CUDA RNG tracker (failure 3)",
    "tensor_parallel.utils": "buffers at current_device()",
    "tensor_parallel.data": "broadcast buffers on cuda",
    "models.common.embeddings.rotary_pos_embedding": "inv_freq at current_device()",
    "models.common.embeddings.yarn_rotary_pos_embedding": "YaRN inv_freq moved to current_device()",
    "models.gpt.gpt_model": "buffers at current_device()",
    "pipeline_parallel.schedules": "token counters with device='cuda' (failure 10)",
    "pipeline_parallel.p2p_communication": "receive buffers at current_device()",
    "distributed.param_and_grad_buffer": "grad buffers at current_device() (failure 10)",
    "distributed.distributed_data_parallel": "buffers at current_device()",
    "optimizer.optimizer": "found-inf / scale tensors with device='cuda' (failure 10)",
    "optimizer.grad_scaler": "loss scale tensors with device='cuda'",
    "optimizer.clip_grads": "grad-norm scalars with device='cuda' (failure 10)",
    "optimizer.distrib_optimizer": "buffers at current_device()",
    "inference.contexts.static_context": "KV cache at current_device()",
    "inference.contexts.dynamic_context": "paged KV cache and request tables at current_device()",
    "inference.contexts.dynamic_block_allocator": "block free-list at current_device()",
    "inference.contexts.attention_context.mha_metadata": "attention metadata at current_device()",
    "inference.engines.dynamic_engine": "prompt tensors at current_device(); timing events",
    "inference.text_generation_controllers.text_generation_controller": "sampling buffers on cuda",
    "inference.model_inference_wrappers.abstract_model_inference_wrapper": "buffers on cuda",
    "inference.model_inference_wrappers.gpt.gpt_inference_wrapper": "buffers on cuda",
    "inference.communication_utils": "pipeline broadcast buffers on cuda",
    "inference.utils": "buffers on cuda",
    "dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize() before writing",
    "dist_checkpointing.strategies.async_utils": "synchronize; liveness flags at current_device()",
    "dist_checkpointing.strategies.state_dict_saver": "save-plan validation flags on cuda",
    "dist_checkpointing.strategies.fully_parallel": "synchronize around exchanges",
    "dist_checkpointing.tensor_aware_state_dict": "synchronize",
    "dist_checkpointing.exchange_utils": "exchange buffers with device='cuda'",
    "rerun_state_machine": "validation scalars with device='cuda'",
    "utils": "buffers at current_device()",
}


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's ``get_pos_emb_on_this_cp_rank`` without its pinned host index and ``.cuda()``
    (failure 15): this context-parallel rank's two chunks of ``2 cp`` along ``seq_dim``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _cpu_rng_get(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's fp32 grad clipping without its ``torch.cuda.FloatTensor`` type assertion
    (failure 11). Same semantics: scale every grad in place by ``max_norm / (total_norm + 1e-6)``."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(clip_coeff)


def _no_nvtx(*args, **kwargs) -> None:
    """An NVTX range marker that marks nothing (a profiler annotation; no CUDA, no profiler)."""


def keep_freed_memory() -> None:
    """glibc's allocator: serve large temporaries from the heap and keep freed memory mapped
    (process-wide from the call on).

    By default a block over a (dynamic) threshold of a few MB is a fresh ``mmap`` and the top of
    the heap is returned to the OS once 2x that is free, so a tensor of that size allocated every
    step (the paged-attention fallback's gathered keys and values: 5 MB per layer at 128 requests
    x 80 keys) page-faults every time: 1.4 ms -> 6.7 ms per attention call measured at 80 keys.
    Raising both thresholds (mmap 32 MB, glibc's maximum; trim 1 GB) keeps those pages. The
    price is a higher resident peak where memory is freed and not reused (the HF converter's
    shard-by-shard peak: 348 -> 458 MB on its test), so only the CPU rollout engine applies it
    (:class:`~gspo_megatron.backends.megatron.engine.dynamic.DynamicRollout`), never the
    converter. No change to any result; a no-op outside glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("compat: no glibc mallopt, allocator left as it is")
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 * 1024 ** 2)
    mallopt(m_trim_threshold, 1024 ** 3)


def apply_cpu_compat() -> bool:
    """Make megatron-core run on CPU. Idempotent; a no-op (returns False) when CUDA is available."""
    if torch.cuda.is_available():
        return False
    from megatron.core.package_info import __version__ as mcore_version
    from megatron.core.tensor_parallel import random as mcore_random

    if mcore_random._get_cuda_rng_state is _cpu_rng_get:  # applied before in this process
        return True

    # Failure 7: jit_fuser is torch.compile; make it eager (process-wide, see module docstring).
    torch.compiler.set_stance("force_eager")

    proxy = _TorchOnCpu()
    for rel_name in _PATCHED_MODULES:
        try:
            module = importlib.import_module(f"megatron.core.{rel_name}")
        except ImportError:  # a module moved or needs an optional dependency: nothing to patch
            logger.debug("compat: megatron.core.%s not importable, skipped", rel_name)
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy

    # Failure 4 (te_general_gemm undefined without TE) is not CPU-specific: compat.apply_compat
    # fixes it on every machine without Transformer Engine (apply_missing_te_compat).

    # Failure 14: the dynamic engine marks its steps with NVTX ranges, which a CPU build lacks.
    from megatron.core.inference.engines import dynamic_engine

    dynamic_engine.range_push = dynamic_engine.range_pop = _no_nvtx

    # Failure 3: activation checkpointing and the RNG tracker save/restore the CUDA RNG state.
    mcore_random._get_cuda_rng_state = _cpu_rng_get
    mcore_random._set_cuda_rng_state = _cpu_rng_set

    # Failure 11: fp32 grad clipping asserts the CUDA tensor type string.
    from megatron.core.optimizer import clip_grads, optimizer as mcore_optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    # Failure 15: context parallelism's rotary-table slicing pins a host index and calls .cuda().
    from megatron.core.models.common.embeddings import (rope_utils, rotary_pos_embedding,
                                                         yarn_rotary_pos_embedding)

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank

    logger.info("megatron-core %s: CUDA absent, CPU compatibility applied", mcore_version)
    return True
