"""The fast decoder's one adapter to Megatron's dynamic context: its tables, blocks and buffer.

The multi-step rounds (:mod:`.rounds`) run ``K`` steps outside Megatron's engine and then write
its tables as if its own steps had run; that relies on Megatron's layout: the paged buffer
``[2, L, blocks, block_size, heads, head_dim]``, one block table row per request, the dummy
block (the last, ``dummy_block_idx``) that no request owns, blocks owned by one request each (no
prefix sharing). :class:`MegatronKV` is the only place that reads or writes them for a round
(the plan's read, the blocks reserved, the tokens and ends committed), and it checks that
layout when built (:func:`layout_problems`): a Megatron release that changed it makes the engine
decode through Megatron's own forward with one WARNING, instead of writing a corrupt cache.
"""

from __future__ import annotations

import torch

TABLES = ("request_to_kv_block_ids", "request_kv_length_offsets", "request_kv_block_counts",
          "request_last_kv_block_id", "request_last_kv_block_offset", "request_output_lengths",
          "request_query_lengths", "request_ids", "token_to_input_ids", "request_metadata")
"""The context's tables a round reads or writes."""


def layout_problems(context) -> list[str]:
    """What differs in ``context`` from the layout the rounds write (empty: none)."""
    problems = [f"no context.{name}" for name in TABLES if not hasattr(context, name)]
    alloc = getattr(context, "block_allocator", None)
    for name in ("allocate_memory_blocks", "release_memory_blocks", "is_memory_available",
                 "dummy_block_idx", "total_count"):
        if not hasattr(alloc, name):
            problems.append(f"no block_allocator.{name}")
    if problems:
        return problems
    if alloc.dummy_block_idx != alloc.total_count - 1:
        problems.append(f"dummy_block_idx {alloc.dummy_block_idx} is not the last block "
                        f"({alloc.total_count - 1})")
    if getattr(context, "cache_mla_latent", False):
        problems.append("an MLA latent cache (not [2, L, blocks, block, heads, dim])")
    if any(getattr(context, flag, False) for flag in ("enable_prefix_caching",
                                                      "prefix_caching")):
        problems.append("prefix caching (blocks shared between requests)")
    if "termination_id" not in getattr(context, "request_metadata", {}):
        problems.append("no request_metadata['termination_id']")
    buffer = getattr(context, "memory_buffer", None)
    if buffer is not None:
        want = (2, None, alloc.total_count, context.block_size_tokens)
        if buffer.dim() != 6 or any(w is not None and w != got
                                    for w, got in zip(want, buffer.shape)):
            problems.append(f"memory_buffer of shape {tuple(buffer.shape)}, not [2, L, "
                            f"{alloc.total_count}, {context.block_size_tokens}, heads, dim]")
    return problems


class LayoutError(RuntimeError):
    """Megatron's context is not laid out as the rounds write it (:func:`layout_problems`)."""


class MegatronKV:
    """Read a round's plan, reserve its blocks, commit its tokens and ends, on ``context``
    (Megatron's ``DynamicInferenceContext``). Raises :class:`LayoutError` when built on a
    context of another layout."""

    def __init__(self, context):
        problems = layout_problems(context)
        if problems:
            raise LayoutError("; ".join(problems))
        self.context = context

    @property
    def block_size(self) -> int:
        return int(self.context.block_size_tokens)

    @property
    def scratch_slot(self) -> int:
        """The first flat slot of the dummy block: no request's (masked keys read it)."""
        return int(self.context.block_allocator.dummy_block_idx) * self.block_size

    def running(self) -> tuple[int, int]:
        """``(first, n)``: the rows of the running (not paused) requests."""
        ctx = self.context
        return ctx.paused_request_count, ctx.total_request_count - ctx.paused_request_count

    def read_plan(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """One host read: per running request its cached tokens, blocks held, tokens it may
        still write (Megatron's length rule: it ends when ``kv + 1`` reaches its limit) and id."""
        ctx = self.context
        first, n = self.running()
        rows = slice(first, first + n)
        kv_off = ctx.request_kv_length_offsets[rows]
        pos0, counts, room, ids = torch.stack((
            kv_off, ctx.request_kv_block_counts[rows],
            ctx.request_output_lengths[rows] - kv_off - 1, ctx.request_ids[rows])).tolist()
        return pos0, counts, room, ids

    def blocks_needed(self, pos0: list[int], counts: list[int], steps: int) -> list[int]:
        """Per request, the blocks it lacks for ``steps`` more tokens from position ``pos0``."""
        bs = self.block_size
        return [max(0, (p + steps - 1) // bs + 1 - c) for p, c in zip(pos0, counts)]

    def has_blocks(self, count: int) -> bool:
        return bool(self.context.block_allocator.is_memory_available(count))

    def reserve(self, first: int, counts: list[int], need: list[int]) -> None:
        """Take ``sum(need)`` blocks from Megatron's allocator into the block table: request
        ``first + r``'s ``need[r]`` new blocks after its ``counts[r]``."""
        total = sum(need)
        if not total:
            return
        ctx = self.context
        table, device = ctx.request_to_kv_block_ids, ctx.request_ids.device
        blocks = ctx.block_allocator.allocate_memory_blocks(total)
        rows = torch.tensor([r for r, k in enumerate(need) for _ in range(k)],
                            device=device) + first
        cols = torch.tensor([c + j for c, k in zip(counts, need) for j in range(k)],
                            device=device)
        table[rows, cols] = blocks.to(table.dtype)

    def commit(self, first: int, pos0: list[int], counts: list[int], need: list[int],
               last_step: int, active: torch.Tensor, last_tokens: torch.Tensor):
        """Megatron's tables as after its own step ``last_step`` of the round (each request's
        newest token at ``pos0 + last_step``, its blocks up to the one holding it; the rest of
        the round's blocks back to the allocator), then its ``update_requests(active,
        last_tokens)`` (finished requests leave, their blocks freed). Returns its result."""
        ctx, bs, n = self.context, self.block_size, len(pos0)
        table, device = ctx.request_to_kv_block_ids, ctx.request_ids.device
        keep = [(p + last_step) // bs + 1 for p in pos0]
        extra = [(first + r, c) for r in range(n) for c in range(keep[r], counts[r] + need[r])]
        if extra:
            rows = torch.tensor([r for r, _ in extra], device=device)
            cols = torch.tensor([c for _, c in extra], device=device)
            ctx.block_allocator.release_memory_blocks(table[rows, cols].clone())
            table[rows, cols] = -1
        rows = slice(first, first + n)
        keep_t = torch.tensor(keep, device=device)
        last_pos = torch.tensor([p + last_step for p in pos0], device=device)
        ctx.request_kv_length_offsets[rows] = last_pos
        ctx.request_kv_block_counts[rows] = keep_t
        ctx.request_last_kv_block_id[rows] = table[rows].gather(
            1, (keep_t - 1).long().unsqueeze(1)).squeeze(1)
        ctx.request_last_kv_block_offset[rows] = last_pos % bs
        return ctx.update_requests(active.byte(), last_tokens)
