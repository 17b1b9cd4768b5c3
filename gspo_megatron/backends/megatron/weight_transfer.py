"""Whole weights out of one parallel layout and into another, in memory: what the rollout ranks
of ``rollout.placement: separate`` load after every optimizer step.

Both ends read the model's ``sharded_state_dict`` (the description ``dist_checkpointing`` saves by):
every tensor a rank holds is a :class:`ShardedTensor` with a layout-independent key, the global
shape and its offset in it. :func:`gather_flat_state` assembles them whole on rank 0 of the
model's world (one ``all_gather_object`` when the model is sharded) straight into the flat
per-dtype buffers of a :class:`~gspo_megatron.policy.FlatWeights`, which the weight broadcast
sends as they are; :func:`load_full_state` copies each of a rank's shards out of the whole
tensors, whatever that rank's TP/EP/PP layout. Cost: every parameter once through the gather
(rank 0 holds a full copy), fine for the models CI and the CPU benchmarks run; a cluster-scale
transfer would broadcast bucket by bucket from each owner instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron.policy import FlatWeights


def _shards(gpt_model) -> list:
    """This rank's main-replica :class:`ShardedTensor` pieces of ``gpt_model`` (factories such
    as the SwiGLU split built: their pieces are views of the parameters)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = gpt_model.sharded_state_dict()
    apply_factories(state)
    return [t for t in nested_values(state)
            if isinstance(t, ShardedTensor) and t.flattened_range is None]


class ShardIndex:
    """:func:`_shards` of one model, built once: ``sharded_state_dict()`` and its factories cost
    ~2.6 ms a call on the tiny model, on both ends of every weight transfer. The pieces are views
    of the parameters, so they stay valid while no parameter's storage moves; the index is
    rebuilt when one does (a parameter's ``data`` replaced)."""

    def __init__(self, gpt_model):
        self.model = gpt_model
        self._storages: tuple[int, ...] | None = None
        self._shards: list = []

    def __call__(self) -> list:
        storages = tuple(p.data_ptr() for p in self.model.parameters())
        if storages != self._storages:
            self._shards, self._storages = _shards(self.model), storages
        return self._shards


def _window(t) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """``(slices of the global tensor, local shape with the prepended axes)`` of a shard."""
    local = (1,) * t.prepend_axis_num + tuple(t.data.shape)
    return tuple(slice(o, o + n) for o, n in zip(t.global_offset, local)), local


def _gathered_pieces(shards: list, dtype: torch.dtype | None) -> list[list] | None:
    """Every rank's main-replica pieces ``(key, global shape, window, local shape, data)`` on
    rank 0 of the default group (None elsewhere). On one rank the data are the shards
    themselves (cast only when ``dtype`` asks), so the caller's copy is the only one."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    sharded = dist.is_initialized() and dist.get_world_size() > 1
    pieces = []
    for t in shards:
        if is_main_replica(t.replica_id):
            data = t.data.detach()
            if sharded or (dtype is not None and data.dtype != dtype):
                data = data.to("cpu", dtype or data.dtype, copy=True)
            pieces.append((t.key, tuple(t.global_shape), *_window(t), data))
    if not sharded:
        return [pieces]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    return gathered if dist.get_rank() == 0 else None


def gather_full_state(gpt_model, dtype: torch.dtype | None = torch.float32
                      ) -> dict[str, torch.Tensor] | None:
    """Every tensor of ``gpt_model`` assembled whole on rank 0 of the default group (None on the
    other ranks), keyed by its sharded key, on the CPU in ``dtype`` (None: as held)."""
    flat = gather_flat_state(_shards(gpt_model), dtype)
    return None if flat is None else flat.tensors()


@torch.no_grad()
def gather_flat_state(shards: list, dtype: torch.dtype | None = None) -> FlatWeights | None:
    """:func:`gather_full_state` of a model's ``shards`` (:func:`_shards` or a
    :class:`ShardIndex`'s) as flat per-dtype buffers on the CPU: each piece is copied once, into
    its window of its tensor's buffer."""
    gathered = _gathered_pieces(shards, dtype)
    if gathered is None:
        return None
    layout = {}
    for key, shape, _, _, data in (p for rank in gathered for p in rank):
        layout[key] = (key, shape, str(data.dtype).removeprefix("torch."))
    flat = FlatWeights.empty([layout[key] for key in sorted(layout)])
    whole = flat.tensors()
    for key, _, window, local, data in (p for rank in gathered for p in rank):
        whole[key][window] = data.reshape(local)
    return flat


@torch.no_grad()
def load_full_state(shards: list, full: dict[str, torch.Tensor]) -> None:
    """Copy each of a model's ``shards`` (:func:`_shards` or a :class:`ShardIndex`'s) out of
    ``full`` (whole tensors by key, as :func:`gather_full_state` or
    :meth:`FlatWeights.tensors` give them, from any layout). Raises ``KeyError`` naming a
    tensor ``full`` lacks."""
    for t in shards:
        if t.key not in full:
            raise KeyError(f"the weights sent hold no {t.key!r}")
        window, local = _window(t)
        t.data.copy_(full[t.key][window].reshape(t.data.shape))
