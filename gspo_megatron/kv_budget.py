"""Paged KV-cache arithmetic of the rollout engine (pure Python; the config checks, the planner and
the engine all size the cache with it).

The dynamic engine stores keys and values in blocks of :data:`BLOCK_SIZE_TOKENS` tokens; a request
holds ``ceil(tokens / block)`` blocks, and Megatron keeps one dummy block aside.
"""

from __future__ import annotations

import math

BLOCK_SIZE_TOKENS = 256
"""Tokens per paged-KV block (Megatron's default; flash-attn's paged kernels take 64 or 256)."""


def kv_bytes_per_token(num_layers: int, num_query_groups: int, kv_channels: int,
                       tp_size: int = 1, pp_size: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache one token holds on one rank: keys and values of this pipeline stage's
    layers, this TP rank's KV heads."""
    heads = max(num_query_groups // tp_size, 1)
    return 2 * (num_layers // pp_size) * heads * kv_channels * dtype_bytes


def blocks_per_request(tokens: int, block_size: int = BLOCK_SIZE_TOKENS) -> int:
    """KV blocks a request of ``tokens`` tokens (prompt + response) holds."""
    return math.ceil(tokens / block_size)


def kv_budget_bytes(requests: int, tokens: int, bytes_per_token: int,
                    block_size: int = BLOCK_SIZE_TOKENS) -> int:
    """Paged KV bytes for ``requests`` requests of ``tokens`` tokens each, plus the dummy block."""
    return (requests * blocks_per_request(tokens, block_size) + 1) * block_size * bytes_per_token
