"""Distributed start-up: process groups, Megatron's parallel state, seeds.

The algorithm code never reads Megatron's globals; it receives the groups it reduces over from
:class:`ParallelGroups`, which is built here once.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from gspo_megatron.config import ModelConfig, ParallelConfig
from gspo_megatron.distributed import ParallelGroups

logger = logging.getLogger(__name__)


def initialize_distributed(
    parallel: ParallelConfig,
    model: ModelConfig,
    seed: int,
    timeout_minutes: int = 30,
) -> ParallelGroups:
    """Start torch.distributed from the torchrun environment (a single process when it is unset),
    validate the layout, build Megatron's parallel state and seed every RNG.

    gloo is used without CUDA (after :func:`gspo_megatron.compat.apply_compat`), NCCL with it.
    """
    from megatron.core import parallel_state, tensor_parallel

    from gspo_megatron.compat import apply_compat

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    parallel.validate(world_size, model)  # before any group or weight exists
    apply_compat()

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Under torchrun (even with one process) rendezvous through its store (env://); a plain
        # single process gets a fresh local port rather than trusting a stray MASTER_PORT.
        launched = world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ
        init_method = "env://" if launched else f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(
            backend=backend, world_size=world_size, rank=rank, init_method=init_method,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return read_parallel_groups()


def read_parallel_groups() -> ParallelGroups:
    """Snapshot Megatron's parallel state into a :class:`ParallelGroups`."""
    from megatron.core import parallel_state as ps

    return ParallelGroups(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        pp_group=ps.get_pipeline_model_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
    )


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def drop_inference_buffers() -> None:
    """Forget the buffers of Megatron's global memory buffer (the sequence-parallel all-gather's,
    ``"mpu"``) that a pass in inference mode allocated: an inference tensor cannot be written
    outside inference mode, so the update's forward would fail on it (a run whose first pass at
    TP > 1 with sequence parallelism is the old-log-prob pass or a rollout: no SFT warm-up). The
    next pass that needs one allocates it again.

    Also forgets Megatron's rotary tables (``RotaryEmbedding.forward`` and its YaRN variant are
    ``lru_cache``d per sequence length): one made in inference mode is an inference tensor, and
    full activation recompute (``precision.recompute_granularity: full``) saves the table with
    the layer's inputs for backward, which fails on it. Remade on the next forward, the same
    values."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding)
    from megatron.core.parallel_state import get_global_memory_buffer

    for table in (RotaryEmbedding, YarnRotaryEmbedding):
        table.forward.cache_clear()

    try:
        buffers = get_global_memory_buffer().buffer
    except AssertionError:  # not initialised: nothing allocated
        return
    for key in [k for k, t in buffers.items() if t.is_inference()]:
        del buffers[key]
