"""Reward models (:mod:`gspo_megatron.rewards.reward_model`) with a tiny Hugging Face reward
model made in the test: the chat template applied, batched scores equal to one-at-a-time ones and
to the model's own forward, the same scores from its own process, and a weighted mix with a
verifier."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.rewards.reward_model import (RewardMix, RewardModelScorer, RewardModelWorker,
                                                conversation)
from gspo_megatron.rewards import get_reward_fn
from tests.helpers.reward_model import tiny_reward_model

PROMPTS = ["3+4=", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12-5="}],
           "9+9=", "1+1=", "20-7=", "6+0=", "15+5="]
RESPONSES = ["7", "7", "18", "3", "a much longer wrong answer", "6", "20"]


class Example:
    def __init__(self, prompt, answer):
        self.model_input, self.answer = prompt, answer


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return tiny_reward_model(tmp_path_factory.mktemp("rm"))


def test_scores_are_the_models_on_the_chat_template(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    scorer = RewardModelScorer(rm_dir, batch_size=3)
    texts = scorer.texts(PROMPTS, RESPONSES)
    assert texts[0] == "<user>3+4=<assistant>7"
    assert texts[1] == "<system>be brief<user>12-5=<assistant>7"
    batched = scorer.score(PROMPTS, RESPONSES)
    alone = [RewardModelScorer(rm_dir, batch_size=1).score([p], [r])[0]
             for p, r in zip(PROMPTS, RESPONSES)]
    assert max(abs(a - b) for a, b in zip(batched, alone)) < 1e-5  # right padding is pooled out
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        direct = [float(model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                  for t in texts]
    assert max(abs(a - b) for a, b in zip(batched, direct)) < 1e-5
    assert len({round(x, 4) for x in batched}) > 3  # (the scores tell responses apart)
    assert conversation("q", "a") == [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}]


def test_own_process_gives_the_same_scores(rm_dir):
    want = RewardModelScorer(rm_dir, batch_size=4).score(PROMPTS, RESPONSES)
    with RewardModelWorker(rm_dir, 4, 4096, "cpu", timeout_s=120) as worker:
        got, error = worker.score_or_error(PROMPTS, RESPONSES)
    assert error is None and max(abs(a - b) for a, b in zip(got, want)) < 1e-6


def test_mix_of_a_verifier_and_the_reward_model(rm_dir):
    scorer = RewardModelScorer(rm_dir, batch_size=4)
    mix = RewardMix([("arithmetic_exact", get_reward_fn("arithmetic_exact"), 1.0),
                     ("reward_model", None, 0.5)], scorer)
    answers = ["7", "7", "18", "2", "13", "6", "20"]
    examples = [Example(p, a) for p, a in zip(PROMPTS, answers)]
    rewards, stats = mix.score_batch(RESPONSES, answers, examples, timeout_s=5.0)
    exact = torch.tensor([float(r == a) for r, a in zip(RESPONSES, answers)], dtype=torch.float64)
    rm = torch.tensor(scorer.score(PROMPTS, RESPONSES), dtype=torch.float64)
    assert torch.allclose(rewards.double(), exact + 0.5 * rm, atol=1e-6)
    assert stats["reward/component/arithmetic_exact"] == pytest.approx(float(exact.mean()))
    assert stats["reward/component/reward_model"] == pytest.approx(float(rm.mean()), abs=1e-6)
    assert stats["reward/accuracy"] == pytest.approx(5 / 7)  # the verifier's, not the sum's


def test_a_classifier_with_more_outputs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="num_labels 1"):
        RewardModelScorer(tiny_reward_model(tmp_path, num_labels=2))
