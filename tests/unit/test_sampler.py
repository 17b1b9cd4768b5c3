"""The engine's one sampler and finish rule (:mod:`gspo_megatron.backends.megatron.engine.sampler`).

* ``multinomial`` is Megatron's ``_torch_sampling_func`` op for op: the same tokens from the
  same generator state (plain, top-k, top-p), and the log-prob of a log-softmax;
* ``gumbel`` (Gumbel-max) draws from the same distribution: a chi-square test of 40,000 draws
  against the exact (filtered) softmax, greedy tokens unchanged, the log-prob
  ``logit - logsumexp`` equal to the log-softmax's (float64 reference);
* the finish rule is Megatron's: a stop token (one or several per request) or the length limit.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.backends.megatron.engine.sampler import FinishRule, Sampler


def _megatron_draw(logits, top_k, top_p, generator):
    from megatron.core.inference.text_generation_controllers.text_generation_controller import \
        TextGenerationController

    controller = TextGenerationController.__new__(TextGenerationController)
    controller.sampling_rng = generator
    return controller._torch_sampling_func(logits, 1.0, top_k, top_p)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.0), (1, 0.0), (3, 0.0), (0, 0.8)])
def test_multinomial_is_megatrons_draw(top_k, top_p):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 2
    ref = _megatron_draw(logits.clone(), top_k, top_p, torch.Generator().manual_seed(7))
    tokens, logprobs = Sampler(top_k, top_p, torch.Generator().manual_seed(7))(logits)
    assert torch.equal(tokens, ref)
    assert torch.equal(logprobs, torch.log_softmax(logits, -1).gather(-1, ref[:, None])[:, 0])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0  # nothing drawn outside the support (the filters')
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


@pytest.mark.parametrize("top_k,top_p", [(0, 0.0), (4, 0.0), (0, 0.7)])
def test_gumbel_draws_from_the_same_distribution(top_k, top_p):
    """40,000 draws of one row of 10 logits; the chi-square statistic against the exact
    probabilities stays below the 0.1 % critical value (27.9 for 9 degrees of freedom; fewer
    with the filters: a looser bound), for Gumbel-max and for the multinomial draw alike."""
    V, N = 10, 40_000
    row = torch.randn(V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    exact = row.clone()
    if top_k:
        exact[exact < torch.topk(exact, top_k).values[-1]] = float("-inf")
    if top_p:
        sorted_, order = torch.sort(exact, descending=True)
        mass = sorted_.softmax(-1).cumsum(-1)
        drop = torch.cat((torch.tensor([False]), mass[:-1] > top_p))
        exact[order[drop]] = float("-inf")
    probs = exact.softmax(-1)
    logits = row.float().expand(N, V).contiguous()
    for method in ("gumbel", "multinomial"):
        sampler = Sampler(top_k, top_p, torch.Generator().manual_seed(11), method=method)
        tokens, logprobs = sampler(logits)
        stat = _chi_square(torch.bincount(tokens, minlength=V).double(), probs)
        assert stat < 27.9, (method, stat)
        ref = torch.log_softmax(row, -1)[tokens].float()
        assert torch.allclose(logprobs, ref, atol=1e-6), method


def test_gumbel_greedy_and_vocab_view():
    logits = torch.randn(32, 40, generator=torch.Generator().manual_seed(1))
    greedy = Sampler(1, 0.0, torch.Generator().manual_seed(0), method="gumbel")
    tokens, _ = greedy(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    # the first 30 columns drawn from, the log-prob over all 40
    tokens, logprobs = Sampler(0, 0.0, torch.Generator().manual_seed(0), method="gumbel")(
        logits, vocab=30)
    assert int(tokens.max()) < 30
    assert torch.allclose(logprobs, torch.log_softmax(logits.double(), -1).gather(
        -1, tokens[:, None])[:, 0].float(), atol=1e-6)
    with pytest.raises(ValueError, match="top_k and top_p"):
        Sampler(2, 0.5)


def test_finish_rule_is_megatrons():
    rule = FinishRule()
    tokens = torch.tensor([2, 5, 5, 7])
    lengths = torch.tensor([3, 3, 9, 3])
    limits = torch.tensor([10, 10, 10, 10])
    # EOS 2 (request 0), the length limit (request 2: its token at position 9 is the last)
    assert rule.ends(tokens, torch.tensor([2, 2, 2, -1]), lengths, limits).tolist() == \
        [True, False, True, False]
    # several stop tokens per request (a tool call's end beside EOS)
    stops = torch.tensor([[2, 7], [2, 7], [2, 7], [2, 7]])
    assert rule.ends(tokens, stops, lengths, limits).tolist() == [True, False, True, True]
