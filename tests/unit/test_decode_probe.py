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
        out = probe(make_engine, make_prompts(8, seed=1), update,
                    list(policy.unwrapped().parameters()))
        assert all(torch.equal(p, s) for p, s in zip(policy.unwrapped().parameters(), saved))
    finally:
        with torch.no_grad():  # (the model is the module's fixture)
            for p, s in zip(policy.unwrapped().parameters(), saved):
                p.copy_(s)
    assert out["graph_tokens_equal"] is True and out["graph_requests_differ"] == 0
    assert out["graph_logprob_max_abs_diff_before_first_differ"] == 0.0  # same step on CPU
    assert out["weights_read_ms"] > 0
    assert out["attention_backend"] in ("math", "flash_attention")  # a kernel's name (CPU)
    for key in ("eager", "graphs"):
        rec = out[key]
        assert rec["decode_path"] == "rounds" and rec["replicated"] is False
        assert len(rec["ms_per_step"]) == RL_STEPS and min(rec["ms_per_step"]) > 0
        assert rec["reserved_after_call"] == [None] * RL_STEPS  # (CUDA only)
        assert rec["sync_warnings_per_round"] is None
        assert rec["rollout/decode_graphs"] == 0.0  # no graphs on CPU


def test_greedy_comparison_reads_log_probs_before_the_first_difference():
    """Two continuations that part at a flipped argmax are different sequences: the log-probs
    are compared up to each request's first different token, and the requests counted."""
    from types import SimpleNamespace as S

    from tools.bench.decode_probe import compare_greedy

    eager = [S(response_ids=[1, 2, 3], response_logprobs=[-0.5, -1.0, -2.0]),
             S(response_ids=[4, 5], response_logprobs=[-0.1, -0.2])]
    graphs = [S(response_ids=[1, 9, 9], response_logprobs=[-0.5 + 1e-3, -7.0, -7.0]),
              S(response_ids=[4, 5], response_logprobs=[-0.1, -0.2 - 2e-4])]
    out = compare_greedy(eager, graphs)
    assert out["tokens_equal"] is False and out["requests_differ"] == 1
    assert out["requests"] == 2
    assert out["logprob_max_abs_diff_before_first_differ"] == pytest.approx(1e-3)
