"""Every shipped recipe switches loss with one override, ``--loss.variant=V``, for every
registered V: the Qwen3 and GPU recipes at the config level (loaded and validated for their world
size), the CPU recipes by two RL steps of the tiny model (the routing study's shrunk to 2 layers;
the demo's recipe, tiny_gspo.yaml at model.seq_length 64, at the config level)."""

import math
import os

import pytest

from gspo_megatron.algorithms import LOSSES
from gspo_megatron.config import DEMO_RECIPE
from gspo_megatron.config.loader import load_config
from gspo_megatron.config.validation import validate_config
from gspo_megatron.metrics import read_metrics
from tests.e2e.test_train_e2e import ROOT, clean_env
from tests.helpers import warm
from tests.unit.test_config import RECIPE_WORLD_SIZES, RECIPES

# Shipped recipes: examples/configs/*.yaml (test_config checks the list is complete) + the demo's.
SHIPPED = {**{str(RECIPES / name): world for name, world in RECIPE_WORLD_SIZES.items()},
           DEMO_RECIPE: 1}
TINY = ["tiny_gspo.yaml", "tiny_grpo.yaml", "tiny_grpo_r2.yaml", "routing_study.yaml"]
# The routing study's model is 8 layers x 32 experts: 2 x 4 here (what is checked is the loss).
SHRINK = {"routing_study.yaml": ["--model.num_layers=2", "--model.num_moe_experts=4",
                                 "--model.moe_router_topk=2", "--rollout.max_new_tokens=8"]}
TWO_STEPS = ["--data.num_train_examples=40", "--data.num_eval_examples=8",
             "--rollout.group_size=2", "--rollout.prompts_per_step=2",
             "--trainer.num_minibatches=1", "--trainer.micro_batch_size=4", "--sft.steps=0",
             "--trainer.steps=2", "--trainer.eval_interval=0", "--logging.progress=false"]


@pytest.mark.parametrize("recipe", sorted(SHIPPED), ids=lambda p: os.path.basename(p))
def test_every_variant_validates_on_every_recipe(recipe):
    cluster_world = SHIPPED[recipe]
    for variant in LOSSES:
        cfg = load_config(recipe, [f"--loss.variant={variant}"])
        validate_config(cfg, world_size=cluster_world, check_paths=cfg.data.source != "file")
        # The switched loss runs at its own defaults unless the recipe tuned it under its name.
        tuned = getattr(cfg.loss, variant, None)
        assert cfg.loss.params == (tuned or LOSSES[variant].params()), (recipe, variant)


@pytest.mark.slow
def test_every_variant_trains_two_steps_on_the_cpu_recipes(tmp_path):
    recipes = [str(RECIPES / n) + "::" + ",".join(SHRINK.get(n, [])) for n in TINY]
    result = warm.run([os.path.join(ROOT, "tests", "helpers", "switch_losses.py"), str(tmp_path),
                       *recipes, "--", *LOSSES, "--", *TWO_STEPS],
                      env=clean_env(), cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for recipe in [*(os.path.splitext(n)[0] for n in TINY)]:
        for variant in LOSSES:
            rows = read_metrics(tmp_path / recipe / variant / "metrics.jsonl")
            steps = [r for r in rows if "loss/policy" in r]
            assert [r["step"] for r in steps] == [0, 1], (recipe, variant)
            assert all(math.isfinite(r["loss/policy"]) for r in steps), (recipe, variant)
