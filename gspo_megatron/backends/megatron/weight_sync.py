"""Whole weights out of one parallel layout and into another, in memory: what the rollout ranks
of ``rollout.placement: separate`` load after every optimizer step.

Both ends read the model's ``sharded_state_dict`` (the description ``dist_checkpointing`` saves by):
every tensor a rank holds is a :class:`ShardedTensor` with a layout-independent key, the global
shape and its offset in it. :func:`gather_full_state` assembles them whole on rank 0 of the
model's world (one ``all_gather_object``); :func:`load_full_state` copies each of a rank's shards
out of the whole tensors, whatever that rank's TP/EP/PP layout. Cost: every parameter once
through the gather (rank 0 holds a full copy), fine for the models CI and the CPU benchmarks run;
a cluster-scale transfer would broadcast bucket by bucket from each owner over NCCL instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _shards(gpt_model) -> list:
    """This rank's main-replica :class:`ShardedTensor` pieces of ``gpt_model`` (factories such
    as the SwiGLU split built: their pieces are views of the parameters)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = gpt_model.sharded_state_dict()
    apply_factories(state)
    return [t for t in nested_values(state)
            if isinstance(t, ShardedTensor) and t.flattened_range is None]


def _window(t) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """``(slices of the global tensor, local shape with the prepended axes)`` of a shard."""
    local = (1,) * t.prepend_axis_num + tuple(t.data.shape)
    return tuple(slice(o, o + n) for o, n in zip(t.global_offset, local)), local


def gather_full_state(gpt_model, dtype: torch.dtype | None = torch.float32
                      ) -> dict[str, torch.Tensor] | None:
    """Every tensor of ``gpt_model`` assembled whole on rank 0 of the default group (None on the
    other ranks), keyed by its sharded key, on the CPU in ``dtype`` (None: as held)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    pieces = []
    for t in _shards(gpt_model):
        if is_main_replica(t.replica_id):
            data = t.data.detach().to("cpu", dtype or t.data.dtype, copy=True)
            pieces.append((t.key, tuple(t.global_shape), *_window(t), data))
    gathered = [pieces]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pieces)
        if dist.get_rank() != 0:
            return None
    full: dict[str, torch.Tensor] = {}
    for key, shape, window, local, data in (p for rank in gathered for p in rank):
        out = full.setdefault(key, torch.zeros(shape, dtype=data.dtype))
        out[window] = data.reshape(local)
    return full


@torch.no_grad()
def load_full_state(gpt_model, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every tensor of ``gpt_model`` out of ``full`` (as
    :func:`gather_full_state` returns it, from any layout). Raises ``KeyError`` naming a tensor
    ``full`` lacks."""
    for t in _shards(gpt_model):
        if t.key not in full:
            raise KeyError(f"the weights sent hold no {t.key!r}")
        window, local = _window(t)
        t.data.copy_(full[t.key][window].reshape(t.data.shape))
