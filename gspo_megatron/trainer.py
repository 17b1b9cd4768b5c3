"""The RL loop: rollout -> reward -> advantages -> old log-probs -> minibatch updates -> log -> save.

Each stage is a plain function of explicit inputs (testable alone); :class:`Trainer` owns the state
(policy, data position, step) and calls them in order in :meth:`Trainer.rl_step`.
"""

from __future__ import annotations

import logging
import signal
import time

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import group_advantages
from gspo_megatron.config import TrainConfig
from gspo_megatron.parallel import ParallelGroups, device
from gspo_megatron.training.batch import PolicyBatch, make_policy_batch
from gspo_megatron.training.faults import maybe_corrupt, maybe_fail, set_step
from gspo_megatron.training.megatron_setup import MegatronPolicy, current_lr, optimizer_step, zero_grad
from gspo_megatron.training.step import ScoringConfig, compute_logprobs, train_minibatch

logger = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75
"""Exit code after a SIGTERM/SIGUSR1 checkpoint (EX_TEMPFAIL): launch scripts requeue on it."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had NaN/Inf; the run stops, the last checkpoint is untouched."""


def any_rank(flag: bool, groups: ParallelGroups) -> bool:
    """True if ``flag`` is true on any rank (one MAX all-reduce), so all ranks decide alike."""
    t = torch.tensor([1.0 if flag else 0.0], device=device())  # NCCL reduces device tensors only
    if groups.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_finite(tensor: torch.Tensor | None, groups: ParallelGroups,
               mask: torch.Tensor | None = None) -> bool:
    """True when ``tensor`` (masked) is finite on every rank; ranks without it vote yes."""
    bad = tensor is not None and not bool(
        torch.isfinite(tensor[mask] if mask is not None else tensor).all())
    return not any_rank(bad, groups)


# ----------------------------------------------------------------------------- stages

def rollout_stage(engine, tokenizer, prompts: list, group_size: int, seed: int):
    """Sample ``group_size`` responses for every prompt. Returns (prompt_ids per sample, samples);
    samples are ordered prompt-major: sample ``i * G + g`` is response ``g`` to prompt ``i``."""
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(p.model_input)) for p in prompts]
    repeated = [ids for ids in prompt_ids for _ in range(group_size)]
    return engine.generate(repeated, seed=seed)


def reward_stage(reward_fn, tokenizer, prompts: list, samples: list, group_size: int,
                 timeout_s: float) -> tuple[torch.Tensor, dict]:
    """Score every response against its prompt's answer. Returns (rewards [N], ``reward/`` stats)."""
    from gspo_megatron.rewards import compute_rewards

    responses = [tokenizer.decode(s.response_ids) for s in samples]
    examples = [p for p in prompts for _ in range(group_size)]
    return compute_rewards(reward_fn, responses, [e.answer for e in examples], examples,
                           timeout_s=timeout_s)


def advantage_stage(rewards: torch.Tensor, group_size: int, normalize_std: bool):
    """Group-normalised advantages A_i (paper Eq. 6). Returns (advantages [N], metrics)."""
    result = group_advantages(rewards, group_size, normalize_std=normalize_std)
    return result.advantages.float(), {k: float(v) for k, v in result.metrics.items()}


def batch_stage(samples: list, advantages: torch.Tensor, pad_id: int, pad_to_multiple_of: int,
                seq_length: int | None) -> PolicyBatch:
    """Pack samples into a label-aligned :class:`PolicyBatch` with rollout log-probs."""
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    batch = make_policy_batch(sequences, [len(s.prompt_ids) for s in samples], pad_id,
                              pad_to_multiple_of=pad_to_multiple_of, seq_length=seq_length)
    rollout_lp = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        rollout_lp[i, p - 1: p - 1 + len(s.response_logprobs)] = torch.tensor(s.response_logprobs)
    batch.rollout_logprobs = rollout_lp
    batch.advantages = advantages
    return batch


def rollout_mismatch(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 KL estimate between the rollout engine's and the trainer's log-probs on response tokens:
    ``E[exp(d) - d - 1]`` with ``d = log p_train - log p_rollout`` (0 when they agree)."""
    d = (train_lp.double() - rollout_lp.double()).clamp(-20, 20)[mask]
    return float((torch.exp(d) - d - 1).mean()) if d.numel() else 0.0


def diagnoses_routing(cfg: TrainConfig, step: int) -> bool:
    """Whether RL step ``step`` runs the routing diagnostics (``routing.diagnostics_interval``)."""
    return cfg.routing.diagnostics and step % cfg.routing.diagnostics_interval == 0


def update_stage(policy: MegatronPolicy, batch: PolicyBatch, cfg: TrainConfig,
                 scoring: ScoringConfig, groups: ParallelGroups, seed: int,
                 step: int = 0, routing=None, old_routes=None) -> dict[str, float]:
    """Split the rollout batch into ``num_minibatches`` (shuffled, same order on every rank), one
    optimiser step each. Returns metrics averaged over the minibatches.

    MoE routing (``routing``: the policy's :class:`~gspo_megatron.routing.ModelRouting`,
    ``old_routes``: the batch's routes from the old-policy pass): with ``routing.replay='r2'``
    every update forward replays the old routes; on a diagnosed step (``routing.diagnostics`` every
    ``diagnostics_interval`` steps) each optimiser step is followed by the ``routing/*`` statistics
    on the minibatch it was computed on. Whenever ``old_routes`` are given, the update forwards also
    record the routes free routing takes, at no extra forward, and ``routing/drift/*`` compares
    them with the old policy's: minibatch ``i`` runs after ``i`` optimiser steps, so
    ``routing/drift/after_{i}_updates`` is the route change after ``i`` updates (~0 for ``i = 0``:
    the on-policy check) and ``routing/drift/change_rate`` averages ``i >= 1``. Under R2 the
    recorded routes are each router's own top-k on the hidden states that replay produced (the
    share of routes replay overrides; the first MoE layer's equal free routing's)."""
    order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
    shuffled = batch.select(order)
    per_minibatch = batch.size // cfg.trainer.num_minibatches
    mbs = cfg.trainer.micro_batch_size
    drift = routing is not None and old_routes is not None
    replay = drift and cfg.routing.replay == "r2"
    diagnose = drift and diagnoses_routing(cfg, step)
    history: list[dict[str, float]] = []
    diag_s = 0.0
    for i, minibatch in enumerate(shuffled.split(per_minibatch)):
        if i == 1:
            maybe_fail("mid_update", step)
        mb_routes = (old_routes.select(order[i * per_minibatch:(i + 1) * per_minibatch])
                     if drift else None)
        hooks = None
        if replay:
            hooks = routing.replayer(mb_routes, mbs, capture_natural=True)
        elif drift:
            hooks = routing.recorder()
        zero_grad(policy)
        metrics = train_minibatch(policy.model, minibatch, mbs, cfg.loss, scoring, groups,
                                  routing=hooks)
        if drift:
            taken = hooks.natural_store() if replay else hooks.store()
            metrics.update(_drift_metrics(routing, mb_routes, taken, minibatch, i))
        _inject_nan_grad(policy)
        if any_rank(bool(metrics.get("faults/nonfinite_loss")), groups):
            applied, grad_norm = False, float("nan")
        else:
            applied, grad_norm, _ = optimizer_step(policy)  # skips non-finite gradients itself
        metrics.update({"optim/grad_norm": grad_norm, "optim/skipped": float(not applied),
                        "faults/skipped_updates": float(not applied)})
        if diagnose:
            from gspo_megatron.routing import routing_diagnostics

            t = time.perf_counter()
            diag = routing_diagnostics(policy.model, routing, minibatch, mb_routes, mbs, scoring,
                                       groups, cfg.loss, replay_gap=cfg.routing.replay_gap)
            if "routing/change_rate" in diag:
                diag[f"routing/change_rate/after_update_{i}"] = diag["routing/change_rate"]
            metrics.update(diag)
            diag_s += time.perf_counter() - t
        history.append(metrics)
    keys = set().union(*history)
    out = {k: sum(h[k] for h in history if k in h) / sum(k in h for h in history) for k in keys}
    out["optim/lr"] = current_lr(policy)
    if diagnose:
        out["perf/routing_diagnostics_s"] = diag_s
    return out


def _drift_metrics(routing, old_routes, taken_routes, minibatch: PolicyBatch,
                   i: int) -> dict[str, float]:
    """``routing/drift/*`` of minibatch ``i`` from the routes its training forward took."""
    from gspo_megatron.routing import route_drift

    rate, per_layer = route_drift(routing, old_routes, taken_routes, minibatch.response_mask)
    out = {f"routing/drift/after_{i}_updates": rate}
    if i >= 1:
        out["routing/drift/change_rate"] = rate
        out.update({f"routing/drift/change_rate/layer_{layer}": v
                    for layer, v in enumerate(per_layer)})
    return out


def _inject_nan_grad(policy: MegatronPolicy) -> None:
    """Fault injection point ``nan_grads``: poison one reduced gradient."""
    param = next(p for p in policy.model[0].module.parameters() if hasattr(p, "main_grad"))
    param.main_grad.copy_(maybe_corrupt("nan_grads", param.main_grad))


def gather_on_logging_rank(metrics: dict, groups: ParallelGroups) -> dict:
    """Merge metric dicts from all ranks (the last pipeline stage holds the loss metrics)."""
    if groups.world_size == 1:
        return metrics
    gathered: list = [None] * groups.world_size
    dist.all_gather_object(gathered, metrics)
    merged: dict = {}
    for d in gathered:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


# ----------------------------------------------------------------------------- trainer

class Trainer:
    """Owns the policy, data position and step; see :meth:`rl_step` for the loop body."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, policy: MegatronPolicy,
                 tokenizer, train_sampler, eval_examples: list, reward_fn, engine, greedy_engine,
                 metrics_logger, reference: MegatronPolicy | None = None):
        self.cfg, self.groups, self.policy = cfg, groups, policy
        self.tokenizer, self.sampler, self.eval_examples = tokenizer, train_sampler, eval_examples
        self.reward_fn, self.engine, self.greedy_engine = reward_fn, engine, greedy_engine
        self.metrics_logger, self.reference = metrics_logger, reference
        self.scoring = ScoringConfig(temperature=cfg.rollout.temperature,
                                     vocab_size=tokenizer.vocab_size)
        self.step = 0
        self.consecutive_faults = 0
        self._stop_signal: int | None = None
        tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
        self.pad_multiple = tp * (2 * cp if cp > 1 else 1)
        self.routing = None  # the policy's MoE routers, for R2 replay / routing diagnostics
        if cfg.routing.replay != "none" or cfg.routing.diagnostics:
            from gspo_megatron.routing import ModelRouting

            self.routing = ModelRouting(policy.model, groups)

    # -- the loop body, top to bottom
    def rl_step(self) -> dict[str, float]:
        cfg, g = self.cfg, self.groups
        seed = cfg.trainer.seed + 1000 * self.step + g.dp_rank
        set_step(self.step)
        maybe_fail("step_start", self.step)
        timings: dict[str, float] = {}
        t_step = t = time.perf_counter()

        prompts = self._local_prompts(self.sampler.next_batch())
        samples = rollout_stage(self.engine, self.tokenizer, prompts, cfg.rollout.group_size, seed)
        timings["perf/rollout_s"], t = time.perf_counter() - t, time.perf_counter()

        rewards, reward_metrics = reward_stage(self.reward_fn, self.tokenizer, prompts, samples,
                                               cfg.rollout.group_size, cfg.reward.timeout_s)
        rewards = maybe_corrupt("nan_rewards", rewards)
        timings["perf/reward_s"], t = time.perf_counter() - t, time.perf_counter()
        if not all_finite(rewards, g):
            return self._skip_step("faults/nonfinite_rewards", reward_metrics, timings, t_step)

        advantages, adv_metrics = advantage_stage(rewards, cfg.rollout.group_size,
                                                  cfg.trainer.normalize_advantage_std)
        advantages = maybe_corrupt("nan_advantages", advantages)
        if not all_finite(advantages, g):
            return self._skip_step("faults/nonfinite_advantages", reward_metrics, timings, t_step)
        batch = batch_stage(samples, advantages, self.tokenizer.pad_id, self.pad_multiple,
                            self._fixed_seq_length())

        # With R2 or routing diagnostics, this pass also records the old policy's MoE routes (for
        # the replay, the free routing/drift/* metrics and, on diagnosed steps, the diagnostics).
        recorder = self.routing.recorder() if self.routing is not None else None
        train_lp, _ = compute_logprobs(self.policy.model, batch, cfg.trainer.micro_batch_size,
                                       self.scoring, g, routing=recorder)
        if train_lp is not None:
            train_lp = maybe_corrupt("nan_logprobs", train_lp)
        if not all_finite(train_lp, g, batch.response_mask):
            return self._skip_step("faults/nonfinite_logprobs", reward_metrics, timings, t_step)
        old_routes = recorder.store() if recorder is not None else None
        extra: dict[str, float] = {}
        if train_lp is not None:
            extra["kl/rollout_vs_train"] = rollout_mismatch(train_lp, batch.rollout_logprobs,
                                                            batch.response_mask)
            batch.old_logprobs = (batch.rollout_logprobs if cfg.trainer.old_logprobs == "rollout"
                                  else train_lp)
        if self.reference is not None:
            batch.ref_logprobs, _ = compute_logprobs(self.reference.model, batch,
                                                     cfg.trainer.micro_batch_size, self.scoring, g)
        timings["perf/old_logprobs_s"], t = time.perf_counter() - t, time.perf_counter()

        update_metrics = update_stage(self.policy, batch, cfg, self.scoring, g, seed, self.step,
                                      routing=self.routing, old_routes=old_routes)
        timings["perf/update_s"] = time.perf_counter() - t
        self._count_faults(update_metrics.get("faults/skipped_updates", 0.0) > 0)
        self.step += 1

        num_tokens = sum(len(s.response_ids) for s in samples)
        timings["perf/step_s"] = time.perf_counter() - t_step
        timings["perf/rollout_tokens_per_s"] = num_tokens / max(timings["perf/rollout_s"], 1e-9)
        metrics = {**reward_metrics, **adv_metrics, **extra, **update_metrics, **timings,
                   "response/mean_length": num_tokens / len(samples),
                   "response/eos_fraction": sum(s.finish_reason == "eos" for s in samples) / len(samples)}
        return gather_on_logging_rank(metrics, g)

    # -- non-finite guard
    def _skip_step(self, fault: str, reward_metrics: dict, timings: dict, t_step: float) -> dict:
        """Give up this step before any update: weights, optimizer and schedule stay untouched."""
        logger.warning("step %d: %s; skipping the update", self.step, fault)
        self._count_faults(True)
        self.step += 1
        timings["perf/step_s"] = time.perf_counter() - t_step
        metrics = {k: v for k, v in reward_metrics.items() if k in ("reward/errors", "reward/timeouts")}
        metrics.update(timings)
        metrics.update({fault: 1.0, "optim/skipped": 1.0})
        return gather_on_logging_rank(metrics, self.groups)

    def _count_faults(self, faulty: bool) -> None:
        self.consecutive_faults = self.consecutive_faults + 1 if faulty else 0
        if self.consecutive_faults >= self.cfg.trainer.max_consecutive_faults:
            raise NonFiniteError(
                f"{self.consecutive_faults} consecutive steps had non-finite values (last: step "
                f"{self.step}); stopping (trainer.max_consecutive_faults="
                f"{self.cfg.trainer.max_consecutive_faults}). The last checkpoint is untouched.")

    # -- evaluation: greedy decoding on held-out prompts
    def evaluate(self, max_examples: int | None = None) -> float:
        """Held-out accuracy (greedy decoding), averaged over data-parallel ranks."""
        examples = self.eval_examples[: max_examples or len(self.eval_examples)]
        local = examples[self.groups.dp_rank:: self.groups.dp_size]
        samples = rollout_stage(self.greedy_engine, self.tokenizer, local, 1, seed=0)
        rewards, stats = reward_stage(self.reward_fn, self.tokenizer, local, samples, 1,
                                      self.cfg.reward.timeout_s)
        correct = torch.tensor([stats["reward/accuracy"] * len(local), len(local)],
                               dtype=torch.float64, device=device())
        if self.groups.dp_size > 1:
            dist.all_reduce(correct, group=self.groups.dp_group)
        return float(correct[0] / correct[1].clamp(min=1))

    # -- helpers
    def _local_prompts(self, global_prompts: list) -> list:
        per_rank = self.cfg.rollout.prompts_per_step
        start = self.groups.dp_rank * per_rank
        return global_prompts[start: start + per_rank]

    def _fixed_seq_length(self) -> int | None:
        """Pipeline parallel needs one activation shape for every microbatch of a run."""
        return self.cfg.model.seq_length if self.groups.pp_size > 1 else None

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1: finish the current step, checkpoint, exit with REQUEUE_EXIT_CODE."""
        def handler(signum, frame):
            self._stop_signal = signum
            logger.warning("received signal %d: will checkpoint after this step and exit", signum)

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def stop_requested(self) -> bool:
        """Whether any rank received a stop signal (agreed by all ranks, so they stop together)."""
        return any_rank(self._stop_signal is not None, self.groups)
