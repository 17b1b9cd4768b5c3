"""Read-only checks of the directories a run will write, for ``gspo-train``'s ``prepare`` step.

A run directory that is a file, or a checkpoint directory under a file, used to be found only when
the first file was written (after the run directory, or after the first training step), with a
traceback. :func:`output_dir_problems` finds it from the paths alone, before anything exists.
"""

from __future__ import annotations

import os

from gspo_megatron.config.schema import TrainConfig


def save_dir_of(cfg: TrainConfig) -> tuple[str, str]:
    """``(field, directory)``: where checkpoints go (``checkpoint.save_dir``, by default
    ``logging.run_dir/checkpoints``) and the field that says so."""
    if cfg.checkpoint.save_dir:
        return "checkpoint.save_dir", cfg.checkpoint.save_dir
    return "logging.run_dir", os.path.join(cfg.logging.run_dir, "checkpoints")


def resume_dir_of(cfg: TrainConfig) -> tuple[str, str]:
    """``(field, directory)``: where a run resumes from (``checkpoint.load_dir``, by default the
    save directory, as the trainer does) and the field that says so."""
    if cfg.checkpoint.load_dir:
        return "checkpoint.load_dir", cfg.checkpoint.load_dir
    return save_dir_of(cfg)


def dir_problem(path: str) -> str | None:
    """Why directory ``path`` cannot be used or created, or ``None``: it is a file, an ancestor
    is a file, or the nearest existing ancestor is not writable. Nothing is created."""
    full = os.path.abspath(path)
    if os.path.lexists(full):
        if not os.path.isdir(full):
            return f"{path} exists and is not a directory"
        if not os.access(full, os.W_OK | os.X_OK):
            return f"{path} is not writable"
        return None
    ancestor = os.path.dirname(full)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"cannot create {path}: {ancestor} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create {path}: {ancestor} is not writable"
    return None


def output_dir_problems(cfg: TrainConfig) -> list[str]:
    """``field: problem`` for each directory the run writes (the run directory, the checkpoint
    directory, the TensorBoard directory) that cannot be created or written; empty when all
    can."""
    problems = {}
    dirs = [("logging.run_dir", cfg.logging.run_dir), save_dir_of(cfg)]
    if cfg.logging.tensorboard_dir:
        dirs.append(("logging.tensorboard_dir", cfg.logging.tensorboard_dir))
    for field, path in dirs:
        problem = dir_problem(path)
        if problem and field not in problems:  # run_dir/checkpoints: run_dir's problem said it
            problems[field] = f"{field}: {problem}"
    return list(problems.values())
