"""FP8 (e4m3) keys and values for the rollout engine's paged KV cache
(``rollout.kv_cache_dtype: fp8``), pure torch.

**Scales: one per token and key/value head.** Each head's vector ``x [D]`` (a key after QK-norm
and RoPE, or a value) is stored as

    scale = amax(|x|) / 448          (448: the largest finite e4m3 value; 1 for an all-zero x)
    q     = e4m3(x / scale)          (round to nearest even)

and read back as ``q * scale``. Why this granularity and not vLLM's one scale per layer and
tensor (``k_scale`` / ``v_scale``): a per-tensor scale must be calibrated ahead (vLLM uses 1.0
when the checkpoint has none) and is fixed while the activations are not; keys have outlier
channels and tokens whose magnitude varies by 10-100x along a sequence, so a static scale
either saturates the large ones or pushes the small ones into e4m3's subnormals. A scale per
token and head needs no calibration, never saturates, and leaves only e4m3's rounding (3
mantissa bits: at most 1/16 of a value, ~2.5 % RMS relative); it is computed from the vector
being written (one ``amax`` per head), so it costs no extra pass. Its storage is 4 bytes per
``D`` bytes (3 % at ``D = 128``).

**Layout: the scale lives in its row.** The cache is one ``uint8`` tensor of Megatron's paged
layout ``[2, L, blocks, block_size, heads, D + 4]``: per token and head, the ``D`` e4m3 codes,
then the float32 scale's 4 bytes (:func:`pack`). So every copy of the buffer carries the
scales with their values (the held requests a checkpoint keeps, the zeroed dummy block, a
decoding round's zeroed slots), and an all-zero row reads as zeros (code 0, scale 0), finite
as masked slots must be. The engine builds Megatron's context with ``kv_channels = D + 4`` and
``uint8`` (1 byte per element), so Megatron's block count is exact;
:func:`~gspo_megatron.kv_budget.kv_bytes_per_token` counts the same bytes.

Only the multi-step decoding step (:mod:`gspo_megatron.backends.megatron.kernels.decode`)
writes and reads this layout (prefills through it too); the configurations that would reach
Megatron's own attention are refused (``config/validation.py``, and the engine at build).
"""

from __future__ import annotations

import torch

from gspo_megatron.rollouts.fp8 import E4M3, E4M3_MAX

SCALE_BYTES = 4
"""Bytes of each token and head's scale (float32), after its ``D`` codes."""

STORAGE = torch.uint8
"""The packed cache's dtype (byte-wise: torch has no ``index_fill_`` for float8 on CPU)."""


def packed_width(head_dim: int) -> int:
    """Bytes per token and head in the packed cache: ``D`` codes and the scale."""
    return int(head_dim) + SCALE_BYTES


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., D] e4m3, scale [..., 1] float32)`` of ``x [..., D]``, one scale per vector
    (the division in float32; float64 for a float64 input)."""
    work = x.double() if x.dtype == torch.float64 else x.float()
    amax = work.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (work / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., D]`` in ``dtype``: ``q * scale`` (the product in float32, float64 for a float64
    ``dtype``, then cast)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * scale.to(work)).to(dtype)


def pack(x: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., D + 4]``: :func:`quantize`'s codes of ``x [..., D]``, then the scale's
    bytes: the rows :func:`unpack` reads."""
    q, scale = quantize(x)
    return torch.cat((q.view(STORAGE), scale.view(STORAGE)), dim=-1)


def unpack(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., D]`` in ``dtype``: the values of packed ``rows [..., D + 4]`` (:func:`pack`)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return dequantize(rows[..., :d].view(E4M3), scale, dtype)


def error_sums(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[2]`` float32 on ``x``'s device: ``(||x - unpack(rows)||^2, ||x||^2)`` (summed over
    steps and layers, then divided: ``rollout/kv_fp8_rel_err``); no host read."""
    x32 = x.float()
    return torch.stack(((x32 - unpack(rows, torch.float32)).square().sum(), x32.square().sum()))


def write(cache: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          errors: list | None = None) -> None:
    """Keys and values ``[T, heads, D]`` into ``cache [2, L, blocks, block_size, heads, W]``'s
    ``layer`` at the flat slots ``slots [T]`` (``block * block_size + offset``): packed rows
    (:func:`pack`) in the FP8 layout (a ``uint8`` cache, ``W = D + 4``), with their
    :func:`error_sums` appended to ``errors`` (None: not measured); as they are otherwise."""
    width = cache.shape[-1]
    for t, x in enumerate((k, v)):
        if cache.dtype == STORAGE:
            rows = pack(x)
            if errors is not None:
                errors.append(error_sums(x, rows))
            x = rows
        cache[t, layer].view(-1, x.shape[1], width).index_copy_(0, slots, x)


def read(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from ``cache`` as values ``[..., D]`` in ``dtype``: FP8 rows
    ``[..., D + 4]`` dequantized (:func:`unpack`); the rows themselves otherwise."""
    return unpack(rows, dtype) if cache.dtype == STORAGE else rows
