"""The fast decoder's adapter to Megatron's context checks the layout it writes when built.

Megatron's own context passes; a dummy block that is not the last, a buffer of another shape,
prefix caching or a missing table are named; an engine whose context fails the check decodes
through Megatron's forward, with one WARNING, and gives the same tokens.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.unit.test_rollout import EOS, PAD, VOCAB, make_prompts, setup  # noqa: F401

pytestmark = pytest.mark.slow  # builds Megatron models


def _engine(setup, **cfg):  # noqa: F811
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    policy, groups = setup
    return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                         config=RolloutConfig(max_new_tokens=8, max_batch_size=8, top_k=1,
                                              **cfg))


def test_layout_check_names_what_differs(setup, monkeypatch, caplog):  # noqa: F811
    from gspo_megatron.backends.megatron.engine import megatron_kv

    eng = _engine(setup)
    ctx = eng.dynamic.context
    eng.dynamic.resume()
    assert megatron_kv.layout_problems(ctx) == []
    alloc = ctx.block_allocator
    with monkeypatch.context() as m:
        m.setattr(alloc, "dummy_block_idx", 0)
        m.setattr(ctx, "enable_prefix_caching", True, raising=False)
        m.setattr(ctx, "memory_buffer", torch.empty(2, 3, 4))
        problems = megatron_kv.layout_problems(ctx)
    assert len(problems) == 3 and "dummy_block_idx 0" in problems[0], problems
    assert "prefix caching" in problems[1] and "memory_buffer of shape" in problems[2]
    with monkeypatch.context() as m:
        m.delattr(ctx, "request_last_kv_block_offset")
        with pytest.raises(megatron_kv.LayoutError, match="request_last_kv_block_offset"):
            megatron_kv.MegatronKV(ctx)
    eng.dynamic.suspend()
    # an engine on a context of another layout: Megatron's forward, one WARNING, same tokens
    prompts = make_prompts(6, seed=2)
    want = [s.response_ids for s in eng.generate(prompts, seed=0)]
    monkeypatch.setattr(megatron_kv, "layout_problems", lambda ctx: ["a test's layout"])
    with caplog.at_level(logging.WARNING):
        other = _engine(setup)
    assert other.dynamic.fast is None
    assert sum("a test's layout" in r.getMessage() for r in caplog.records) == 1
    assert [s.response_ids for s in other.generate(prompts, seed=0)] == want
