"""Multi-turn runs of ``gspo-train`` (the calculator-tool task, ``examples/configs/
tiny_tool_gspo.yaml``): killed mid-episode and resumed, every step equals the uninterrupted run's
(the restart rule: an episode cut by the kill is played again from its start, from the step's
seed, never resumed half-way); an environment class that cannot be loaded is refused in one line."""

import os

import pytest

from tests.e2e.test_train_e2e import ROOT, kill_and_resume
from tests.unit.test_bad_user_files import assert_refused, run_cli

pytestmark = pytest.mark.slow

TOOL_RECIPE = os.path.join(ROOT, "examples", "configs", "tiny_tool_gspo.yaml")
TOOL = ["--model.seq_length=128", "--rollout.max_new_tokens=96", "--data.max_prompt_length=32",
        "--sft.steps=40", "--multi_turn.num_workers=1", "--data.num_eval_examples=4"]


def test_killed_mid_episode_then_resumed_matches_uninterrupted(tmp_path):
    a, b = kill_and_resume(tmp_path, *TOOL, recipe=TOOL_RECIPE, fault="mid_episode:3")
    assert max(m["env/env_tokens"] for m in a) > 0 and max(m["env/turns"] for m in a) > 1
    for key in ("reward/mean", "env/turns", "env/tool_calls", "env/policy_tokens",
                "env/env_tokens", "loss/policy", "kl/rollout_vs_train", "optim/grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key


def test_missing_environment_class_is_refused_in_one_line(tmp_path):
    proc, run_dir = run_cli(tmp_path, "--config", TOOL_RECIPE, "--multi_turn.env=my_envs:Nope")
    assert_refused(proc, run_dir, "multi_turn.env 'my_envs:Nope'", "cannot import module")
