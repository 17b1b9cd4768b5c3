"""Who this rank is and what it reduces over, in plain torch (no framework import).

:class:`ParallelGroups` is filled once by the backend (Megatron's parallel state); the trainer, the
algorithms and the routing statistics read ranks and process groups from it and never from a
framework's globals. :func:`all_reduce_` is the one host-tensor all-reduce: NCCL reduces device
tensors only, so it round-trips through :func:`compute_device` (a no-op copy on CPU/gloo).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelGroups:
    """The process groups and ranks a training step needs."""

    world_size: int
    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    """Data-parallel group *without* CP: ranks holding different sequences."""
    dp_cp_group: dist.ProcessGroup
    """Data x context parallel: where gradients are averaged."""
    pp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def compute_device() -> torch.device:
    """The device this rank computes on: its CUDA device if present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_group_size(group=None) -> int:
    """Ranks in ``group`` (the world for None); 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (the world for None) and return it.

    Works for host tensors under NCCL: the reduction runs on :func:`compute_device` and the result
    is copied back. A no-op for a single rank."""
    if process_group_size(group) > 1:
        buf = tensor.to(compute_device())
        dist.all_reduce(buf, op=op, group=group)
        if buf is not tensor:
            tensor.copy_(buf)
    return tensor


def all_gather_(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape everywhere) over ``group``, in rank order, on the
    tensor's device (gathered on :func:`compute_device`: NCCL needs device tensors). No
    gradient. ``[tensor]`` for a single rank."""
    size = process_group_size(group)
    if size == 1:
        return [tensor]
    buf = tensor.to(compute_device()).contiguous()
    parts = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(parts, buf, group=group)
    return [p.to(tensor.device) for p in parts]


def any_rank(flag: bool, group=None) -> bool:
    """True if ``flag`` is true on any rank of ``group`` (one MAX all-reduce), so all decide alike."""
    return bool(all_reduce_(torch.tensor([1.0 if flag else 0.0]), group, dist.ReduceOp.MAX).item())


def gather_on_logging_rank(metrics: dict, groups: ParallelGroups) -> dict:
    """Merge metric dicts from all ranks (the last pipeline stage holds the loss metrics); the
    first rank that reports a key wins."""
    if groups.world_size == 1:
        return metrics
    gathered: list = [None] * groups.world_size
    dist.all_gather_object(gathered, metrics)
    merged: dict = {}
    for d in gathered:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def exchange_objects(outgoing: list[list[Any]], group=None) -> list[list[Any]]:
    """Point-to-point exchange of picklable objects over ``group``: ``outgoing[d]`` goes to rank
    ``d``; returns ``received[s]``, what rank ``s`` sent here, in its order. Each rank receives only
    what is addressed to it (one ``all_to_all`` of byte counts, one of the pickled bytes, on
    :func:`compute_device`); what a rank keeps for itself is not copied."""
    size = process_group_size(group)
    if size == 1:
        return [list(outgoing[0])]
    me = dist.get_rank(group)
    payloads = [b"" if d == me else pickle.dumps(objs) for d, objs in enumerate(outgoing)]
    device = compute_device()
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    recv_counts = recv_sizes.tolist()
    send = torch.frombuffer(bytearray(b"".join(payloads)) or bytearray(1), dtype=torch.uint8)
    recv = torch.empty(max(sum(recv_counts), 1), dtype=torch.uint8, device=device)
    send_counts = [len(p) for p in payloads]
    dist.all_to_all_single(recv[:sum(recv_counts)], send[:sum(send_counts)].to(device),
                           output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    data, received, start = recv.cpu().numpy().tobytes(), [], 0
    for s, count in enumerate(recv_counts):
        received.append(list(outgoing[me]) if s == me else pickle.loads(data[start:start + count]))
        start += count
    return received
