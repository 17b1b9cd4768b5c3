"""``gspo-train --check``: everything a run would read, checked without starting it.

The checks :func:`~gspo_megatron.cli.prepare` runs before a run (the megatron-core version, the
config against the world size, the directories the run writes, the reward, the data, the
tokenizer, the checkpoint it starts from), plus the memory plan ``gspo-plan`` makes for the
layout. Where ``prepare`` stops at the first problem, :func:`check_run` runs every check whose
inputs are there and reports each problem on one line, so a recipe moved to a new cluster shows
all its missing paths at once. No process group, model or file is made.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Callable

from gspo_megatron.config import TrainConfig

# What a check that fails may raise for a user's input, besides the checkpoint's and the
# megatron-core version's errors (anything else is a bug: it propagates).
USER_ERRORS = (ValueError, OSError, ImportError, LookupError)


def smallest_world(cfg: TrainConfig) -> int:
    """The fewest ranks the layout runs on: a multiple of both the dense model-parallel group
    (TP x PP x CP) and the expert group (EP x ETP x PP), plus ``rollout.ranks`` under
    ``rollout.placement: separate`` (with one trainer data-parallel rank: one rollout rank)."""
    p = cfg.parallel
    dense = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size  # null: TP's
    expert = p.expert_model_parallel_size * etp * p.pipeline_model_parallel_size
    world = math.lcm(dense, expert)
    return world + (cfg.rollout.ranks if cfg.rollout.placement == "separate" else 0)


def memory_plan(cfg: TrainConfig, recipe: str, overrides: list[str], gpus: int,
                gpu_memory_gib: float) -> tuple[str, str | None]:
    """``(report line, problem or None)``: ``gspo-plan --config recipe --gpus gpus``'s peak per
    GPU for the trainer's layout against ``gpu_memory_gib``."""
    import argparse

    from gspo_megatron.planner import GIB, plan_memory
    from gspo_megatron.tools.plan import RECIPE_OVERRIDES, from_recipe, split_plan_kwargs

    # gspo-plan's own reading of the recipe (its flags unset: the recipe decides).
    flags = argparse.Namespace(config=recipe, **{k: None for k in RECIPE_OVERRIDES})
    _, model, layout, kwargs = from_recipe(flags, overrides)
    kwargs, side = split_plan_kwargs(kwargs)
    trainer_gpus = gpus - side["rollout_ranks"]
    plan = plan_memory(model, layout, trainer_gpus, **kwargs)
    line = (f"memory plan: {layout.describe()} on {trainer_gpus} GPUs: {plan.total / GIB:.2f} GiB "
            f"per GPU (training {plan.training_peak / GIB:.2f}, rollout "
            f"{plan.rollout_peak / GIB:.2f}) of {gpu_memory_gib:g}")
    if plan.total > gpu_memory_gib * GIB:
        return line, (f"memory: {plan.total / GIB:.1f} GiB per GPU > {gpu_memory_gib:g} GiB "
                      f"(gspo-plan --gpus {gpus} --config {recipe} for layouts that fit)")
    return line, None


def check_run(cfg: TrainConfig, recipe: str, overrides: list[str], recipe_dir: str | None,
              gpus: int | None, gpu_memory_gib: float,
              say: Callable[[str], None] = print) -> list[str]:
    """Run every check for ``cfg`` on ``gpus`` ranks (None: ``$WORLD_SIZE``, else
    :func:`smallest_world`); ``say`` what each check found that passed, and return the problems,
    one line each. ``recipe`` and ``overrides`` are what ``cfg`` was loaded from (the
    memory plan reads them as ``gspo-plan`` does)."""
    from gspo_megatron import cli
    from gspo_megatron.backends.megatron.checkpoint import CheckpointError
    from gspo_megatron.compat import UnsupportedMegatronError, check_megatron_version
    from gspo_megatron.config.paths import output_dir_problems
    from gspo_megatron.config.validation import ConfigError, validate_config

    problems: list[str] = []

    def attempt(what: Callable[[], object]):
        """``what()``, or None with its problem(s) recorded."""
        try:
            return what()
        except ConfigError as exc:
            problems.extend(exc.errors)
        except (*USER_ERRORS, CheckpointError, UnsupportedMegatronError) as exc:
            problems.append(" ".join(str(exc).split()) or type(exc).__name__)
        return None

    if gpus is None:
        gpus = int(os.environ.get("WORLD_SIZE", 0)) or smallest_world(cfg)
    search = [recipe_dir] if recipe_dir else []
    attempt(check_megatron_version)
    # Layout, batch, lengths, the files it reads (data, init_weights, load_dir), the reward
    # (imported: validate_config resolves it).
    dp = attempt(lambda: validate_config(cfg, world_size=gpus, reward_search_dirs=search))
    problems.extend(output_dir_problems(cfg))
    try:  # the layout alone (the files aside): when it works, plan its memory
        with warnings.catch_warnings():  # the first call showed them
            warnings.simplefilter("ignore")
            dp_size = dp or validate_config(cfg, world_size=gpus, check_paths=False,
                                            reward_search_dirs=search)
    except ConfigError:
        dp_size = None
    say(f"layout: {gpus} GPUs" + (f", data-parallel size {dp_size}" if dp_size else ""))
    if not any(p.startswith("reward.fn") for p in problems):
        say(f"reward: {cfg.reward.fn if cfg.reward.fns is None else cfg.reward.fns} imports")
    if cfg.multi_turn.enabled and not any(p.startswith("multi_turn") for p in problems):
        say(f"multi_turn: environment {cfg.multi_turn.env} imports")
    # The data, if its files exist (validate_config named the missing ones).
    paths = [p for p in (cfg.data.train_path if cfg.data.source == "file" else None,
                         cfg.data.eval_path) if p]
    examples = (attempt(lambda: cli.load_examples(cfg))
                if all(os.path.exists(p) for p in paths) else None)
    if examples is not None:
        say(f"data: {len(examples[0])} training, {len(examples[1])} held-out prompts")

    def tokenizer_of():  # its errors name tokenizer.path and tokenizer.kind (cli.load_tokenizer)
        return cli.load_tokenizer(cfg, *(examples or ([], [])))

    tokenizer = None
    if cfg.tokenizer.path or examples is not None:
        tokenizer = attempt(tokenizer_of)
        if tokenizer is not None:
            say(f"tokenizer: {cfg.tokenizer.path or 'trained on the data'}, vocabulary "
                f"{tokenizer.vocab_size}")
    if tokenizer is not None and cfg.model.vocab_size < tokenizer.vocab_size:
        problems.append(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                        f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    if tokenizer is not None and examples is not None:
        attempt(lambda: cli.check_prompt_lengths(cfg, tokenizer, *examples))
        if dp_size:
            attempt(lambda: cli.check_data_sizes(cfg, *examples, dp_size))
    if not cfg.checkpoint.init_weights or os.path.exists(cfg.checkpoint.init_weights):
        attempt(lambda: cli.check_start_weights(cfg))
    if dp_size:
        found = attempt(lambda: memory_plan(cfg, recipe, overrides, gpus, gpu_memory_gib))
        if found is not None:
            say(found[0])
            if found[1]:
                problems.append(found[1])
    return problems
