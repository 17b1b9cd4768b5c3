"""Masked reductions with optional context-parallel (CP) all-reduce.

Context parallelism splits every sequence along the token dimension ``T`` across
the ranks of ``cp_group``. Quantities that are defined per *sequence* (sum of
log-ratios, number of response tokens, KL sums, ...) must therefore be summed
over the local shard and then all-reduced over ``cp_group`` before they are used
(e.g. before forming the GSPO sequence ratio ``s_i``, paper Eq. 7).

Gradient convention of :func:`all_reduce_sum` (forward: all-reduce SUM,
backward: identity)
------------------------------------------------------------------------------
Every CP rank holds a shard ``x_r`` and computes the *same* scalar loss
``L = f(S)`` from the reduced value ``S = sum_r x_r``. The true gradient of the
loss with respect to a shard is ``dL/dx_r = f'(S) * dS/dx_r = f'(S)``. On rank
``r`` autograd delivers ``f'(S)`` (computed from its own, identical copy of the
loss) to the output of the all-reduce; passing it through unchanged gives
``dL/dx_r`` exactly once. An all-reduce in the backward pass (what
``torch.distributed.nn.functional.all_reduce`` does, which is correct when each
rank has a *different* loss term) would multiply every shard gradient by the CP
size here.

Parameter gradients: each CP rank back-propagates ``f'(S) * dx_r/dtheta``; the
true gradient ``dL/dtheta = sum_r f'(S) * dx_r/dtheta`` is the **sum** over CP
ranks of the per-rank parameter gradients. Megatron all-reduces parameter
gradients over the data-parallel x context-parallel group; if that reduction
*averages* (divides by ``dp_size * cp_size``) the caller must scale the loss by
``cp_size`` (as Megatron's own GPT loss function does) so that the CP part of
the average becomes a sum. Nothing here all-reduces gradients.

All functions accept ``group=None`` (no communication), and are no-ops for a
group of size 1. Collectives are issued on every call, so every rank of the
group must call them in the same order with tensors of the same shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_sum",
    "all_reduce_no_grad",
    "group_world_size",
    "masked_sum",
    "masked_mean",
]


def group_world_size(group: Any | None) -> int:
    """Size of ``group``; 1 when ``group`` is None (no communication)."""
    if group is None:
        return 1
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "a process group was passed but torch.distributed is not initialized"
        )
    return dist.get_world_size(group=group)


class _AllReduceSumIdentityBackward(torch.autograd.Function):
    """Forward: all-reduce SUM over ``group``. Backward: identity (see module doc)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = tensor.clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad_output, None


def all_reduce_sum(tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """Autograd-aware SUM all-reduce with identity backward; returns a new tensor.

    Correct when every rank of ``group`` computes the same loss from the reduced
    value (see the module docstring). With ``group=None`` or a group of size 1 the
    input is returned unchanged.
    """
    if group_world_size(group) == 1:
        return tensor
    return _AllReduceSumIdentityBackward.apply(tensor, group)


@torch.no_grad()
def all_reduce_no_grad(
    tensor: torch.Tensor,
    group: Any | None = None,
    op: Any = None,
) -> torch.Tensor:
    """Detached all-reduce (default SUM; pass ``dist.ReduceOp.MAX`` etc.) for metrics."""
    out = tensor.detach().clone().contiguous()
    if group_world_size(group) == 1:
        return out
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out


def masked_sum(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    dim: int = -1,
    group: Any | None = None,
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true along ``dim``, summed over ``group``.

    ``values`` and ``mask`` are ``[B, T]`` (any matching shapes). Masked-out
    entries are replaced by 0 with :func:`torch.where` *before* summing, so NaN or
    ``-inf`` in padding never leaks into the result or its gradient. Returns the
    input shape with ``dim`` removed (e.g. ``[B]``); differentiable, with the
    identity-backward all-reduce of :func:`all_reduce_sum`.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"masked_sum: values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}"
        )
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    local = torch.where(mask.bool(), values, zeros).sum(dim=dim)
    return all_reduce_sum(local, group)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    dim: int = -1,
    group: Any | None = None,
    empty_value: float = 0.0,
) -> torch.Tensor:
    """Mean of ``values`` over masked entries along ``dim`` (global over ``group``).

    Slices with no masked entries (e.g. zero-length responses) get
    ``empty_value`` and zero gradient instead of NaN. Returns ``values`` shape
    with ``dim`` removed.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"masked_mean: values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}"
        )
    m = mask.bool()
    stacked = torch.stack(
        [
            torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dim=dim),
            m.to(values.dtype).sum(dim=dim),
        ],
        dim=0,
    )
    total, count = all_reduce_sum(stacked, group).unbind(0)
    mean = total / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.full_like(mean, empty_value))
