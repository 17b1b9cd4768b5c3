"""One rule for which layout runs: what gspo-plan suggests for a shipped recipe is what gspo-train
accepts, a layout that fits is never hidden by the headroom, and the shipped Qwen3 recipes state
where they fit."""

import glob
import os
import re
import sys
from types import SimpleNamespace

import pytest

from gspo_megatron.config.loader import load_config
from gspo_megatron.config.model import model_config_from_preset
from gspo_megatron.config.validation import ConfigError, validate_config
from gspo_megatron.planner import GIB, Layout, plan_memory, suggest_layouts
from gspo_megatron.tools import plan as plan_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))
LAYOUT = re.compile(r"^layout TP(\d+) PP(\d+) EP(\d+) ETP(\d+) CP(\d+) DP\d+ on (\d+) GPUs", re.M)


def run_plan(capsys, *args):
    try:
        rc = plan_tool.main(list(args))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_suggested_layout_passes_the_trainers_validation(capsys, recipe):
    """Every shipped recipe x 8 / 16 / 32 / 64 / 128 GPUs: each layout ``gspo-plan --suggest``
    prints, given to gspo-train as overrides, passes ``validate_config`` (paths aside: the
    recipes' data and checkpoints are placeholders)."""
    suggested = 0
    for gpus in (8, 16, 32, 64, 128):
        p = run_plan(capsys, "--gpus", str(gpus), "--config", recipe, "--suggest")
        layouts = LAYOUT.findall(p.stdout)
        assert p.returncode == (0 if layouts else 1), p.stderr
        for tp, pp, ep, etp, cp, n in layouts:
            assert int(n) == gpus
            overrides = [f"--parallel.tensor_model_parallel_size={tp}",
                         f"--parallel.pipeline_model_parallel_size={pp}",
                         f"--parallel.expert_model_parallel_size={ep}",
                         f"--parallel.expert_tensor_parallel_size={etp}",
                         f"--parallel.context_parallel_size={cp}"]
            cfg = load_config(recipe, overrides)
            try:
                validate_config(cfg, gpus, check_paths=False)
            except ConfigError as e:
                pytest.fail(f"{os.path.basename(recipe)} on {gpus} GPUs: gspo-plan suggests "
                            f"TP{tp} PP{pp} EP{ep}, gspo-train refuses it: {e}")
            suggested += 1
    assert suggested  # every recipe gets at least one suggestion somewhere


def test_pipeline_with_expert_parallel_is_refused_by_the_planner_as_by_the_trainer(capsys):
    """The layout the planner used to suggest for the 30B recipe on 8 GPUs (TP4 PP2 EP4): both
    refuse it with the same message."""
    model = model_config_from_preset("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="use one of them"):
        plan_memory(model, Layout(tp=4, pp=2, ep=4, etp=1), 8)
    recipe = os.path.join(ROOT, "examples", "configs", "qwen3_30b_a3b_gspo.yaml")
    args = ["--parallel.tensor_model_parallel_size=4", "--parallel.pipeline_model_parallel_size=2",
            "--parallel.expert_model_parallel_size=4"]
    with pytest.raises(ConfigError, match="use one of them"):
        validate_config(load_config(recipe, args), 8, check_paths=False)
    p = run_plan(capsys, "--gpus", "8", "--config", recipe, *args)
    assert p.returncode == 2 and "use one of them" in p.stderr


def test_a_layout_that_fits_is_never_hidden_by_the_headroom():
    """A memory between 90 % and 100 % of a layout's peak: the layout is suggested (it fits)."""
    model = model_config_from_preset("qwen3-30b-a3b")
    kwargs = dict(seq_length=5120, max_tokens_per_microbatch=10240, rollout_requests=64)
    target = plan_memory(model, Layout(tp=4, ep=8, etp=1), 8, **kwargs)
    memory = target.total / GIB / 0.95  # 5 % free: under the 10 % headroom
    plans = suggest_layouts(model, 8, memory, limit=100, **kwargs)
    assert any(p.layout == target.layout for p in plans)
