"""An RL run scored by a verifier and a reward model together (``reward.fns``), the reward model a
tiny Hugging Face one made in the test, in its own process."""

import pytest

from gspo_megatron.metrics import read_metrics
from tests.e2e.test_train_e2e import gspo_train
from tests.helpers.reward_model import tiny_reward_model

pytestmark = pytest.mark.slow


def test_run_scored_by_a_verifier_and_a_reward_model(tmp_path):
    rm = tiny_reward_model(tmp_path / "rm")
    run = tmp_path / "run"
    gspo_train(run, "--trainer.steps=2", "--reward.fns={arithmetic_exact: 1.0, reward_model: 0.5}",
               f"--reward_model.path={rm}", "--reward_model.batch_size=8")
    for m in read_metrics(run / "metrics.jsonl"):
        exact, model = m["reward/component/arithmetic_exact"], m["reward/component/reward_model"]
        assert model != 0.0
        assert m["reward/mean"] == pytest.approx(exact + 0.5 * model, abs=1e-5)
