"""Rotary position embeddings as Megatron's unfused path computes them, for the local kernels and
both rollout engines: one rotation (:func:`rotate`), one table formula (:func:`cos_sin`) and one
cache (:class:`RotaryCache`) that each user owns.

Megatron's ``_apply_rotary_pos_emb_bshd`` computes ``(cos(freqs) * mscale).to(dtype)`` and the
sine for every call, queries and keys apart (4 pairs per layer and forward). The same pair serves
every layer of a forward step, so each owner keeps it once for as long as its positions hold:

* the training attention (:class:`~.local.RopeOnceSelfAttention`): one cache per module, keyed by
  Megatron's rotary table (``RotaryEmbedding.forward`` is ``lru_cache``d: the same tensor for a
  sequence length), a few entries;
* the static engine's context: the window and left padding of the current forward step;
* the dynamic engine's context: the step's tokens' positions, cleared at every step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple

import torch


class RotaryPair(NamedTuple):
    """``cos``/``sin`` ``[..., rot_dim]`` in the activations' dtype, scaled by YaRN's ``mscale``;
    ``sin`` with its first half negated (``[-sin_1, sin_2]``: :func:`rotate` multiplies it by
    ``t`` rolled by half instead of by ``rotate_half(t) = [-t_2, t_1]``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rot_dim: int


def cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> RotaryPair:
    """The pair of the angles ``freqs [..., rot_dim]``, as Megatron's unfused RoPE computes them
    (the sine's first half negated: :class:`RotaryPair`)."""
    sin = (torch.sin(freqs) * mscale).to(dtype)
    half = freqs.shape[-1] // 2
    return RotaryPair((torch.cos(freqs) * mscale).to(dtype),
                      torch.cat((-sin[..., :half], sin[..., half:]), dim=-1), freqs.shape[-1])


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """Megatron's (non-interleaved) RoPE, ``t * cos + rotate_half(t) * sin`` on the first
    ``rot_dim`` channels of ``t [..., heads, hn]``, with a precomputed pair (:func:`cos_sin`):
    ``rotate_half(t) * sin = [-t_2 sin_1, t_1 sin_2] = roll(t, half) * [-sin_1, sin_2]``, bitwise
    (a product's sign is exact), one roll instead of a chunk, a negation and a concatenation."""
    if rot_dim == t.shape[-1]:
        return t * cos + t.roll(rot_dim // 2, -1) * sin
    head, tail = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((head * cos + head.roll(rot_dim // 2, -1) * sin, tail), dim=-1)


class RotaryCache:
    """:class:`RotaryPair` by key, made once: ``get(key, angles, mscale, dtype)`` calls
    ``angles()`` (the ``freqs`` tensor) only on a miss. ``max_entries`` bounds it (least recently
    used goes first); ``pin``: objects an entry's validity depends on, compared by identity (the
    table tensor a key was made from: an id can be reused once a tensor is freed). A pair made
    under ``torch.inference_mode`` is made again outside it (inference tensors cannot be saved
    for backward)."""

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[tuple, RotaryPair]] = OrderedDict()

    def get(self, key: Hashable, angles: Callable[[], torch.Tensor], mscale: float,
            dtype: torch.dtype, pin: tuple = ()) -> RotaryPair:
        hit = self._entries.get(key)
        if (hit is None or any(a is not b for a, b in zip(hit[0], pin, strict=True))
                or (hit[1].cos.is_inference() and not torch.is_inference_mode_enabled())):
            hit = (pin, cos_sin(angles(), mscale, dtype))
            self._entries[key] = hit
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return hit[1]

    def clear(self) -> None:
        self._entries.clear()
