"""Cross-field validation of a :class:`~gspo_megatron.config.TrainConfig`, before any compute.

:func:`validate_config` collects every problem (layout vs world size, batch divisibility, lengths,
paths, reward function, ...) into one :class:`ConfigError` whose lines name the fields.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

from gspo_megatron.config import TrainConfig


class ConfigError(ValueError):
    """An invalid recipe, override or field combination. ``errors`` lists every problem found."""

    def __init__(self, errors: str | Sequence[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            msg = self.errors[0]
        else:
            msg = f"{len(self.errors)} configuration errors:\n" + "\n".join(
                f"  - {e}" for e in self.errors)
        super().__init__(msg)


class ConfigWarning(UserWarning):
    """A legal but probably unintended configuration."""


def _check(errors: list[str], fn, *args) -> Any:
    try:
        return fn(*args)
    except (ValueError, ImportError) as e:
        errors.append(str(e))
        return None


def validate_config(cfg: TrainConfig, world_size: int = 1, *, check_paths: bool = True) -> int:
    """Cross-field checks for a run on ``world_size`` ranks; return the data-parallel size.

    Raises one :class:`ConfigError` listing every problem, each naming the field(s) and values.
    ``check_paths=False`` skips the checks that files exist (to check a cluster recipe elsewhere).
    Warns (:class:`ConfigWarning`) for legal but wasteful settings.
    """
    errors: list[str] = []
    m, par, opt, loss = cfg.model, cfg.parallel, cfg.optim, cfg.loss
    data, tok, ro, rw = cfg.data, cfg.tokenizer, cfg.rollout, cfg.reward
    sft, tr, ck, prec = cfg.sft, cfg.trainer, cfg.checkpoint, cfg.precision

    # Model, layout, optimiser: the components' own checks.
    dp = 0
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        errors.append(f"world size must be an int >= 1, got {world_size!r}")
    _check(errors, m.validate)
    if not errors:  # the layout checks assume a consistent model and a valid world size
        dp = _check(errors, par.validate, world_size, m) or 0
    _check(errors, opt.validate)
    if not opt.min_lr <= opt.lr:
        errors.append(f"optim.min_lr ({opt.min_lr}) must be <= optim.lr ({opt.lr})")
    if opt.weight_decay < 0:
        errors.append(f"optim.weight_decay must be >= 0, got {opt.weight_decay}")
    if opt.adam_eps <= 0:
        errors.append(f"optim.adam_eps must be > 0, got {opt.adam_eps}")
    if opt.lr_decay_steps is not None and opt.lr_decay_steps < 1:
        errors.append(f"optim.lr_decay_steps must be >= 1 or null, got {opt.lr_decay_steps}")
    if prec.fp8 is not None and prec.transformer_impl == "local":
        errors.append(f"precision.fp8={prec.fp8!r} needs Transformer Engine; "
                      "precision.transformer_impl must be 'auto' or 'transformer_engine', not 'local'")

    # Rollout.
    if ro.group_size < 2:
        errors.append(f"rollout.group_size must be >= 2 (GSPO/GRPO advantages are normalised "
                      f"within a group of responses to the same prompt), got {ro.group_size}")
    for name in ("prompts_per_step", "max_new_tokens", "max_batch_size"):
        if getattr(ro, name) < 1:
            errors.append(f"rollout.{name} must be >= 1, got {getattr(ro, name)}")
    if not ro.temperature > 0:
        errors.append(f"rollout.temperature must be > 0, got {ro.temperature}")
    if not 0 < ro.top_p <= 1:
        errors.append(f"rollout.top_p must be in (0, 1], got {ro.top_p}")
    if ro.top_k < 0:
        errors.append(f"rollout.top_k must be >= 0 (0 = off), got {ro.top_k}")

    # Trainer: the rollout batch splits into minibatches, each into micro-batches.
    for name in ("num_minibatches", "micro_batch_size"):
        if getattr(tr, name) < 1:
            errors.append(f"trainer.{name} must be >= 1, got {getattr(tr, name)}")
    for name in ("steps", "eval_interval", "seed"):
        if getattr(tr, name) < 0:
            errors.append(f"trainer.{name} must be >= 0, got {getattr(tr, name)}")
    batch = ro.prompts_per_step * ro.group_size
    if tr.num_minibatches >= 1 and batch >= 1:
        if batch % tr.num_minibatches:
            errors.append(
                f"trainer.num_minibatches ({tr.num_minibatches}) must divide the rollout batch "
                f"rollout.prompts_per_step x rollout.group_size = {ro.prompts_per_step} x "
                f"{ro.group_size} = {batch}")
        elif tr.micro_batch_size >= 1 and (batch // tr.num_minibatches) % tr.micro_batch_size:
            errors.append(
                f"trainer.micro_batch_size ({tr.micro_batch_size}) must divide the minibatch "
                f"(rollout.prompts_per_step x rollout.group_size / trainer.num_minibatches = "
                f"{batch} / {tr.num_minibatches} = {batch // tr.num_minibatches})")

    # Context parallelism: the losses reduce sequence sums over a CP group (tested in pure torch),
    # but the trainer does not yet split batches into Megatron's load-balanced CP chunks.
    if par.context_parallel_size > 1:
        errors.append(
            f"parallel.context_parallel_size={par.context_parallel_size}: the trainer does not yet "
            "shard sequences across context-parallel ranks; use 1 (long sequences: raise "
            "tensor_model_parallel_size with sequence_parallel, or recompute)")

    # MoE routing replay and diagnostics.
    rt = cfg.routing
    if rt.replay == "r3":
        errors.append(
            "routing.replay='r3' needs the routes the rollout engine used while sampling; "
            "gspo_megatron's RolloutEngine (Megatron-Core's static and dynamic inference engines) "
            "does not return them (docs/routing.md, 'R3'). Use routing.replay='r2' (routes "
            "recorded in the trainer's old-policy pass)")
    if not isinstance(rt.diagnostics_interval, int) or rt.diagnostics_interval < 1:
        errors.append(f"routing.diagnostics_interval={rt.diagnostics_interval!r}: must be an "
                      "integer >= 1 (run the diagnostics every N RL steps)")
    if rt.replay != "none" or rt.diagnostics:
        what = f"routing.replay={rt.replay!r}" if rt.replay != "none" else "routing.diagnostics"
        if not m.num_moe_experts:
            errors.append(f"{what} needs an MoE model (model.num_moe_experts > 0)")
        if par.context_parallel_size > 1:
            errors.append(f"{what} is not validated with context parallelism "
                          f"(parallel.context_parallel_size={par.context_parallel_size}); use 1")
        if getattr(m, "moe_router_load_balancing_type", None) == "sinkhorn":
            errors.append(f"{what} does not apply to sinkhorn routing")
        if rt.replay == "r2" and tr.old_logprobs == "rollout":
            warnings.warn("routing.replay='r2' with trainer.old_logprobs='rollout': the replayed "
                          "routes come from the trainer's recompute pass while pi_old comes from "
                          "the rollout engine", ConfigWarning, stacklevel=2)

    if loss.kl_coef > 0 and not tr.reference_model:
        errors.append(f"loss.kl_coef = {loss.kl_coef} > 0 needs trainer.reference_model: true "
                      "(the k3 KL penalty needs the reference policy's log-probs)")
    if tr.reference_model and loss.kl_coef == 0:
        warnings.warn("trainer.reference_model is true but loss.kl_coef is 0: the reference "
                      "copy costs memory and a forward pass per step for nothing",
                      ConfigWarning, stacklevel=2)

    # Data and lengths.
    if data.source == "file":
        if not data.train_path:
            errors.append("data.train_path is required when data.source is 'file'")
        elif check_paths and not os.path.exists(data.train_path):
            errors.append(f"data.train_path: no such file {data.train_path!r}")
    if check_paths and data.eval_path and not os.path.exists(data.eval_path):
        errors.append(f"data.eval_path: no such file {data.eval_path!r}")
    for name in ("prompt_key", "answer_key"):
        if not getattr(data, name):
            errors.append(f"data.{name} must be a non-empty field name")
    if data.max_prompt_length < 1:
        errors.append(f"data.max_prompt_length must be >= 1, got {data.max_prompt_length}")
    if data.source == "arithmetic":
        if data.num_train_examples < 1:
            errors.append(f"data.num_train_examples must be >= 1, got {data.num_train_examples}")
        if data.num_eval_examples < 0:
            errors.append(f"data.num_eval_examples must be >= 0, got {data.num_eval_examples}")
        if data.max_operand < 1:
            errors.append(f"data.max_operand must be >= 1, got {data.max_operand}")
        if not 0.0 < data.heldout_fraction < 1.0:
            errors.append(f"data.heldout_fraction must be in (0, 1), got {data.heldout_fraction}")
    if m.seq_length < data.max_prompt_length + ro.max_new_tokens:
        errors.append(
            f"model.seq_length ({m.seq_length}) must be >= data.max_prompt_length + "
            f"rollout.max_new_tokens = {data.max_prompt_length} + {ro.max_new_tokens} = "
            f"{data.max_prompt_length + ro.max_new_tokens}")
    if tok.kind == "hf" and not tok.path:
        errors.append("tokenizer.path is required when tokenizer.kind is 'hf' "
                      "(a Hugging Face name such as 'Qwen/Qwen3-30B-A3B' or a directory)")

    # Reward (imported lazily: resolving may import the user's module).
    try:
        from gspo_megatron.rewards import get_reward_fn
        get_reward_fn(rw.fn)
    except (ValueError, ImportError) as e:
        errors.append(f"reward.fn = {rw.fn!r}: {e}")

    # SFT warm-up, checkpoints.
    if sft.steps < 0:
        errors.append(f"sft.steps must be >= 0, got {sft.steps}")
    if sft.steps > 0:
        if sft.batch_size < 1:
            errors.append(f"sft.batch_size must be >= 1, got {sft.batch_size}")
        if not sft.lr > 0:
            errors.append(f"sft.lr must be > 0, got {sft.lr}")
        if sft.num_examples < 0:
            errors.append(f"sft.num_examples must be >= 0, got {sft.num_examples}")
    if ck.keep_last < 1:
        errors.append(f"checkpoint.keep_last must be >= 1, got {ck.keep_last}")
    if tr.max_consecutive_faults < 1:
        errors.append(f"trainer.max_consecutive_faults must be >= 1, got {tr.max_consecutive_faults}")
    if ck.save_interval < 0:
        errors.append(f"checkpoint.save_interval must be >= 0 (0 = only at the end), "
                      f"got {ck.save_interval}")
    if check_paths:
        for name in ("init_weights", "load_dir"):
            value = getattr(ck, name)
            if value and not os.path.exists(value):
                errors.append(f"checkpoint.{name}: no such path {value!r}")

    if errors:
        raise ConfigError(errors)
    return dp


