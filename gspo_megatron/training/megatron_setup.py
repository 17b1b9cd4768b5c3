"""Wrap the policy in Megatron's DDP and build its optimizer and LR scheduler.

This is the only place that wires Megatron's training machinery together (grad buffers,
``finalize_model_grads``, ``get_megatron_optimizer``, ``OptimizerParamScheduler``), the same way
Megatron-LM's ``training.py`` does, so that the trainer sees three plain objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gspo_megatron.model.build import build_gpt_model
from gspo_megatron.model.config import ModelConfig, ParallelConfig, PrecisionConfig
from gspo_megatron.parallel import ParallelGroups


@dataclass
class OptimConfig:
    """Optimiser and LR schedule (Megatron's names)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay."""
    lr_warmup_steps: int = 0
    """Optimiser steps of linear warm-up from 0."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over ``lr_decay_steps``."""
    lr_decay_steps: int | None = None
    """Steps over which to decay; None = the run's total optimiser steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            raise ValueError("optim.adam_beta1/adam_beta2 must be in [0, 1)")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")


@dataclass
class MegatronPolicy:
    """The trainable policy: model chunks (one per pipeline stage on this rank), optimizer, scheduler."""

    model: list  # list[DistributedDataParallel]
    optimizer: object  # MegatronOptimizer
    scheduler: object  # OptimizerParamScheduler
    transformer_config: object

    def unwrapped(self):
        """The ``GPTModel`` inside DDP (single chunk: no virtual pipeline)."""
        return self.model[0].module


def build_policy(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    precision_cfg: PrecisionConfig,
    optim_cfg: OptimConfig,
    groups: ParallelGroups,
    total_steps: int,
    with_optimizer: bool = True,
) -> MegatronPolicy:
    """Build this rank's pipeline stage, wrap it in Megatron DDP and attach the optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    gpt = build_gpt_model(
        model_cfg, parallel_cfg, precision_cfg,
        pre_process=groups.is_first_stage, post_process=groups.is_last_stage,
        pp_rank=groups.pp_rank,
    )
    tf_config = gpt.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim_cfg.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=gpt)
    model = [ddp]
    # What Megatron-LM's training loop sets so the schedule can sync and finalise grads.
    tf_config.no_sync_func = ddp.no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = None

    optimizer = scheduler = None
    if with_optimizer:
        optimizer, scheduler = build_optimizer(model, optim_cfg, total_steps)
    return MegatronPolicy(model=model, optimizer=optimizer, scheduler=scheduler,
                          transformer_config=tf_config)


def build_optimizer(model: list, optim_cfg: OptimConfig, total_steps: int):
    """Megatron's optimizer (Adam, grad clipping, fp32 main params under bf16) and LR schedule for
    ``model`` (DDP chunks). Returns ``(optimizer, scheduler)``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optim_cfg.validate()
    tf_config = model[0].module.config
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim_cfg.lr,
            min_lr=optim_cfg.min_lr,
            weight_decay=optim_cfg.weight_decay,
            adam_beta1=optim_cfg.adam_beta1,
            adam_beta2=optim_cfg.adam_beta2,
            adam_eps=optim_cfg.adam_eps,
            clip_grad=optim_cfg.clip_grad,
            bf16=tf_config.bf16,
            params_dtype=tf_config.params_dtype,
            use_distributed_optimizer=optim_cfg.use_distributed_optimizer,
        ),
        model,
        use_gloo_process_groups=False,
    )
    decay_steps = optim_cfg.lr_decay_steps or max(total_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim_cfg.lr_warmup_steps else optim_cfg.lr,
        max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        lr_warmup_steps=optim_cfg.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, optim_cfg.lr_warmup_steps + 1),
        lr_decay_style=optim_cfg.lr_decay_style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def zero_grad(policy: MegatronPolicy) -> None:
    """Clear DDP grad buffers and the optimizer's grads before a minibatch."""
    for chunk in policy.model:
        chunk.zero_grad_buffer()
    if policy.optimizer is not None:
        policy.optimizer.zero_grad()


def grads_are_finite(policy: MegatronPolicy) -> bool:
    """True when every reduced gradient on every rank is finite (one MAX all-reduce).

    Megatron's fp32 optimizer has no inf/nan check (only the fp16/bf16 loss-scaled path has one), so
    the trainer checks before stepping."""
    bad = torch.zeros(1)
    for chunk in policy.model:
        for p in chunk.module.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is not None and not torch.isfinite(grad).all():
                bad.fill_(1.0)
                break
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        bad = bad.to(next(policy.model[0].parameters()).device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())


def optimizer_step(policy: MegatronPolicy) -> tuple[bool, float, int | None]:
    """One optimiser + scheduler step. Returns ``(applied, grad_norm, zeros)``.

    A step whose gradients are not finite is skipped (``applied=False``): weights, optimizer state
    and schedule are left untouched."""
    if not grads_are_finite(policy):
        return False, float("nan"), None
    applied, grad_norm, num_zeros = policy.optimizer.step()
    if applied:
        policy.scheduler.step(increment=1)
    return applied, float(grad_norm) if grad_norm is not None else float("nan"), num_zeros


def current_lr(policy: MegatronPolicy) -> float:
    return float(policy.optimizer.param_groups[0]["lr"])


def set_eval(policy: MegatronPolicy, evaluate: bool) -> None:
    for chunk in policy.model:
        chunk.train(not evaluate)


@torch.no_grad()
def copy_weights(src: MegatronPolicy, dst: MegatronPolicy) -> None:
    """Copy parameters between two policies with the same layout (e.g. policy -> reference)."""
    for s, d in zip(src.model, dst.model):
        for ps, pd in zip(s.module.parameters(), d.module.parameters()):
            pd.copy_(ps)
