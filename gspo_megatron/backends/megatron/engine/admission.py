"""Admitting many requests at once into Megatron-Core's dynamic engine (host time, CPU and GPU).

megatron-core 0.16.1 admits a waiting request one at a time: a deep copy of its sampling
parameters and prompt when the request is built, then, when it is scheduled, a capacity check,
about twenty small tensor writes (``DynamicInferenceContext.add_request``) and an asyncio task.
That is ~0.18 ms of host time per request: 23 ms of an 83 ms rollout of 128 short requests on CPU
(TRL's workload), and the same Python on a GPU's host, where it is not hidden behind the forward.

Here (:func:`admit_waiting`, :class:`AdmittingContext`) the waiting requests that fit whole are
admitted together, with one block allocation and one write per context tensor, and
:class:`RolloutRequest` is a slotted record of what admission reads. A prompt that does not
fit waits for a later step (the rollout loop, :mod:`.dynamic`, has no chunked
prefill). The context after a batch holds exactly what admitting the requests one by one with
Megatron's ``add_request`` leaves, block ids included (``tests/unit/test_dynamic_admission.py``
compares every tensor).
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.inference.contexts.dynamic_context import (
    BlockOverflowError,
    DynamicInferenceContext,
    RequestOverflowError,
    TokenOverflowError,
)
from megatron.core.inference.inference_request import DynamicInferenceRequest


class RolloutRequest:
    """A request waiting for a slot: what :meth:`AdmittingContext.add_requests` reads of
    Megatron's ``DynamicInferenceRequest`` (its id, ``remaining_prompt_tokens``,
    ``sampling_params``, ``tracked_metadata``) and nothing else. Megatron's dataclass builds ~25
    fields and copies its sampling parameters per request, ~7 us each (1 ms of host work per
    rollout of 128 requests), for an object the rollout loop reads four times. The
    ``SamplingParams`` are shared, not copied: the loop keeps one per budget and never writes
    them. ``prompt_tokens``: the prompt ids, a list."""

    __slots__ = ("request_id", "sampling_params", "remaining_prompt_tokens")

    # Megatron's own rule for the per-request metadata (sampling fields, in order)
    get_metadata_types = staticmethod(DynamicInferenceRequest.get_metadata_types)
    tracked_metadata = property(DynamicInferenceRequest.tracked_metadata.fget)

    def __init__(self, request_id: int, sampling_params, prompt_tokens: list[int]):
        self.request_id, self.sampling_params = request_id, sampling_params
        self.remaining_prompt_tokens = prompt_tokens


class AdmittingContext(DynamicInferenceContext):
    """The dynamic context with :meth:`add_requests`: many whole prompts in one go."""

    def add_requests(self, requests: list) -> None:
        """``add_request(r)`` for each of ``requests`` in order, each prompt whole and none begun
        (no chunked prefill), with the state that leaves; the caller checked that they fit."""
        if not self.is_tensor_state_allocated or self.is_hybrid_model:
            raise RuntimeError("add_requests: allocated, non-hybrid contexts only")
        n, first, start = len(requests), self.total_request_count, self.active_token_count
        lengths = [len(r.remaining_prompt_tokens) for r in requests]
        if first + n > self.max_requests:
            raise RequestOverflowError(requests[-1].request_id)
        if start + sum(lengths) > self.max_tokens:
            raise TokenOverflowError(requests[-1].request_id)
        bs = self.block_size_tokens
        device = self.request_ids.device
        # [n]: blocks, tokens, slots of each request
        counts = torch.tensor([-(-length // bs) for length in lengths], device=device)
        lens = torch.tensor(lengths, device=device)
        slots = torch.arange(first, first + n, device=device)
        total = int(counts.sum())
        ids = self.block_allocator.allocate_memory_blocks(total)
        if ids is None:
            raise BlockOverflowError(requests[0].request_id)
        # One at a time, each request takes the top of the free bag, just below the previous
        # one's: request i holds ids[total - done_i - counts_i : total - done_i].
        owner = torch.repeat_interleave(torch.arange(n, device=device), counts)  # [total]
        done = torch.cumsum(counts, 0) - counts  # blocks of the requests before
        col = torch.arange(total, device=device) - done[owner]  # block index within its request
        flat = total - done[owner] - counts[owner] + col
        self.request_to_kv_block_ids[first + owner, col] = ids[flat].to(
            self.request_to_kv_block_ids.dtype)
        self.request_ids[first:first + n] = torch.tensor([r.request_id for r in requests],
                                                         device=device)
        metadata: dict[int, list] = {}  # per SamplingParams object: requests share them
        for r in requests:
            if id(r.sampling_params) not in metadata:
                metadata[id(r.sampling_params)] = r.tracked_metadata
        for label, values in zip((t[0] for t in self.request_metadata_types),
                                 zip(*(metadata[id(r.sampling_params)] for r in requests))):
            target = self.request_metadata[label]
            # sampling-parameter scalars (one tensor for all, not one per request)
            target[first:first + n] = torch.tensor(
                [v.item() if isinstance(v, torch.Tensor) else v for v in values],
                dtype=target.dtype).to(target.device)
        self.request_query_lengths[first:first + n] = lens
        self.request_output_lengths[first:first + n] = lens + torch.tensor(
            [r.sampling_params.num_tokens_to_generate for r in requests], device=device)
        self.request_kv_length_offsets[first:first + n] = 0
        self.request_kv_block_counts[first:first + n] = counts
        self.request_last_kv_block_id[first:first + n] = self.request_to_kv_block_ids[
            slots, counts - 1]
        self.request_last_kv_block_offset[first:first + n] = (lens - 1) % bs
        # [T]: every prompt token, request after request
        request_of = torch.repeat_interleave(torch.arange(n, device=device), lens)
        pos = torch.arange(int(lens.sum()), device=device) - (torch.cumsum(lens, 0) - lens)[
            request_of]
        end = start + pos.numel()
        self.token_to_pos_ids[start:end] = pos
        self.token_to_input_ids[start:end] = torch.tensor(
            list(itertools.chain.from_iterable(r.remaining_prompt_tokens for r in requests)),
            dtype=self.token_to_input_ids.dtype).to(self.token_to_input_ids.device)
        self.token_to_request_idx[start:end] = first + request_of
        self.token_to_position_in_request[start:end] = pos
        self.token_to_block_idx[start:end] = self.request_to_kv_block_ids[
            first + request_of, pos // bs]
        self.token_to_local_position_within_kv_block[start:end] = pos % bs
        self.active_token_count = end
        self.total_request_count += n
        self.num_prefill_requests += n


def admit_waiting(ctx: AdmittingContext, waiting) -> list:
    """Admit the longest prefix of ``waiting`` (a deque of :class:`RolloutRequest`, popped from
    the left) that fits whole into ``ctx`` in one :meth:`AdmittingContext.add_requests`: free
    request slots (none while requests are paused: Megatron resumes them first), the token
    budget of one step and free KV blocks. A prompt that does not fit waits for the next step
    (no chunked prefill: ``max_tokens`` >= the longest sequence, so an empty context always
    admits the head). Returns the admitted requests."""
    room = ctx.max_requests - ctx.total_request_count if ctx.paused_request_count == 0 else 0
    batch, tokens, blocks = [], ctx.active_token_count, 0
    for req in waiting:
        length = len(req.remaining_prompt_tokens)
        need = -(-length // ctx.block_size_tokens)
        if (len(batch) >= room or tokens + length > ctx.max_tokens
                or not ctx.block_allocator.is_memory_available(blocks + need)):
            break
        batch.append(req)
        tokens, blocks = tokens + length, blocks + need
    if batch:
        ctx.has_explicit_chunked_prefill_req = False
        ctx.add_requests(batch)
        for _ in batch:
            waiting.popleft()
    return batch
