"""The Megatron-Core policy: DDP-wrapped ``GPTModel`` chunks, Megatron's optimizer and LR
schedule, behind the :class:`gspo_megatron.policy.Policy` interface the trainer talks to.

This is the only place that wires Megatron's training machinery together (grad buffers,
``finalize_model_grads``, ``get_megatron_optimizer``, ``OptimizerParamScheduler``), the same way
Megatron-LM's ``training.py`` does. Log-prob passes and updates run Megatron's forward-backward
schedule (:mod:`.schedule`); MoE routes are recorded and replayed on Megatron's routers
(:mod:`.routing`); checkpoints are ``dist_checkpointing`` (:mod:`.checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from gspo_megatron.backends.megatron import checkpoint as ckpt
from gspo_megatron.backends.megatron.checkpoint_writer import AsyncCheckpointWriter
from gspo_megatron.backends.megatron.model import build_gpt_model
from gspo_megatron.backends.megatron.offload import StateOffload
from gspo_megatron.backends.megatron.parallel import drop_inference_buffers
from gspo_megatron.backends.megatron.routing.session import PolicyRouting
from gspo_megatron.backends.megatron.schedule import (Microbatching, ScoringConfig,
                                                      compute_logprobs, make_microbatches,
                                                      run_objective)
from gspo_megatron.backends.megatron.kernels.moe import stacked_expert_weights
from gspo_megatron.config import (ModelConfig, OptimConfig, ParallelConfig, PrecisionConfig,
                                  RoutingConfig, logprob_token_budget)
from gspo_megatron.distributed import ParallelGroups, all_reduce_, any_rank
from gspo_megatron.policy import PolicyBatch


class MegatronPolicy:
    """The trainable policy on this rank: model chunks (one per pipeline stage here), optimizer,
    scheduler. Implements :class:`gspo_megatron.policy.Policy`."""

    def __init__(self, model: list, optimizer, scheduler, transformer_config,
                 groups: ParallelGroups, micro_batch_size: int = 1, vocab_size: int | None = None,
                 routing_cfg: RoutingConfig | None = None,
                 max_tokens_per_microbatch: int | None = None,
                 logprob_micro_batch_size: int | None = None, offload: str = "none"):
        self.model = model  # list[DistributedDataParallel]
        self.optimizer = optimizer  # MegatronOptimizer
        self.scheduler = scheduler  # OptimizerParamScheduler
        self.transformer_config = transformer_config
        self.groups = groups
        self.micro_batch_size = micro_batch_size
        sp = groups.tp_size if transformer_config.sequence_parallel else 1
        cp = groups.cp_size
        self.batching = Microbatching(
            micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_microbatch,
            # A packed row splits into CP shares of 2 chunks per sequence, each a multiple of SP.
            pad_to_multiple_of=sp if cp == 1 else 2 * cp * sp,
            segment_multiple=1 if cp == 1 else 2 * cp)
        """How every pass cuts a batch into microbatches (padded rows, or packed under a token
        budget: ``trainer.max_tokens_per_microbatch``)."""
        self.logprob_batching = dataclasses.replace(
            self.batching, micro_batch_size=logprob_micro_batch_size or micro_batch_size,
            max_tokens=logprob_token_budget(max_tokens_per_microbatch, micro_batch_size,
                                            logprob_micro_batch_size))
        """The same for the no-grad log-prob passes: ``trainer.logprob_micro_batch_size``
        sequences per padded microbatch, or, packed, the training budget scaled by
        ``logprob_micro_batch_size / micro_batch_size`` (verl's
        ``log_prob_max_token_len_per_gpu``; unchanged when it is unset)."""
        self.scoring = ScoringConfig(vocab_size=vocab_size,
                                     batch_invariant=bool(getattr(transformer_config,
                                                                  "batch_invariant", False)))
        """The tokenizer's real vocabulary: padded entries are excluded from every softmax."""
        self.routing = (PolicyRouting(self, routing_cfg)
                        if routing_cfg is not None and routing_cfg.enabled else None)
        """The RL loop's MoE routing (replay, drift, diagnostics; built from the ``routing``
        section), or None when the run neither replays nor diagnoses routes."""
        self.offload = StateOffload(offload)
        """``trainer.offload``: the training state moved to host memory during rollouts
        (:meth:`training_state_offloaded`)."""
        self._model_routing = None
        self._checkpoint_writer: AsyncCheckpointWriter | None = None
        self._shard_index = None
        self._piece_loader = None

    def unwrapped(self):
        """The ``GPTModel`` inside DDP (single chunk: no virtual pipeline)."""
        return self.model[0].module

    # -- passes
    def logprobs(self, batch: PolicyBatch, *, temperature: float = 1.0, routing=None
                 ) -> torch.Tensor | None:
        """``[B, T]`` log-probs of ``batch.labels`` (no grad) on the last pipeline stage, else None."""
        scoring = dataclasses.replace(self.scoring, temperature=temperature)
        # Without route hooks the pass runs in inference mode (no autograd bookkeeping per op;
        # -0.5 ms of 12 on TRL's workload) and its result leaves as a copy (an inference tensor
        # cannot be saved for the update's backward). Route hooks keep no_grad: the routes they
        # record feed the update's replay.
        grad_off = contextlib.nullcontext()
        if routing is None:
            _aux_loss_scale_outside_inference_mode(self.model)
            grad_off = torch.inference_mode()
        with stacked_expert_weights(self.unwrapped()), grad_off:  # CPU grouped expert GEMMs
            lp, _ = compute_logprobs(self.model, batch, self.logprob_batching, scoring,
                                     self.groups, routing=routing)
        drop_inference_buffers()
        return lp.clone() if lp is not None and lp.is_inference() else lp

    def train_minibatch(self, batch: PolicyBatch, objective, *, routing=None) -> dict[str, float]:
        """Forward + backward of ``objective`` over ``batch`` (gradients accumulate; call
        :meth:`zero_grad` before and :meth:`optimizer_step` after). Adds ``moe/aux_loss``."""
        micro = make_microbatches(batch, self.batching, self.groups)
        metrics = run_objective(self.model, batch, self.batching, objective, self.scoring,
                                self.groups, routing, microbatches=micro)
        aux = pop_moe_aux_loss()
        if aux is not None and self.groups.is_last_stage and self.groups.pp_size == 1:
            metrics["moe/aux_loss"] = aux / len(micro)
        return metrics

    @contextlib.contextmanager
    def training_state_offloaded(self):
        """Inside the block (this rank's rollout) the state ``trainer.offload`` names is in host
        memory and its device memory free for the KV cache; back, bitwise, when it ends (also on
        an exception). Yields the bytes moved (0 with ``none``)."""
        if self.offload.setting == "none" or self.optimizer is None:
            yield 0
            return
        moved = self.offload.offload(self.model, self.optimizer)
        try:
            yield moved
        finally:
            self.offload.reload()

    # -- optimisation
    def zero_grad(self) -> None:
        """Clear DDP grad buffers and the optimizer's grads before a minibatch."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def grads_are_finite(self) -> bool:
        """True when every reduced gradient on every rank is finite (one MAX all-reduce).

        Megatron's fp32 optimizer has no inf/nan check (only the fp16/bf16 loss-scaled path has
        one), so the policy checks before stepping. Every ``main_grad`` is a view into one of
        DDP's flat gradient buffers (dense and expert-parallel), so the check reads those: one
        ``isfinite().all()`` per buffer instead of one per parameter plus a host sync each (49
        of each on the tiny model: ~0.8 ms per optimiser step on CPU). Their padding is zeroed
        with them, so it never reads as non-finite; same answer as the per-parameter check."""
        buffers = self._grad_buffers
        if buffers is None:  # some main_grad outside DDP's buffers: check parameter by parameter
            bad = any(not bool(torch.isfinite(g).all()) for g in self._main_grads())
        else:
            # A buffer is finite iff its min and max are: NaN propagates to both, +-inf is one
            # of them. One pass without a bool temporary (~8x faster than isfinite().all()).
            bad = any(not bool(torch.isfinite(torch.stack(torch.aminmax(b))).all())
                      for b in buffers if b.numel())
        return not any_rank(bad)

    @functools.cached_property
    def _lean_step(self) -> bool:
        """Whether :func:`lean_optimizer_step` may replace Megatron's ``optimizer.step()``
        (decided once: the optimizer's kind and device do not change; a temporary SFT optimizer
        is the same kind)."""
        return lean_step_applies(self.optimizer)

    def _main_grads(self) -> list[torch.Tensor]:
        return [p.main_grad for chunk in self.model for p in chunk.module.parameters()
                if getattr(p, "main_grad", None) is not None]

    @functools.cached_property
    def _grad_buffers(self) -> list[torch.Tensor] | None:
        """DDP's flat gradient buffers (``grad_data`` of its dense and expert-parallel buffers)
        when every ``main_grad`` lies inside one of them, else None. Decided once: buffers and
        views are fixed when DDP is built."""
        buffers = [b.grad_data for chunk in self.model
                   for b in (*getattr(chunk, "buffers", ()),
                             *getattr(chunk, "expert_parallel_buffers", ()))]
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]

        def inside(g: torch.Tensor) -> bool:
            start = g.data_ptr()
            end = start + g.numel() * g.element_size()
            return g.is_contiguous() and any(lo <= start and end <= hi for lo, hi in spans)

        return buffers if buffers and all(inside(g) for g in self._main_grads()) else None

    def optimizer_step(self, corrupt_grad=None) -> tuple[bool, float]:
        """One optimiser + scheduler step. Returns ``(applied, grad_norm)``.

        A step whose gradients are not finite is skipped (``applied=False``): weights, optimizer
        state and schedule are left untouched. ``corrupt_grad`` (fault injection) may rewrite the
        first reduced gradient before the check."""
        if corrupt_grad is not None:
            param = next(p for p in self.model[0].module.parameters() if hasattr(p, "main_grad"))
            param.main_grad.copy_(corrupt_grad(param.main_grad))
        if not self.grads_are_finite():
            return False, float("nan")
        if self._lean_step:
            applied, grad_norm = lean_optimizer_step(self.optimizer)
        else:
            applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=1)
        return applied, float(grad_norm) if grad_norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @contextlib.contextmanager
    def temporary_optimizer(self, optim_cfg: OptimConfig, total_steps: int):
        """Train with a fresh optimizer and schedule inside the block (the SFT warm-up); the RL
        optimizer, its Adam state and schedule, are back untouched afterwards."""
        saved = self.optimizer, self.scheduler
        self.optimizer, self.scheduler = build_optimizer(self.model, optim_cfg, total_steps)
        try:
            yield
        finally:
            self.optimizer, self.scheduler = saved
            self._weights_changed()  # the block trained them: the RL optimizer's copy is stale

    def _weights_changed(self) -> None:
        """Call after the weights changed outside this policy's optimizer (a warm-up with another
        optimizer, weights loaded or imported). Under bf16 Megatron's optimizer steps fp32 main
        copies of the weights and writes them back into the model: without this, its next step
        would overwrite the change with the copies it took at build time (on an H200 the SFT
        warm-up of the demo recipe was undone by the first RL step: held-out accuracy 0.108 ->
        0.008, docs/benchmarks.md section 6). A no-op for the fp32 optimizer, which steps the
        model's own parameters."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    @torch.no_grad()
    def copy_weights_to(self, other: "MegatronPolicy") -> None:
        """Copy parameters into a policy with the same layout (e.g. policy -> reference)."""
        for s, d in zip(self.model, other.model):
            for ps, pd in zip(s.module.parameters(), d.module.parameters()):
                pd.copy_(ps)
        other._weights_changed()

    # -- MoE routing (replay, drift, diagnostics)
    @property
    def model_routing(self):
        """The model's routers (:class:`~.routing.ModelRouting`), attached on first use."""
        if self._model_routing is None:
            from gspo_megatron.backends.megatron.routing.replay import ModelRouting

            self._model_routing = ModelRouting(self.model, self.groups,
                                               packed=self.batching.max_tokens is not None)
        return self._model_routing

    # -- state
    def has_checkpoint(self, load_dir: str) -> bool:
        return ckpt.read_latest(load_dir) is not None

    def save_checkpoint(self, save_dir: str, step: int, extra: dict, keep_last: int,
                        before_commit=None, background: bool = False) -> str:
        """Model, optimizer, scheduler, RNG and ``(step, extra)`` (collective, atomic). With
        ``background`` the shards are written by a forked process and committed by
        :meth:`wait_for_checkpoint` (:class:`.checkpoint_writer.AsyncCheckpointWriter`)."""
        writer = None
        if background:
            if self._checkpoint_writer is None:
                self._checkpoint_writer = AsyncCheckpointWriter()
            writer = self._checkpoint_writer
        return ckpt.save_checkpoint(self, save_dir, ckpt.TrainingState(step, extra),
                                    keep_last=keep_last, before_commit=before_commit,
                                    writer=writer)

    def wait_for_checkpoint(self) -> float:
        """Finish and commit a background checkpoint (collective); the seconds it blocked."""
        return 0.0 if self._checkpoint_writer is None else self._checkpoint_writer.wait()

    def abort_checkpoint(self) -> None:
        """Drop a background checkpoint that is not committed (after an error)."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.abort()

    def load_checkpoint(self, load_dir: str, allow_pickle: bool = False) -> tuple[int, dict]:
        """Restore the latest loadable checkpoint; returns ``(step, extra)`` (``allow_pickle``:
        ``checkpoint.allow_pickle``)."""
        state = ckpt.load_checkpoint(self, load_dir, allow_pickle=allow_pickle)
        if self.optimizer is not None:
            use_fused_adam(self.optimizer)
        return state.step, state.extra

    def save_weights(self, directory: str) -> None:
        ckpt.save_model_weights(self.unwrapped(), directory)

    def load_weights(self, directory: str) -> None:
        ckpt.load_model_weights(self.unwrapped(), directory)
        self._weights_changed()

    def weight_pieces(self) -> list:
        """This rank's main-replica pieces, views of the parameters in their dtype (not
        collective)."""
        return self._pieces(main_only=True)

    def load_weight_pieces(self, pieces) -> None:
        """Copy ``(box, data)`` pieces of any layout into this rank's shards
        (:class:`~gspo_megatron.weight_pieces.PieceLoader`)."""
        from gspo_megatron.weight_pieces import PieceLoader

        if self._piece_loader is None:
            self._piece_loader = PieceLoader()
        self._piece_loader.load(self._pieces(), pieces)
        self._weights_changed()

    def _pieces(self, main_only: bool = False) -> list:
        """This rank's pieces of the model, indexed once (:class:`.weight_transfer.ShardIndex`)."""
        if self._shard_index is None:
            from gspo_megatron.backends.megatron.weight_transfer import ShardIndex

            self._shard_index = ShardIndex(self.unwrapped())
        return self._shard_index.pieces(main_only)


def build_policy(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    precision_cfg: PrecisionConfig,
    optim_cfg: OptimConfig,
    groups: ParallelGroups,
    total_steps: int,
    with_optimizer: bool = True,
    micro_batch_size: int = 1,
    vocab_size: int | None = None,
    routing_cfg: RoutingConfig | None = None,
    max_tokens_per_microbatch: int | None = None,
    frozen: bool = False,
    logprob_micro_batch_size: int | None = None,
    offload: str = "none",
) -> MegatronPolicy:
    """Build this rank's pipeline stage, wrap it in Megatron DDP and attach the optimizer
    (``routing_cfg``: the RL loop's MoE routing, :attr:`MegatronPolicy.routing`). ``frozen``: a
    model that is never trained (the KL reference, a rollout rank's replica): DDP is built while
    its parameters need no gradient, so it keeps no fp32 gradient buffer (4 bytes per parameter);
    no backward may run through it. ``offload``: ``trainer.offload``
    (:meth:`MegatronPolicy.training_state_offloaded`)."""
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
    if frozen:  # no gradient: Megatron DDP then allocates no fp32 gradient buffer for it
        for p in gpt.parameters():
            p.requires_grad_(False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim_cfg.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=gpt)
    if frozen:  # back on: Megatron's linear layers take another matmul for frozen weights
        for p in gpt.parameters():  # (ULPs apart), and the replica must score as the policy does
            p.requires_grad_(True)
    model = [ddp]
    # What Megatron-LM's training loop sets so the schedule can sync and finalise grads.
    tf_config.no_sync_func = ddp.no_sync
    tf_config.finalize_model_grads_func = (single_rank_finalize_model_grads
                                           if single_rank_finalize_applies(ddp)
                                           else finalize_model_grads)
    tf_config.grad_scale_func = None
    if max_tokens_per_microbatch is not None and groups.pp_size > 1:
        # Packed microbatches differ in length: the pipeline exchanges each one's shape first.
        tf_config.variable_seq_lengths = True

    optimizer = scheduler = None
    if with_optimizer:
        optimizer, scheduler = build_optimizer(model, optim_cfg, total_steps)
    return MegatronPolicy(model, optimizer, scheduler, tf_config, groups,
                          micro_batch_size=micro_batch_size, vocab_size=vocab_size,
                          routing_cfg=routing_cfg,
                          max_tokens_per_microbatch=max_tokens_per_microbatch,
                          logprob_micro_batch_size=logprob_micro_batch_size, offload=offload)


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
    use_fused_adam(optimizer)
    override = optim_cfg.override_opt_param_scheduler
    scheduler = OptimizerParamScheduler(  # (Megatron asserts that at most one of the two is set)
        optimizer, **lr_schedule(optim_cfg, total_steps),
        override_opt_param_scheduler=override, use_checkpoint_opt_param_scheduler=not override)
    return optimizer, scheduler


def lr_schedule(optim_cfg: OptimConfig, total_steps: int) -> dict:
    """Megatron's ``OptimizerParamScheduler`` arguments for ``optim_cfg`` over ``total_steps``
    optimiser steps (the decay spans ``optim.lr_decay_steps``, else the run; at least one step
    past the warm-up). Its state dict holds the same keys, less ``init_lr``: what a checkpoint's
    schedule is compared with on resume (:func:`.checkpoint.schedule_mismatch`)."""
    decay_steps = optim_cfg.lr_decay_steps or max(total_steps, 1)
    return dict(
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


def single_rank_finalize_applies(ddp) -> bool:
    """True when Megatron's ``finalize_model_grads`` has nothing to communicate or adjust: one
    process in the world (every data/tensor/pipeline/expert group has one rank), no per-token
    loss scaling, no router expert bias and no global aux loss (the two module states it
    resets), synchronous grad reduction without NaN/large-gradient checks or a distributed
    optimizer. Then :func:`single_rank_finalize_model_grads` does the same work."""
    import torch.distributed as dist

    c, d = ddp.config, ddp.ddp_config
    balancing = c.moe_router_load_balancing_type
    return (dist.is_initialized() and dist.get_world_size() == 1
            and not c.calculate_per_token_loss and not c.moe_router_enable_expert_bias
            and "global_aux_loss" not in (balancing if isinstance(balancing, list) else [balancing])
            and not d.overlap_grad_reduce and not d.use_distributed_optimizer
            and not d.check_for_nan_in_grad and not d.check_for_large_grads
            and not d.average_in_collective and c.timers is None)


def single_rank_finalize_model_grads(model, num_tokens=None, pg_collection=None,
                                     force_all_reduce=False) -> None:
    """Megatron's ``finalize_model_grads`` for :func:`single_rank_finalize_applies`: each bucket
    group's synchronous ``finish_grad_sync`` (reset ``param_gather_dispatched``, scale by the
    bucket's ``gradient_scaling_factor`` where it is not 1, all-reduce over a group of one: the
    identity, skipped); the embedding/layernorm/conditional-embedding all-reduces are for PP/TP
    > 1 and ``reset_model_temporary_tensors`` resets only expert-bias and global-aux-loss state,
    so nothing else is left. Saves a gloo collective and a walk over every module per update
    (~0.3 ms on TRL's workload); the gradients are untouched either way."""
    assert num_tokens is None, "per-token loss scaling takes Megatron's finalize_model_grads"
    for chunk in model:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            group.param_gather_dispatched = False
            for bucket in group.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor


def lean_step_applies(optimizer) -> bool:
    """True when Megatron's step would run its fp32 path with the local (apex-free) multi-tensor
    helpers on CPU parameters, which :func:`lean_optimizer_step` reproduces: every optimizer an
    ``FP32Optimizer`` over CPU parameters, no zero counting, no precision-aware or distributed
    optimizer, one shared grad-statistics group, and ``clip_grads`` using
    ``local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    if optimizer is None:
        return False
    opts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    if not opts or not all(type(o) is FP32Optimizer and not o.is_stub_optimizer for o in opts):
        return False
    if (getattr(clip_grads, "l2_norm_impl", None) is not mutils.local_multi_tensor_l2_norm
            or getattr(clip_grads, "multi_tensor_scale_impl", None)
            is not mutils.local_multi_tensor_scale):
        return False
    for o in opts:
        c = o.config
        if (c.log_num_zeros_in_grad or c.use_precision_aware_optimizer
                or c.use_distributed_optimizer or c.timers is not None):
            return False
        if not all(p.device.type == "cpu" and not getattr(p, "__fsdp_param__", False)
                   for p in o.get_parameters()):
            return False
    return len(opts) == 1 or optimizer.grads_states_parallel_group_is_shared()


@torch.no_grad()
def lean_optimizer_step(optimizer) -> tuple[bool, float | None]:
    """Megatron's ``ChainedOptimizer.step()`` / ``FP32Optimizer.step()`` for the case of
    :func:`lean_step_applies`, with the same arithmetic in fewer dispatches; returns
    ``(applied, grad_norm)`` (``grad_norm`` None where Megatron's returns None: an unchained
    optimizer without clipping).

    Megatron's local helpers compute the norm as ``torch.norm`` of each gradient, a
    ``torch.tensor`` of those 49 Python-converted values (49 host syncs) and ``torch.norm`` of
    that, then ``(norm ** 2)`` all-reduced over the grad-statistics group, ``.item() ** 0.5``;
    clipping is ``g.copy_(g * coeff)`` per gradient. Here: ``torch._foreach_norm`` (on CPU the
    same ``linalg_vector_norm`` kernel per tensor), ``torch.stack`` of the (identical float32)
    values, the same ``torch.norm``, ``** 2.0``, all-reduce (skipped for a single rank, where it
    is the identity), ``.item() ** 0.5``; clipping is ``torch._foreach_mul_`` by the same Python
    float (the same float32 multiply). Bitwise Megatron's norm, clipped gradients and step
    (``tests/unit/test_update_path.py``); ~0.5 ms less per step on the tiny model."""
    import torch.distributed as dist
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    chained = isinstance(optimizer, ChainedOptimizer)
    opts = optimizer.chained_optimizers if chained else [optimizer]
    if optimizer.prepare_grads():  # param.grad = main_grad (fp32: never finds inf)
        return False, None
    clip = [o.config.clip_grad > 0.0 for o in opts]
    grad_norm = None
    if chained or clip[0]:
        grads = [g for o in opts for g in o.get_main_grads_for_grad_norm()]
        if grads:
            total = torch.norm(torch.stack(torch._foreach_norm(grads))).reshape(1) ** 2.0
        else:
            total = torch.zeros(1) ** 2.0
        group = opts[0].get_grad_stats_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        grad_norm = total.item() ** 0.5
    for o, do_clip in zip(opts, clip):
        if not do_clip:
            continue
        coeff = o.config.clip_grad / (grad_norm + 1.0e-6)
        grads = [p.grad.detach() for p in o.get_parameters() if p.grad is not None]
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)
    return optimizer.step_with_ready_grads(), grad_norm


def use_fused_adam(optimizer) -> None:
    """Run Megatron's inner ``torch.optim.Adam(W)`` as torch's fused implementation for
    parameter groups that live on the CPU.

    Without apex or Transformer Engine Megatron builds a plain ``torch.optim.AdamW``, and on CPU
    torch defaults to its per-parameter loop (``_single_tensor_adam``: ~10 Python-level tensor
    ops per parameter, 49 parameters on the tiny model). The fused kernel does each parameter's
    update in one vectorised pass (Hugging Face's default optimiser, ``adamw_torch_fused``, the
    one TRL runs): ~49 kernel calls per step instead of ~500 (the ``foreach`` variant still
    loops over the per-tensor kernels, ~12 per parameter). Same update rule; the last bits
    differ from the loop's (the kernel's own operation order; ``tests/unit/test_update_path.py``
    bounds the difference). -2.8 ms per RL step on TRL's workload (4 optimiser steps).
    CUDA groups are left alone (torch picks ``foreach`` there, or Megatron uses TE's / apex's
    fused Adam). Where torch has no fused CPU kernel, ``foreach``. Re-applied after a
    checkpoint load (the loaded ``param_groups`` bring their saved flags)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    fused_on_cpu = "cpu" in _get_fused_kernels_supported_devices()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if (not group.get("capturable") and not group.get("differentiable")
                    and all(p.device.type == "cpu" and p.dtype.is_floating_point
                            for p in group["params"])):
                group["fused"], group["foreach"] = fused_on_cpu, not fused_on_cpu


def _aux_loss_scale_outside_inference_mode(model: list) -> None:
    """Megatron keeps the MoE aux-loss gradient scale in a class attribute that the first
    forward with a loss creates from its scale tensor and later ones update in place
    (``MoEAuxLossAutoScaler.set_loss_scale``). Made inside inference mode (a run whose first pass
    is the old-log-prob pass: no SFT) it could not be updated by the update's forward. Creates it
    first, as a normal tensor; its value is set by every forward that uses it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    held = MoEAuxLossAutoScaler.main_loss_backward_scale
    if held is None or held.is_inference():
        device = next(model[0].parameters()).device
        MoEAuxLossAutoScaler.main_loss_backward_scale = (
            torch.ones(1, device=device) if held is None else held.clone())  # Megatron's [1]


def pop_moe_aux_loss() -> float | None:
    """Sum over MoE layers of the load-balancing loss Megatron tracked since the last call (this
    rank's layers, summed over microbatches), then reset the tracker. Megatron's own training loop
    resets it when it logs; without that it would accumulate for the whole run."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if not tracker:
        return None
    total = sum(float(entry["values"].sum()) for entry in tracker.values())
    for entry in tracker.values():
        entry["values"].zero_()
    return total
