"""Batched admission into the dynamic engine (:mod:`gspo_megatron.backends.megatron.dynamic_admission`):
the context a batch leaves is the one Megatron's one-at-a-time scheduler leaves, tensor for tensor
(block ids included), when the queue fits whole, when the request limit cuts it, and when the
token budget cuts it inside a prompt (Megatron's chunked prefill takes over)."""

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
    from gspo_megatron.backends.megatron.rollout import RolloutEngine
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


def queue(eng, lengths, seed):
    """Requests of ``lengths`` random tokens (several longer than a 256-token block) in the
    engine's waiting queue, as ``DynamicRollout.generate`` adds them."""
    from gspo_megatron.backends.megatron.dynamic_admission import RolloutRequest

    sp = eng._sampling()[0]
    sp.num_tokens_to_generate = 4
    gen = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lengths):
        eng.engine._add_request(RolloutRequest(
            request_id=100 + i, sampling_params=sp,
            prompt_tokens=torch.randint(3, VOCAB, (n,), generator=gen)))


def state(ctx, eng) -> dict:
    """What the scheduler wrote: the live rows of every bookkeeping tensor, the counters, the
    free-block bag and the queue."""
    r, t = ctx.total_request_count, ctx.active_token_count
    out = {name: getattr(ctx, name)[:r].clone() for name in REQUEST_TENSORS}
    out.update({name: getattr(ctx, name)[:t].clone() for name in TOKEN_TENSORS})
    out.update({f"meta/{k}": v[:r].clone() for k, v in ctx.request_metadata.items()})
    out["bag"] = ctx.block_allocator.block_bag.clone()
    out["counts"] = (r, t, ctx.num_prefill_requests, ctx.block_allocator.total_avail,
                     ctx.chunked_prefill_request_id)
    out["queue"] = [(i, eng.get_request(i).finished_chunk_token_count,
                     eng.get_request(i).remaining_prompt_tokens.tolist())
                    for i in eng.waiting_request_ids]
    return out


@pytest.mark.parametrize("lengths, max_tokens", [
    ([5, 300, 17, 1, 260, 40], None),  # all fit: one batch
    ([3] * 15, None),  # 12 request slots: the last 3 wait
    ([30, 270, 9, 400, 12], 350),  # the budget ends inside the 400-token prompt: a chunk
])
def test_a_batch_leaves_what_one_by_one_admission_leaves(setup, lengths, max_tokens):  # noqa: F811
    from megatron.core.inference.engines import DynamicInferenceEngine

    ours, megatrons = dynamic(setup, max_tokens), dynamic(setup, max_tokens)
    for eng in (ours, megatrons):
        queue(eng, lengths, seed=len(lengths))
    ours.engine.schedule_waiting_requests()
    DynamicInferenceEngine.schedule_waiting_requests(megatrons.engine)  # one at a time
    a, b = state(ours.dynamic.context, ours.engine), state(megatrons.dynamic.context,
                                                           megatrons.engine)
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
    assert a["counts"][0] > 0
    if max_tokens is not None:
        assert a["counts"][4] >= 0 and a["queue"][0][1] > 0  # a prompt begun in chunks
    for eng in (ours, megatrons):
        eng.dynamic.engine.reset()
        eng.dynamic.suspend()
