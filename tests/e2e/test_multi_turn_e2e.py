"""Multi-turn runs of ``gspo-train`` (the calculator-tool task, ``examples/configs/
tiny_tool_gspo.yaml``): killed mid-episode and resumed, every step equals the uninterrupted run's
(the restart rule: an episode cut by the kill is played again from its start, from the step's
seed, never resumed half-way); an environment class that cannot be loaded is refused in one line."""

import json
import os

import pytest

from gspo_megatron.metrics import read_metrics
from tests.e2e.test_train_e2e import ROLLOUT_KL_TOL, ROOT, gspo_train, kill_and_resume
from tests.unit.test_bad_user_files import assert_refused, run_cli

pytestmark = pytest.mark.slow

TOOL_RECIPE = os.path.join(ROOT, "examples", "configs", "tiny_tool_gspo.yaml")
TOOL = ["--model.seq_length=128", "--rollout.max_new_tokens=96", "--data.max_prompt_length=32",
        "--sft.steps=20", "--multi_turn.num_workers=1", "--data.num_eval_examples=4"]


def test_killed_mid_episode_then_resumed_matches_uninterrupted(tmp_path):
    a, b = kill_and_resume(tmp_path, *TOOL, recipe=TOOL_RECIPE, fault="mid_episode:3")
    assert max(m["env/env_tokens"] for m in a) > 0 and max(m["env/turns"] for m in a) > 1
    for key in ("reward/mean", "env/turns", "env/tool_calls", "env/policy_tokens",
                "env/env_tokens", "loss/policy", "kl/rollout_vs_train", "optim/grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key


@pytest.mark.distributed
def test_two_process_expert_parallel_episodes(tmp_path):
    """EP=2 on two ranks: each rank's episodes answer their environments between engine steps
    while the other rank's steps wait for it (the lock-step), and the rollout's log-probs of the
    policy's tokens (KV kept across turns) equal the trainer's on every step; pass@k of the
    held-out episodes' final answers (sampled evaluation) before and after."""
    run = tmp_path / "ep2"
    gspo_train(run, *TOOL, "--trainer.steps=2", "--evaluation.num_samples=2",
               "--parallel.expert_model_parallel_size=2", nproc=2, recipe=TOOL_RECIPE)
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["eval/pass@1_before"] <= summary["eval/pass@2_before"] <= 1
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert max(m["env/env_tokens"] for m in metrics) > 0
    kl = [m["kl/rollout_vs_train"] for m in metrics]
    assert all(0 <= v < ROLLOUT_KL_TOL for v in kl), kl


def test_missing_environment_class_is_refused_in_one_line(tmp_path):
    proc, run_dir = run_cli(tmp_path, "--config", TOOL_RECIPE, "--multi_turn.env=my_envs:Nope")
    assert_refused(proc, run_dir, "multi_turn.env 'my_envs:Nope'", "cannot import module")
