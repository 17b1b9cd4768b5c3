"""Paged KV-cache arithmetic of the rollout engine (pure Python; the config checks, the planner and
the engine all size the cache with it).

The dynamic engine stores keys and values in blocks of :data:`BLOCK_SIZE_TOKENS` tokens; a request
holds ``ceil(tokens / block)`` blocks, and Megatron keeps one dummy block aside.
"""

from __future__ import annotations

import math

BLOCK_SIZE_TOKENS = 256
"""Tokens per paged-KV block (Megatron's default; flash-attn's paged kernels take 64 or 256)."""


KV_FP8_SCALE_BYTES = 4
"""``rollout.kv_cache_dtype: fp8``: the float32 scale each token and key/value head stores
beside its ``kv_channels`` one-byte codes (:mod:`gspo_megatron.rollouts.kv_fp8`)."""


def kv_element_bytes(kv_cache_dtype: str, compute_bytes: int) -> tuple[int, int]:
    """``(bytes per element, scale bytes per token and head)`` of a KV cache of
    ``rollout.kv_cache_dtype`` (``auto``: the rollout's compute dtype, ``compute_bytes``)."""
    return (1, KV_FP8_SCALE_BYTES) if kv_cache_dtype == "fp8" else (int(compute_bytes), 0)


def kv_bytes_per_token(num_layers: int, num_query_groups: int, kv_channels: int,
                       tp_size: int = 1, pp_size: int = 1, dtype_bytes: int = 4,
                       scale_bytes: int = 0) -> int:
    """Bytes of KV cache one token holds on one rank: keys and values of this pipeline stage's
    layers, this TP rank's KV heads, ``kv_channels`` elements of ``dtype_bytes`` each plus
    ``scale_bytes`` per head (:func:`kv_element_bytes`)."""
    heads = max(num_query_groups // tp_size, 1)
    return 2 * (num_layers // pp_size) * heads * (kv_channels * dtype_bytes + scale_bytes)


def blocks_per_request(tokens: int, block_size: int = BLOCK_SIZE_TOKENS) -> int:
    """KV blocks a request of ``tokens`` tokens (prompt + response) holds."""
    return math.ceil(tokens / block_size)


def kv_budget_bytes(requests: int, tokens: int, bytes_per_token: int,
                    block_size: int = BLOCK_SIZE_TOKENS) -> int:
    """Paged KV bytes for ``requests`` requests of ``tokens`` tokens each, plus the dummy block."""
    return (requests * blocks_per_request(tokens, block_size) + 1) * block_size * bytes_per_token
