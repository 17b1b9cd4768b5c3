"""``tools/gpu_check``'s ``decode_probe`` stage (:mod:`tools.bench.decode_probe`) on CPU: the
tiny model through the multi-step rounds, three RL steps with an in-place weight update between
them; every field it reports is there (the CUDA-only ones None), the SDPA backend is named, and
the graph path's greedy tokens equal the eager step's (on CPU both run eagerly)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_rollout import EOS, PAD, VOCAB, make_prompts, setup  # noqa: F401

pytestmark = pytest.mark.slow  # builds Megatron models


def test_decode_probe_reports_every_field_on_cpu(setup):  # noqa: F811
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig
    from tools.bench.decode_probe import RL_STEPS, probe

    policy, groups = setup

    def make_engine(graphs):
        return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                             config=RolloutConfig(max_new_tokens=8, max_batch_size=8, top_k=1,
                                                  decode_cuda_graphs=graphs))
    saved = [p.detach().clone() for p in policy.unwrapped().parameters()]

    @torch.no_grad()
    def update():
        for p in policy.unwrapped().parameters():
            p.mul_(0.999)
    try:
        out = probe(make_engine, make_prompts(8, seed=1), update)
    finally:
        with torch.no_grad():  # (the model is the module's fixture)
            for p, s in zip(policy.unwrapped().parameters(), saved):
                p.copy_(s)
    assert out["graph_tokens_equal"] is True
    assert out["weights_read_ms"] > 0 and out["attention_backend"]
    for key in ("eager", "graphs"):
        rec = out[key]
        assert rec["decode_path"] == "rounds" and rec["replicated"] is False
        assert len(rec["ms_per_step"]) == RL_STEPS and min(rec["ms_per_step"]) > 0
        assert rec["reserved_after_call"] == [None] * RL_STEPS  # (CUDA only)
        assert rec["sync_warnings_per_round"] is None
        assert rec["rollout/decode_graphs"] == 0.0  # no graphs on CPU
