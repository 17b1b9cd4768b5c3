"""Batched admission into the dynamic engine (:mod:`gspo_megatron.backends.megatron.engine.admission`):
the context a batch leaves, and the queue, are what Megatron's one-at-a-time non-chunked scheduling
(``check_availability`` then ``add_request`` per request, stopping at the first that does not fit)
leaves, tensor for tensor (block ids included), when the queue fits whole, when the request limit
cuts it, and when the token budget stops it before a prompt."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_rollout import EOS, PAD, VOCAB, setup  # noqa: F401  (the module fixture)

pytestmark = pytest.mark.slow  # builds Megatron models

REQUEST_TENSORS = ("request_ids", "request_query_lengths", "request_output_lengths",
                   "request_kv_length_offsets", "request_kv_block_counts",
                   "request_last_kv_block_id", "request_last_kv_block_offset",
                   "request_to_kv_block_ids")
TOKEN_TENSORS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                 "token_to_block_idx", "token_to_position_in_request",
                 "token_to_local_position_within_kv_block")


def dynamic(setup, max_tokens=None):  # noqa: F811
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    policy, groups = setup
    eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                        config=RolloutConfig(max_new_tokens=4, max_batch_size=12,
                                             temperature=0.7, top_p=0.9),
                        max_sequence_length=600)
    eng.dynamic.resume()
    if max_tokens is not None:  # a smaller token budget than the buffers (which stay as sized)
        eng.dynamic.context.max_tokens = max_tokens
    return eng


def queue(eng, lengths, seed, megatrons=False):
    """A deque of requests of ``lengths`` random tokens (several longer than a 256-token block),
    as ``DynamicRollout.generate`` queues them (``megatrons``: as Megatron's engine does, each a
    ``DynamicInferenceRequest`` with its own copy of the sampling parameters)."""
    import collections
    import copy

    from megatron.core.inference.inference_request import DynamicInferenceRequest

    from gspo_megatron.backends.megatron.engine.admission import RolloutRequest

    sp = eng._sampling()[0]
    sp.num_tokens_to_generate = 4
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    if megatrons:
        return collections.deque(
            DynamicInferenceRequest(request_id=100 + i, sampling_params=copy.deepcopy(sp),
                                    prompt_tokens=p) for i, p in enumerate(prompts))
    return collections.deque(RolloutRequest(100 + i, sp, p.tolist()) for i, p in enumerate(prompts))


def megatron_admits(ctx, waiting) -> None:
    """megatron-core 0.16.1's ``schedule_non_chunked_prefill``, on the context alone."""
    while waiting:
        if not all(ctx.check_availability(waiting[0])):
            break
        ctx.add_request(waiting.popleft())


def state(ctx, waiting) -> dict:
    """What the scheduler wrote: the live rows of every bookkeeping tensor, the counters, the
    free-block bag and the queue."""
    r, t = ctx.total_request_count, ctx.active_token_count
    out = {name: getattr(ctx, name)[:r].clone() for name in REQUEST_TENSORS}
    out.update({name: getattr(ctx, name)[:t].clone() for name in TOKEN_TENSORS})
    out.update({f"meta/{k}": v[:r].clone() for k, v in ctx.request_metadata.items()})
    out["bag"] = ctx.block_allocator.block_bag.clone()
    out["counts"] = (r, t, ctx.num_prefill_requests, ctx.block_allocator.total_avail)
    out["queue"] = [(req.request_id, len(req.remaining_prompt_tokens)) for req in waiting]
    return out


@pytest.mark.parametrize("lengths, max_tokens, waits", [
    ([5, 300, 17, 1, 260, 40], None, 0),  # all fit: one batch
    ([3] * 15, None, 3),  # 12 request slots: the last 3 wait
    ([30, 270, 9, 400, 12], 350, 2),  # the budget ends inside the 400-token prompt: it waits
])
def test_a_batch_leaves_what_one_by_one_admission_leaves(setup, lengths, max_tokens,  # noqa: F811
                                                         waits):
    from gspo_megatron.backends.megatron.engine.admission import admit_waiting

    ours, megatrons = dynamic(setup, max_tokens), dynamic(setup, max_tokens)
    mine = queue(ours, lengths, seed=len(lengths))
    theirs = queue(megatrons, lengths, seed=len(lengths), megatrons=True)
    admitted = admit_waiting(ours.dynamic.context, mine)
    megatron_admits(megatrons.dynamic.context, theirs)
    a, b = state(ours.dynamic.context, mine), state(megatrons.dynamic.context, theirs)
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
    assert a["counts"][0] == len(admitted) > 0
    assert len(a["queue"]) == waits
    for eng in (ours, megatrons):
        eng.dynamic.context.reset()
        eng.dynamic.suspend()
