"""The RL loop: prompts -> rollout -> reward -> advantages -> old log-probs -> minibatch updates ->
log -> checkpoint.

Each stage is a plain function of explicit inputs (tested alone in ``tests/unit/test_trainer_stages``);
:class:`Trainer` owns the state (policy, data position, step) and :meth:`Trainer.fit` the run:
resume, the optional supervised warm-up, evaluation, checkpoints, stop signals and the loop. The
trainer talks to a :class:`~gspo_megatron.policy.Policy` and a :class:`~gspo_megatron.policy.Generator`
only: it imports nothing from megatron (``tests/unit/test_boundaries.py``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import NamedTuple

import torch

from gspo_megatron.algorithms import (NLLObjective, PolicyGradientObjective, group_advantages,
                                      rollout_mismatch)
from gspo_megatron.algorithms.dapo import mask_truncated, select_groups, soft_overlong_penalty
from gspo_megatron.algorithms.pass_at_k import pass_at_k_ladder, sampled_eval_metrics
from gspo_megatron.config import OptimConfig, TrainConfig
from gspo_megatron.config.paths import resume_dir_of, save_dir_of
from gspo_megatron.distributed import ParallelGroups, all_reduce_, any_rank, gather_on_logging_rank
from gspo_megatron.faults import FaultInjector
from gspo_megatron.metrics import MetricsLogger, Stopwatch, device_memory_metrics
from gspo_megatron.policy import Generator, Policy, PolicyBatch, RolloutSample, make_policy_batch

logger = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75
"""Exit code after a SIGTERM/SIGUSR1 checkpoint (EX_TEMPFAIL): launch scripts requeue on it."""


EXTRA_BATCH_SEED_STRIDE = 1_000_000_007
"""Dynamic sampling: extra rollout batch ``b`` of a step samples with the step's seed plus ``b``
times this (batch 0 keeps the step's seed, so runs without dynamic sampling are unchanged)."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had NaN/Inf; the run stops, the last checkpoint is untouched."""


def all_finite(tensor: torch.Tensor | None, mask: torch.Tensor | None = None) -> bool:
    """True when ``tensor`` (masked) is finite on every rank; ranks without it vote yes."""
    bad = tensor is not None and not bool(
        torch.isfinite(tensor[mask] if mask is not None else tensor).all())
    return not any_rank(bad)


# ----------------------------------------------------------------------------- stages

def rollout_stage(generator: Generator, tokenizer, prompts: list, group_size: int,
                  seed: int) -> list[RolloutSample]:
    """Sample ``group_size`` responses for every prompt. Returns the samples, prompt-major:
    sample ``i * G + g`` is response ``g`` to prompt ``i``."""
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(p.model_input)) for p in prompts]
    repeated = [ids for ids in prompt_ids for _ in range(group_size)]
    return generator.generate(repeated, seed=seed)


def reward_stage(reward_fn, tokenizer, prompts: list, samples: list[RolloutSample],
                 group_size: int, timeout_s: float, workers=None) -> tuple[torch.Tensor, dict]:
    """Score every response against its prompt's answer (inline, in ``workers`` or in threads:
    the rule is :mod:`gspo_megatron.rewards.registry`'s). Returns (rewards [N], ``reward/``
    stats)."""
    from gspo_megatron.rewards import compute_rewards

    responses = [tokenizer.decode(s.response_ids) for s in samples]
    examples = [p for p in prompts for _ in range(group_size)]
    return compute_rewards(reward_fn, responses, [e.answer for e in examples], examples,
                           timeout_s=timeout_s, workers=workers)


def overlong_stage(rewards: torch.Tensor, samples: list[RolloutSample], max_new_tokens: int,
                   buffer_tokens: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Eq. 13) added to ``rewards`` ``[N]``; unchanged (the same
    tensor) when ``buffer_tokens`` is 0."""
    if buffer_tokens <= 0:
        return rewards
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    penalty = soft_overlong_penalty(lengths, max_new_tokens, buffer_tokens, penalty_factor)
    return rewards + penalty.to(rewards.dtype)


def advantage_stage(rewards: torch.Tensor, group_size: int, normalize_std: bool):
    """Group-normalised advantages A_i (paper Eq. 6). Returns (advantages [N], metrics, tied
    [N / G] bool: groups whose rewards all tie, so their advantages are 0)."""
    result = group_advantages(rewards, group_size, normalize_std=normalize_std)
    return (result.advantages.float(), {k: float(v) for k, v in result.metrics.items()},
            result.zero_variance_mask)


class StepSamples(NamedTuple):
    """What :meth:`Trainer.sample` hands to the rest of the step: the groups it trains on."""

    prompts: list
    """``P`` prompt examples (``rollout.prompts_per_step``)."""
    samples: list[RolloutSample]
    """``P x G`` responses, prompt-major."""
    advantages: torch.Tensor
    """``[P x G]`` float32 group-normalised advantages (truncated responses zeroed under
    ``overlong.mask_truncated``)."""
    metrics: dict[str, float]
    """``reward/*`` of the step's first rollout batch, ``sampling/*`` under dynamic sampling."""
    generated_tokens: int
    """Response tokens decoded in the step, every rollout batch included."""


def batch_stage(samples: list[RolloutSample], advantages: torch.Tensor, pack) -> PolicyBatch:
    """A label-aligned :class:`PolicyBatch` ``[N, T]`` of the samples, with their advantages
    ``[N]`` and the rollout engine's log-probs ``[N, T]``. ``pack(sequences, prompt_lengths)``
    pads (:meth:`Trainer.pack`)."""
    batch = pack([s.prompt_ids + s.response_ids for s in samples],
                 [len(s.prompt_ids) for s in samples])
    rollout_lp = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        rollout_lp[i, p - 1: p - 1 + len(s.response_logprobs)] = torch.tensor(s.response_logprobs)
    batch.rollout_logprobs = rollout_lp
    batch.advantages = advantages
    return batch


def diagnoses_routing(cfg: TrainConfig, step: int) -> bool:
    """Whether RL step ``step`` runs the routing diagnostics (``routing.diagnostics_interval``)."""
    return cfg.routing.diagnostics and step % cfg.routing.diagnostics_interval == 0


def update_stage(policy: Policy, batch: PolicyBatch, cfg: TrainConfig, seed: int, step: int = 0,
                 old_routes=None, faults: FaultInjector | None = None) -> dict[str, float]:
    """Split the rollout batch into ``num_minibatches`` (shuffled, same order on every rank), one
    optimiser step each. Returns metrics averaged over the minibatches.

    MoE routing (``old_routes``: the batch's routes from the old-policy pass, or None): with
    ``routing.replay`` 'r2' or 'r3' every update forward replays the old routes (under R3 those
    are the rollout engine's); on a diagnosed step
    (``routing.diagnostics`` every ``diagnostics_interval`` steps) each optimiser step is followed
    by the ``routing/*`` statistics on the minibatch it was computed on. Whenever ``old_routes``
    are given, the update forwards also record the routes free routing takes, at no extra forward,
    and ``routing/drift/*`` compares them with the old policy's: minibatch ``i`` runs after ``i``
    optimiser steps, so ``routing/drift/after_{i}_updates`` is the route change after ``i``
    updates (~0 for ``i = 0``: the on-policy check) and ``routing/drift/change_rate`` averages
    ``i >= 1``. Under R2 the recorded routes are each router's own top-k on the hidden states that
    replay produced (the share of routes replay overrides)."""
    faults = faults or FaultInjector()
    objective = PolicyGradientObjective(cfg.loss, cfg.rollout.temperature, faults.corrupt,
                                        correction=cfg.rollout_correction)
    order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
    shuffled = batch.select(order)
    per_minibatch = batch.size // cfg.trainer.num_minibatches
    drift = old_routes is not None
    replay = drift and cfg.routing.replay in ("r2", "r3")
    diagnose = drift and diagnoses_routing(cfg, step)
    history: list[dict[str, float]] = []
    diag_s = 0.0
    for i, minibatch in enumerate(shuffled.split(per_minibatch)):
        if i == 1:
            faults.maybe_fail("mid_update", step)
        mb_routes = (old_routes.select(order[i * per_minibatch:(i + 1) * per_minibatch])
                     if drift else None)
        hooks = None
        if replay:
            hooks = policy.replay_routes(mb_routes, capture_natural=True)
        elif drift:
            hooks = policy.record_routes()
        policy.zero_grad()
        metrics = policy.train_minibatch(minibatch, objective, routing=hooks)
        if drift:
            taken = hooks.natural_store() if replay else hooks.store()
            metrics.update(drift_metrics(policy, mb_routes, taken, minibatch, i))
        if any_rank(bool(metrics.get("faults/nonfinite_loss"))):
            applied, grad_norm = False, float("nan")
        else:  # skips non-finite gradients itself
            applied, grad_norm = policy.optimizer_step(
                corrupt_grad=lambda g: faults.corrupt("nan_grads", g))
        metrics.update({"optim/grad_norm": grad_norm, "optim/skipped": float(not applied),
                        "faults/skipped_updates": float(not applied)})
        if diagnose:
            watch = Stopwatch()
            diag = policy.routing_diagnostics(minibatch, mb_routes, cfg.loss,
                                              cfg.rollout.temperature,
                                              replay_gap=cfg.routing.replay_gap)
            if "routing/change_rate" in diag:
                diag[f"routing/change_rate/after_update_{i}"] = diag["routing/change_rate"]
            metrics.update(diag)
            diag_s += watch.elapsed()
        history.append(metrics)
    keys = set().union(*history)
    out = {k: sum(h[k] for h in history if k in h) / sum(k in h for h in history) for k in keys}
    out["optim/lr"] = policy.lr
    if diagnose:
        out["perf/routing_diagnostics_s"] = diag_s
    return out


def drift_metrics(policy: Policy, old_routes, taken_routes, minibatch: PolicyBatch,
                  i: int) -> dict[str, float]:
    """``routing/drift/*`` of minibatch ``i`` from the routes its training forward took."""
    rate, per_layer = policy.route_drift(old_routes, taken_routes, minibatch.response_mask)
    out = {f"routing/drift/after_{i}_updates": rate}
    if i >= 1:
        out["routing/drift/change_rate"] = rate
        out.update({f"routing/drift/change_rate/layer_{layer}": v
                    for layer, v in enumerate(per_layer)})
    return out


def sft_stage(policy: Policy, samples: list, cfg: TrainConfig, groups: ParallelGroups, pack,
              log) -> None:
    """Supervised warm-up on prompt -> answer + EOS (``samples``: ``input_ids``/``prompt_len``)
    through the policy's own minibatch update, with a fresh optimizer (RL's Adam state and LR
    schedule start untouched afterwards)."""
    optim = OptimConfig(lr=cfg.sft.lr, lr_warmup_steps=min(10, cfg.sft.steps), weight_decay=0.0,
                        clip_grad=1.0)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    per_rank = cfg.sft.batch_size // groups.dp_size
    objective = NLLObjective()
    with policy.temporary_optimizer(optim, cfg.sft.steps):
        for step in range(cfg.sft.steps):
            idx = torch.randint(len(samples), (cfg.sft.batch_size,), generator=gen)
            idx = idx[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank].tolist()
            batch = pack([samples[i].input_ids for i in idx], [samples[i].prompt_len for i in idx])
            policy.zero_grad()
            metrics = policy.train_minibatch(batch, objective)
            policy.optimizer_step()
            if step % 50 == 0 or step == cfg.sft.steps - 1:
                log(f"sft step {step}: nll {metrics.get('loss/sft_nll', float('nan')):.4f}")


# ----------------------------------------------------------------------------- trainer

class Trainer:
    """Owns the policy, data position and step. :meth:`fit` runs everything after the build;
    :meth:`rl_step` is the loop body, top to bottom."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, policy: Policy, tokenizer,
                 sampler, data: dict, reward_fn, generator: Generator, greedy: Generator,
                 reference: Policy | None = None, faults: FaultInjector | None = None,
                 sampled_eval: Generator | None = None, reward_workers=None):
        """``data``: ``{"train": [...], "eval": [...]}`` prompt examples; ``sampler`` yields the
        training prompts of each step (all DP ranks' prompts; this rank takes its slice).
        ``greedy`` decodes the held-out accuracy; ``sampled_eval`` (with
        ``evaluation.num_samples`` > 0) samples its mean@n / pass@k. ``reward_workers``: the
        reward process pool (:mod:`gspo_megatron.rewards.workers`), stopped by :meth:`close`."""
        self.cfg, self.groups, self.policy, self.reference = cfg, groups, policy, reference
        self.tokenizer, self.sampler, self.data = tokenizer, sampler, data
        self.reward_fn, self.generator, self.greedy = reward_fn, generator, greedy
        self.sampled_eval, self.reward_workers = sampled_eval, reward_workers
        self.faults = faults or FaultInjector()
        self.step = 0
        self.consecutive_faults = 0
        self._stop_signal: int | None = None
        tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
        self.pad_multiple = tp * (2 * cp if cp > 1 else 1)
        self.routes_on = cfg.routing.replay != "none" or cfg.routing.diagnostics
        self.save_dir, self.load_dir = save_dir_of(cfg)[1], resume_dir_of(cfg)[1]

    def close(self) -> None:
        """Stop what the run started outside this process (the reward workers)."""
        if self.reward_workers is not None:
            self.reward_workers.close()

    def log(self, msg: str) -> None:
        if self.groups.is_logging_rank:
            print(msg, flush=True)

    # -- the run
    def fit(self) -> dict:
        """Resume (or start from ``checkpoint.init_weights``), warm up, evaluate, train
        ``trainer.steps`` RL steps with checkpoints, evaluate again. Returns the summary (also
        written to ``<run_dir>/summary.json``); ``exit_code`` is :data:`REQUEUE_EXIT_CODE` after a
        stop signal."""
        cfg = self.cfg
        start_step = self._resume_or_init()
        if self.reference is not None:
            self.policy.copy_weights_to(self.reference)
        n = cfg.evaluation.num_samples
        shown = ((f"eval/mean@{n}", f"mean@{n}"), (f"eval/pass@{n}", f"pass@{n}")) if n else ()
        metrics_log = MetricsLogger(cfg.logging.run_dir, enabled=self.groups.is_logging_rank,
                                    progress=cfg.logging.progress,
                                    wandb_project=cfg.logging.wandb_project,
                                    resume_step=start_step - 1,  # a fresh run (-1) starts empty
                                    extra_progress=shown)
        self.install_signal_handlers()
        summary: dict = {"start_step": start_step}
        if start_step == 0 and cfg.sft.steps > 0:
            watch = Stopwatch()
            self.warm_up()
            summary["sft_s"] = watch.elapsed()
            # Reusable as checkpoint.init_weights: RL experiments from the same warm start.
            self.policy.save_weights(os.path.join(cfg.logging.run_dir, "sft_weights"))
        if self.data["eval"] and start_step == 0:
            summary["accuracy_before"] = self.evaluate()
            self.log(f"held-out accuracy before RL: {summary['accuracy_before']:.3f}")
            summary.update(self._sampled_eval_summary("before"))
        exit_code = 0
        while self.step < cfg.trainer.steps:
            metrics = self.rl_step()
            if cfg.trainer.eval_interval and self.step % cfg.trainer.eval_interval == 0 \
                    and self.data["eval"] and self.step < cfg.trainer.steps:
                metrics["eval/accuracy"] = self.evaluate()
                metrics.update(self.evaluate_sampled())
            stop = self.stop_requested()
            if stop or (cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0):
                metrics["perf/checkpoint_s"] = self.save()
            metrics_log.log(self.step - 1, metrics)
            if stop:
                self.log(f"stop signal: checkpoint at step {self.step} written; exiting for requeue")
                exit_code = REQUEUE_EXIT_CODE
                break
        else:
            if self.step > start_step:
                self.save()
            if self.data["eval"]:
                summary["accuracy_after"] = self.evaluate()
                self.log(f"held-out accuracy after RL: {summary['accuracy_after']:.3f}")
                summary.update(self._sampled_eval_summary("after"))
        summary.update(steps=self.step, exit_code=exit_code)
        if self.groups.is_logging_rank:
            with open(os.path.join(cfg.logging.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        metrics_log.close()
        return summary

    def _resume_or_init(self) -> int:
        """The latest checkpoint in ``load_dir`` if any (weights, optimizer, RNG, data position),
        else ``checkpoint.init_weights`` if set. Returns the step to start from."""
        if self.policy.has_checkpoint(self.load_dir):
            self.step, extra = self.policy.load_checkpoint(self.load_dir)
            self.sampler.load_state_dict(extra["sampler"])
            self.log(f"resumed from {self.load_dir} at step {self.step}")
        elif self.cfg.checkpoint.init_weights:
            self.policy.load_weights(self.cfg.checkpoint.init_weights)
        return self.step

    def save(self) -> float:
        """Checkpoint the current step; returns the seconds it took."""
        watch = Stopwatch()
        self.policy.save_checkpoint(self.save_dir, self.step, {"sampler": self.sampler.state_dict()},
                                    keep_last=self.cfg.checkpoint.keep_last,
                                    before_commit=lambda s: self.faults.maybe_fail("checkpoint_write", s))
        return watch.elapsed()

    def warm_up(self) -> None:
        from gspo_megatron.data import sft_samples

        train = self.data["train"]
        samples = sft_samples(self.tokenizer, train[: self.cfg.sft.num_examples or len(train)])
        sft_stage(self.policy, samples, self.cfg, self.groups, self.pack, self.log)

    # -- the loop body, top to bottom
    def rl_step(self) -> dict[str, float]:
        cfg, g, faults = self.cfg, self.groups, self.faults
        seed = cfg.trainer.seed + 1000 * self.step + g.dp_rank
        faults.step = self.step
        faults.maybe_fail("step_start")
        watch = Stopwatch()

        sampled = self.sample(seed, watch)
        if not isinstance(sampled, StepSamples):  # (fault, reward metrics): non-finite values
            return self._skip_step(*sampled, watch)
        samples = sampled.samples
        batch = batch_stage(samples, sampled.advantages, self.pack)

        # Old policy's MoE routes (for the replay, the free routing/drift/* metrics and the
        # diagnostics): with R3 this pass replays the rollout engine's routes (the routers' own
        # choice captured beside them), with R2 or diagnostics it records its own.
        rollout_routes = (self.policy.rollout_routes(samples, batch.seq_length)
                          if cfg.routing.records_rollout_routes else None)
        if cfg.routing.replay == "r3":
            hooks = self.policy.replay_routes(rollout_routes, capture_natural=True)
        else:
            hooks = self.policy.record_routes() if self.routes_on else None
        train_lp = self.policy.logprobs(batch, temperature=cfg.rollout.temperature, routing=hooks)
        if train_lp is not None:
            train_lp = faults.corrupt("nan_logprobs", train_lp)
        if not all_finite(train_lp, batch.response_mask):
            return self._skip_step("faults/nonfinite_logprobs", sampled.metrics, watch)
        extra: dict[str, float] = {}
        if cfg.routing.replay == "r3":
            old_routes, trainer_routes = hooks.replayed_store(), hooks.natural_store()
        else:
            old_routes = trainer_routes = hooks.store() if hooks is not None else None
        if rollout_routes is not None:
            extra.update(self.policy.rollout_disagreement(rollout_routes, trainer_routes, batch,
                                                          train_lp))
        if train_lp is not None:
            extra["kl/rollout_vs_train"] = rollout_mismatch(train_lp, batch.rollout_logprobs,
                                                            batch.response_mask)
            batch.old_logprobs = (batch.rollout_logprobs if cfg.trainer.old_logprobs == "rollout"
                                  else train_lp)
        if self.reference is not None:
            batch.ref_logprobs = self.reference.logprobs(batch, temperature=cfg.rollout.temperature)
        watch.lap("perf/old_logprobs_s")

        update_metrics = update_stage(self.policy, batch, cfg, seed, self.step,
                                      old_routes=old_routes, faults=faults)
        watch.lap("perf/update_s")
        self._count_faults(update_metrics.get("faults/skipped_updates", 0.0) > 0)
        self.step += 1

        lengths = [len(s.response_ids) for s in samples]
        timings = watch.total("perf/step_s")
        timings["perf/rollout_tokens_per_s"] = (sampled.generated_tokens
                                                / max(timings["perf/rollout_s"], 1e-9))
        eos = sum(s.finish_reason == "eos" for s in samples) / len(samples)
        metrics = {**sampled.metrics, **extra, **update_metrics, **timings,
                   **device_memory_metrics(),
                   "response/mean_length": sum(lengths) / len(samples),
                   "response/eos_fraction": eos,
                   "response/max_length": float(max(lengths)),
                   # cut at rollout.max_new_tokens (verl's response_length/clip_ratio)
                   "response/clip_rate": 1.0 - eos}
        return gather_on_logging_rank(metrics, g)

    def sample(self, seed: int, watch: Stopwatch) -> StepSamples | tuple[str, dict]:
        """prompts -> rollout -> reward (+ overlong penalty) -> advantages for one step. With
        ``dynamic_sampling.enabled``, more rollout batches follow while any data-parallel rank has
        fewer than ``rollout.prompts_per_step`` groups whose rewards differ (at most
        ``max_extra_batches``; every rank rolls out each batch, so collectives stay in
        lock-step), and :func:`~gspo_megatron.algorithms.dapo.select_groups` picks the groups.
        Returns the step's groups, or ``(fault, reward metrics)`` when rewards or advantages are
        not finite (the caller skips the step)."""
        cfg, group = self.cfg, self.cfg.rollout.group_size
        ds, ol = cfg.dynamic_sampling, cfg.overlong
        batches: list[tuple[list, list, torch.Tensor, torch.Tensor]] = []
        metrics: dict[str, float] = {}
        generated = 0
        while True:
            b = len(batches)
            prompts = self._local_prompts(self.sampler.next_batch())
            samples = rollout_stage(self.generator, self.tokenizer, prompts, group,
                                    seed + EXTRA_BATCH_SEED_STRIDE * b)
            generated += sum(len(s.response_ids) for s in samples)
            watch.lap("perf/rollout_s")
            rewards, stats = reward_stage(self.reward_fn, self.tokenizer, prompts, samples, group,
                                          cfg.reward.timeout_s, self.reward_workers)
            rewards = overlong_stage(rewards, samples, cfg.rollout.max_new_tokens,
                                     ol.buffer_tokens, ol.penalty_factor)
            rewards = self.faults.corrupt("nan_rewards", rewards)
            watch.lap("perf/reward_s")
            if not all_finite(rewards):
                return "faults/nonfinite_rewards", stats
            advantages, adv_metrics, tied = advantage_stage(rewards, group,
                                                            cfg.trainer.normalize_advantage_std)
            if ol.mask_truncated:  # DAPO overlong filtering: no policy term for cut responses
                advantages = mask_truncated(advantages, torch.tensor(
                    [s.finish_reason == "length" for s in samples]))
            if b == 0:  # reward/* describe the nominal batch, as without dynamic sampling
                metrics = {**stats, **adv_metrics}
            batches.append((prompts, samples, advantages, tied))
            if not ds.enabled or b >= ds.max_extra_batches:
                break
            varied = sum(int((~t).sum()) for *_, t in batches)
            if not any_rank(varied < cfg.rollout.prompts_per_step):
                break
        if ds.enabled:
            prompts, samples, advantages, ds_metrics = self._select_groups(batches)
            metrics.update(ds_metrics)
        advantages = self.faults.corrupt("nan_advantages", advantages)
        if not all_finite(advantages):
            return "faults/nonfinite_advantages", metrics
        return StepSamples(prompts, samples, advantages, metrics, generated)

    def _select_groups(self, batches: list) -> tuple[list, list, torch.Tensor, dict[str, float]]:
        """The ``prompts_per_step`` groups a dynamic-sampling step trains on, and ``sampling/*``
        (counts summed over data-parallel ranks)."""
        group, need = self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
        sel = select_groups([tied for *_, tied in batches], need)
        prompts = [batches[b][0][g] for b, g in sel.chosen]
        samples = [s for b, g in sel.chosen for s in batches[b][1][g * group:(g + 1) * group]]
        advantages = torch.cat([batches[b][2][g * group:(g + 1) * group] for b, g in sel.chosen])
        counts = torch.tensor([sel.kept, sel.filled, sel.dropped, sel.surplus], dtype=torch.float64)
        all_reduce_(counts, self.groups.dp_group)
        kept, filled, dropped, surplus = counts.tolist()
        extra = (len(batches) - 1) * need * group * self.groups.dp_size
        return prompts, samples, advantages, {
            "sampling/rollout_batches": float(len(batches)),
            "sampling/extra_rollouts": float(extra),
            "sampling/kept_groups": kept, "sampling/filled_groups": filled,
            "sampling/dropped_groups": dropped, "sampling/surplus_groups": surplus}

    # -- non-finite guard
    def _skip_step(self, fault: str, reward_metrics: dict, watch: Stopwatch) -> dict:
        """Give up this step before any update: weights, optimizer and schedule stay untouched."""
        logger.warning("step %d: %s; skipping the update", self.step, fault)
        self._count_faults(True)
        self.step += 1
        metrics = {k: v for k, v in reward_metrics.items() if k in ("reward/errors", "reward/timeouts")}
        metrics.update(watch.total("perf/step_s"))
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
        examples = self.data["eval"][: max_examples or len(self.data["eval"])]
        local = examples[self.groups.dp_rank:: self.groups.dp_size]
        samples = rollout_stage(self.greedy, self.tokenizer, local, 1, seed=0)
        _, stats = reward_stage(self.reward_fn, self.tokenizer, local, samples, 1,
                                self.cfg.reward.timeout_s, self.reward_workers)
        correct = torch.tensor([stats["reward/accuracy"] * len(local), len(local)],
                               dtype=torch.float64)
        all_reduce_(correct, self.groups.dp_group)
        return float(correct[0] / correct[1].clamp(min=1))

    def evaluate_sampled(self) -> dict[str, float]:
        """``eval/mean@n`` and ``eval/pass@k`` (k = 1, 2, 4, ..., n; the unbiased estimator of
        :mod:`~gspo_megatron.algorithms.pass_at_k`) from ``evaluation.num_samples`` = n responses
        per held-out prompt, sampled at ``evaluation.temperature`` / ``top_p`` with a fixed seed;
        averaged over every held-out prompt (all data-parallel ranks). Empty when off."""
        n = self.cfg.evaluation.num_samples
        if not n or self.sampled_eval is None or not self.data["eval"]:
            return {}
        local = self.data["eval"][self.groups.dp_rank:: self.groups.dp_size]
        samples = rollout_stage(self.sampled_eval, self.tokenizer, local, n,
                                seed=self.cfg.evaluation.seed + self.groups.dp_rank)
        rewards, _ = reward_stage(self.reward_fn, self.tokenizer, local, samples, n,
                                  self.cfg.reward.timeout_s, self.reward_workers)
        from gspo_megatron.rewards import is_correct

        correct = torch.tensor([is_correct(float(r)) for r in rewards]).view(-1, n).sum(1)
        sums = all_reduce_(sampled_eval_metrics(correct, n), self.groups.dp_group)
        count = float(sums[0].clamp(min=1))
        out = {f"eval/mean@{n}": float(sums[1]) / count}
        out.update({f"eval/pass@{k}": float(v) / count
                    for k, v in zip(pass_at_k_ladder(n), sums[2:])})
        return out

    def _sampled_eval_summary(self, when: str) -> dict[str, float]:
        """The sampled evaluation for ``summary.json`` (``eval/pass@4_before`` ...), logged."""
        result = self.evaluate_sampled()
        if result:
            self.log(f"held-out sampled evaluation {when} RL: " + ", ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in result.items()))
        return {f"{k}_{when}": v for k, v in result.items()}

    # -- helpers
    def pack(self, sequences: list[list[int]], prompt_lengths: list[int]) -> PolicyBatch:
        """Right-pad token lists into a :class:`PolicyBatch`: to a multiple of TP x 2CP (sequence
        and context sharding), and to ``model.seq_length`` under pipeline parallelism (one
        activation shape for every microbatch of a run)."""
        return make_policy_batch(sequences, prompt_lengths, self.tokenizer.pad_id,
                                 pad_to_multiple_of=self.pad_multiple,
                                 seq_length=self.cfg.model.seq_length if self.groups.pp_size > 1 else None)

    def _local_prompts(self, global_prompts: list) -> list:
        per_rank = self.cfg.rollout.prompts_per_step
        start = self.groups.dp_rank * per_rank
        return global_prompts[start: start + per_rank]

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1: finish the current step, checkpoint, exit with REQUEUE_EXIT_CODE."""
        def handler(signum, frame):
            self._stop_signal = signum
            logger.warning("received signal %d: will checkpoint after this step and exit", signum)

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def stop_requested(self) -> bool:
        """Whether any rank received a stop signal (agreed by all ranks, so they stop together)."""
        return any_rank(self._stop_signal is not None)
