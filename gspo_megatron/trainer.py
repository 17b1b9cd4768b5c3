"""The RL loop: prompts -> rollout -> reward -> advantages -> old log-probs -> minibatch updates ->
log -> checkpoint.

Each stage is a plain function of explicit inputs (:mod:`gspo_megatron.stages`);
:class:`Trainer` owns the state (policy, data position, step) and :meth:`Trainer.fit` the run:
resume, the optional supervised warm-up, evaluation, checkpoints, stop signals and the loop. The
trainer talks to a :class:`~gspo_megatron.policy.Policy` and a :class:`~gspo_megatron.policy.Generator`
only: it imports nothing from megatron (``tests/unit/test_boundaries.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gspo_megatron.algorithms import rollout_mismatch
from gspo_megatron.algorithms.dapo import mask_truncated, select_groups
from gspo_megatron.algorithms.pass_at_k import pass_at_k_ladder, sampled_eval_metrics
from gspo_megatron.config import TrainConfig
from gspo_megatron.config.paths import resume_dir_of, save_dir_of
from gspo_megatron.distributed import ParallelGroups, all_reduce_, any_rank, gather_on_logging_rank
from gspo_megatron.faults import FaultInjector
from gspo_megatron.metrics import MemoryPeaks, MetricsLogger, Stopwatch
from gspo_megatron.rollouts.remote import RemoteRollouts
from gspo_megatron.rollouts.partial import PartialRollouts
from gspo_megatron.policy import (RANK_STATE_KEY, Generator, Policy, PolicyBatch,
                                  make_policy_batch)
from gspo_megatron.stages import (SkipStep, StepSamples, advantage_stage, all_finite, balance_stage,
                                  batch_stage, overlong_stage, prompt_ids, response_metrics,
                                  reward_stage, rollout_stage, sft_stage, update_stage)

logger = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75
"""Exit code after a SIGTERM/SIGUSR1 checkpoint (EX_TEMPFAIL): launch scripts requeue on it."""


EXTRA_BATCH_SEED_STRIDE = 1_000_000_007
"""Dynamic sampling: extra rollout batch ``b`` of a step samples with the step's seed plus ``b``
times this (batch 0 keeps the step's seed, so runs without dynamic sampling are unchanged)."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had NaN/Inf; the run stops, the last checkpoint is untouched."""


@dataclass
class Task:
    """What a run learns from: prompts, the tokenizer that encodes them and the reward."""

    tokenizer: Any
    """Encodes prompts (with their chat template) and decodes responses for the reward."""
    sampler: Any
    """Yields each step's training prompts, all data-parallel ranks' (this rank takes its
    slice); its ``state_dict`` is checkpointed (:class:`gspo_megatron.data.PromptSampler`)."""
    train: list
    """Training prompt examples (the supervised warm-up reads them too)."""
    eval: list
    """Held-out prompt examples (greedy accuracy, sampled mean@n / pass@k)."""
    reward_fn: Callable
    """The reward (:func:`gspo_megatron.rewards.get_reward_fn`)."""
    reward_workers: Any = None
    """The reward process pool (:mod:`gspo_megatron.rewards.workers`), stopped by
    :meth:`Trainer.close`; None: rewards run in this process."""


class Trainer:
    """Owns the policy, data position and step. :meth:`fit` runs everything after the build;
    :meth:`rl_step` is the loop body, top to bottom."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, policy: Policy,
                 generator: Generator, task: Task, reference: Policy | None = None,
                 faults: FaultInjector | None = None):
        """``generator`` samples the rollouts at ``rollout``'s settings; the held-out greedy
        accuracy and (with ``evaluation.num_samples`` > 0) the sampled mean@n / pass@k use the
        same engine with other sampling settings. ``reference``: the frozen policy of the KL
        term (``trainer.reference_model``)."""
        self.cfg, self.groups, self.policy, self.reference = cfg, groups, policy, reference
        self.task, self.generator = task, generator
        self.greedy = generator.with_sampling(
            dataclasses.replace(cfg.rollout, temperature=1.0, top_k=1, top_p=1.0))
        ev = cfg.evaluation
        self.sampled_eval = generator.with_sampling(dataclasses.replace(
            cfg.rollout, temperature=ev.temperature, top_p=ev.top_p, top_k=0)
        ) if ev.num_samples else None
        self.faults = faults or FaultInjector()
        self.step = 0
        self.saved_step: int | None = None
        """The step of the latest checkpoint this process started (committed or in flight)."""
        self.consecutive_faults = 0
        self._stop_signal: int | None = None
        tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
        self.pad_multiple = tp * (2 * cp if cp > 1 else 1)
        # Packed microbatches follow each rank's tokens: even those out (padded ones are equal).
        self.balances_ranks = (cfg.trainer.balance_data_parallel and groups.dp_size > 1
                               and cfg.trainer.max_tokens_per_microbatch is not None)
        self.save_dir, self.load_dir = save_dir_of(cfg)[1], resume_dir_of(cfg)[1]
        self.rollouts: RemoteRollouts | None = None
        """``rollout.placement: separate``: the rollout ranks' end (:mod:`gspo_megatron.rollouts.remote`);
        None: this rank rolls out itself."""
        self._rank_state: dict | None = None
        """This rank's part of the checkpoint resumed from (in-flight rollouts)."""
        ro = cfg.rollout
        self.partial = (PartialRollouts(ro.group_size, ro.prompts_per_step, ro.in_flight(),
                                        ro.max_new_tokens, ro.partial_max_age,
                                        ro.partial_keep_kv, self._follows_checkpoint
                                        if ro.placement == "separate" else None)
                        if ro.partial_rollouts else None)
        """``rollout.partial_rollouts``: this rank's groups in flight between steps."""

    def _follows_checkpoint(self, step: int) -> bool:
        """``rollout.placement: separate``: whether the rollout of ``step`` is the first one a run
        resumed from a ``checkpoint.save_interval`` checkpoint runs (a checkpoint after ``s``
        steps keeps the samples of steps ``s .. s + k - 1`` already rolled out: the resumed
        rollout rank starts at ``s + k``)."""
        every, saved = self.cfg.checkpoint.save_interval, step - self.cfg.rollout.max_staleness
        return bool(every) and 0 < saved < self.cfg.trainer.steps and saved % every == 0

    def close(self) -> None:
        """Stop what the run started outside this process: the reward workers, and the writer of
        a background checkpoint that was not committed (only after an error: :meth:`fit` commits
        every checkpoint it starts)."""
        self.policy.abort_checkpoint()
        if self.rollouts is not None:  # after an error: the rollout ranks must not wait on
            self.rollouts.close()
        if self.task.reward_workers is not None:
            self.task.reward_workers.close()

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
        if self.reference is not None:
            self._init_reference(start_step)
        if self.task.eval and start_step == 0:
            summary["accuracy_before"] = self.evaluate()
            self.log(f"held-out accuracy before RL: {summary['accuracy_before']:.3f}")
            summary.update(self._sampled_eval_summary("before"))
        try:
            exit_code = self._train(start_step, metrics_log, summary)
        except NonFiniteError:
            self.commit_checkpoint()  # the last good checkpoint stays the one to resume from
            raise
        summary.update(steps=self.step, exit_code=exit_code)
        if self.groups.is_logging_rank:
            with open(os.path.join(cfg.logging.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        metrics_log.close()
        return summary

    def _train(self, start_step: int, metrics_log: MetricsLogger, summary: dict) -> int:
        """The RL loop with its checkpoints, then the final save and evaluation; returns the exit
        code. Every checkpoint it starts is committed before it returns."""
        cfg = self.cfg
        self.start_rollouts()
        while self.step < cfg.trainer.steps:
            metrics = self.rl_step()
            if cfg.trainer.eval_interval and self.step % cfg.trainer.eval_interval == 0 \
                    and self.task.eval and self.step < cfg.trainer.steps:
                metrics["eval/accuracy"] = self.evaluate()
                metrics.update(self.evaluate_sampled())
            stop = self.stop_requested()
            if stop or (cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0):
                metrics["perf/checkpoint_s"] = self.save()
            if self.rollouts is not None:
                watch = Stopwatch()
                self.publish_weights(stop=stop)
                metrics["perf/publish_weights_s"] = watch.elapsed()
            metrics_log.log(self.step - 1, metrics)
            if stop:
                self.commit_checkpoint()
                self.log(f"stop signal: checkpoint at step {self.step} written; exiting for requeue")
                return REQUEUE_EXIT_CODE
        if self.step > start_step:
            self.save()  # the final weights (written while the held-out set is evaluated)
        if self.task.eval:
            summary["accuracy_after"] = self.evaluate()
            self.log(f"held-out accuracy after RL: {summary['accuracy_after']:.3f}")
            summary.update(self._sampled_eval_summary("after"))
        self.commit_checkpoint()
        return 0

    def _resume_or_init(self) -> int:
        """The latest checkpoint in ``load_dir`` if any (weights, optimizer, RNG, data position),
        else ``checkpoint.init_weights`` if set. Returns the step to start from."""
        if self.policy.has_checkpoint(self.load_dir):
            self.step, extra = self.policy.load_checkpoint(self.load_dir)
            self.task.sampler.load_state_dict(extra["sampler"])
            self._rank_state = extra.get(RANK_STATE_KEY)
            if self.partial is not None and self.rollouts is None:  # (separate: the rollout
                self.partial.load_state_dict(self._rank_state["partial"])  # ranks hold it)
            self.log(f"resumed from {self.load_dir} at step {self.step}")
        elif self.cfg.checkpoint.init_weights:
            self.policy.load_weights(self.cfg.checkpoint.init_weights)
        return self.step

    def _init_reference(self, start_step: int) -> None:
        """The KL reference is the policy RL starts from: the weights after the warm-up (or
        ``init_weights``), saved once as ``<save_dir>/reference_weights`` so that a resumed run
        loads them instead of copying the policy it resumes."""
        path = os.path.join(self.save_dir, "reference_weights")
        if start_step == 0:
            self.policy.copy_weights_to(self.reference)
            self.reference.save_weights(path)
            return
        resumed = os.path.join(self.load_dir, "reference_weights")
        # (a checkpoint without them: the backend's CheckpointError names the directory)
        self.reference.load_weights(resumed if os.path.isdir(resumed) else path)

    def save(self) -> float:
        """Checkpoint the current step (once: a second call for the same step does nothing);
        returns the seconds the step was stalled (with ``checkpoint.async_save``, building the
        state dict and forking the writer; :meth:`commit_checkpoint` finishes it)."""
        if self.saved_step == self.step:
            return 0.0
        watch = Stopwatch()
        extra = {"sampler": self.task.sampler.state_dict()}
        if self.rollouts is not None:  # the rollouts in flight (received now), per rank
            extra[RANK_STATE_KEY] = self.rollouts.state(self.step)
        elif self.partial is not None:  # this rank's unfinished groups
            extra[RANK_STATE_KEY] = {"partial": self.partial.checkpoint_state()}
        self.policy.save_checkpoint(self.save_dir, self.step, extra,
                                    keep_last=self.cfg.checkpoint.keep_last,
                                    before_commit=lambda s: self.faults.maybe_fail("checkpoint_write", s),
                                    background=self.cfg.checkpoint.async_save)
        self.saved_step = self.step
        return watch.elapsed()

    def commit_checkpoint(self) -> float:
        """Wait for a background checkpoint and make it the latest; the seconds waited."""
        return self.policy.wait_for_checkpoint()

    def warm_up(self) -> None:
        from gspo_megatron.data import sft_samples

        train = self.task.train
        samples = sft_samples(self.task.tokenizer, train[: self.cfg.sft.num_examples or len(train)])
        sft_stage(self.policy, samples, self.cfg, self.groups, self.pack, self.log)

    # -- the loop body, top to bottom
    def rl_step(self) -> dict[str, float]:
        cfg, g, faults = self.cfg, self.groups, self.faults
        seed = self._sampling_seed(self.step)
        faults.step = self.step
        faults.maybe_fail("step_start")
        watch = Stopwatch()
        memory = MemoryPeaks()

        rollout_perf: dict[str, float] = {}
        try:
            if self.rollouts is None:
                sampled = self.sample(seed, watch)
            else:
                sampled, rollout_perf = self._take_rollouts(watch)
        except SkipStep as skip:
            return self._skip_step(skip.fault, skip.metrics, watch)
        memory.phase("perf/rollout_peak_mem_gib")  # gspo-plan's "rollout peak" (KV cache in)
        samples, advantages, minibatch_sizes, extra = sampled.samples, sampled.advantages, None, {}
        if self.balances_ranks:
            samples, advantages, minibatch_sizes, extra = balance_stage(
                samples, advantages, cfg.trainer.num_minibatches, seed, g)
            watch.lap("perf/balance_s")
        batch = batch_stage(samples, advantages, self.pack)

        # MoE routes of the old-policy pass (replayed from the rollout under R3, recorded
        # otherwise) and of every update: the policy's routing decides (None: no routing work).
        policy_routing = self.policy.routing
        routing = (policy_routing.start_step(batch, samples, self.step)
                   if policy_routing is not None else None)
        train_lp = self.policy.logprobs(batch, temperature=cfg.rollout.temperature,
                                        routing=routing.old_pass() if routing else None)
        if train_lp is not None:
            train_lp = faults.corrupt("nan_logprobs", train_lp)
        if not all_finite(train_lp, batch.response_mask):
            return self._skip_step("faults/nonfinite_logprobs", sampled.metrics, watch)
        if routing:
            extra.update(routing.after_old_pass(train_lp))
        if train_lp is not None:
            extra["kl/rollout_vs_train"] = rollout_mismatch(train_lp, batch.rollout_logprobs,
                                                            batch.response_mask)
            batch.old_logprobs = (batch.rollout_logprobs if cfg.trainer.old_logprobs == "rollout"
                                  else train_lp)
        if self.reference is not None:
            batch.ref_logprobs = self.reference.logprobs(batch, temperature=cfg.rollout.temperature)
        watch.lap("perf/old_logprobs_s")

        # A background checkpoint of an earlier step was written during this step's rollout; it
        # becomes the latest before the weights change again (a crash from here on resumes from it).
        self.commit_checkpoint()
        watch.lap("perf/checkpoint_wait_s")
        update_metrics = update_stage(self.policy, batch, cfg, seed, self.step, routing=routing,
                                      faults=faults, minibatch_sizes=minibatch_sizes)
        watch.lap("perf/update_s")
        memory.phase("perf/train_peak_mem_gib")  # gspo-plan's "training peak"
        self._count_faults(update_metrics.get("faults/skipped_updates", 0.0) > 0)
        self.step += 1

        timings = {**watch.total("perf/step_s"), **rollout_perf}
        timings["perf/rollout_tokens_per_s"] = (sampled.generated_tokens
                                                / max(timings["perf/rollout_s"], 1e-9))
        metrics = {**sampled.metrics, **extra, **update_metrics, **timings,
                   **memory.metrics(), **response_metrics(samples, g)}
        return gather_on_logging_rank(metrics, g)

    def _sampling_seed(self, step: int) -> int:
        """The seed of step ``step``'s rollouts on this data-parallel rank (the same whichever
        rank samples them: colocated, or a rollout rank of ``placement: separate``)."""
        return self.cfg.trainer.seed + 1000 * step + self.groups.dp_rank

    # -- rollouts on their own ranks (rollout.placement: separate)
    def start_rollouts(self) -> None:
        """Tell the rollout ranks where training starts (with what was in flight at the
        checkpoint resumed from) and send them the weights of this step."""
        if self.rollouts is None:
            return
        dp_ranks = [None] * self.groups.world_size
        torch.distributed.all_gather_object(dp_ranks, self.groups.dp_rank)
        # Nothing in flight (a fresh run, or a colocated checkpoint): the rollouts go on from
        # this step with the sampler where this rank's is.
        state = self._rank_state or {"received": {}, "sampler": self.task.sampler.state_dict()}
        partial_states = [None] * self.groups.world_size  # each DP rank's groups in flight
        torch.distributed.all_gather_object(partial_states, state.get("partial"))
        self.rollouts.start(self.step, state, dp_ranks, partial_states)
        self.publish_weights(stop=False)

    def publish_weights(self, stop: bool) -> None:
        """The weights after this step's optimizer step (version ``self.step``) to the rollout
        ranks, or a stop once training ends (collective over the trainer ranks)."""
        if self.rollouts is None:
            return
        stop = stop or self.step >= self.cfg.trainer.steps
        self.rollouts.publish(None if stop else self.policy.export_weights(), self.step, stop)
        if stop:
            self.rollouts.bridge.flush()

    def _take_rollouts(self, watch: Stopwatch) -> tuple[StepSamples, dict[str, float]]:
        """This step's samples from the rollout ranks (raises their :class:`SkipStep`) and their
        ``perf/*`` (the rollout ranks' seconds), plus ``sampling/staleness`` (optimizer steps
        between the sampling weights and these) and ``perf/rollout_wait_s`` (this rank idle)."""
        msg = self.rollouts.take(self.step)
        watch.lap("perf/rollout_wait_s")
        if "skip" in msg:
            raise SkipStep(*msg["skip"])
        sampled: StepSamples = msg["samples"]
        perf = dict(msg["perf"])
        self.task.sampler.load_state_dict(msg["sampler"])  # where the colocated loop's would be
        sampled.metrics["sampling/staleness"] = float(self.step - msg["version"])
        return sampled, perf

    def serve(self, bridge, placement) -> dict:
        """A rollout rank's whole run (:func:`~gspo_megatron.rollouts.remote.serve_rollouts`): stop
        signals are the trainer ranks' to act on (they checkpoint, then send the stop)."""
        from gspo_megatron.rollouts.remote import serve_rollouts

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: logger.info(
                "rollout rank: signal %d, the trainer ranks will stop the run", signum))
        steps = serve_rollouts(bridge, placement, self.remote_sample, self.policy.import_weights,
                               self.task.sampler, self.cfg.rollout.max_staleness,
                               self.cfg.trainer.steps, self.partial)
        return {"rollout_steps": steps, "exit_code": 0}

    def remote_sample(self, step: int) -> dict:
        """A rollout rank's body of step ``step``'s message (:func:`~gspo_megatron.rollouts.remote.
        serve_rollouts`): this data-parallel rank's samples, or the skip, and ``perf/*``."""
        seed = self._sampling_seed(step)
        self.step = self.faults.step = step  # (the step a partial rollout dates its groups by)
        self.faults.maybe_fail("rollout_sample")
        watch = Stopwatch()
        try:
            body: dict = {"samples": self.sample(seed, watch)}
        except SkipStep as skip:
            body = {"skip": (skip.fault, skip.metrics)}
        body["perf"] = {k: v for k, v in watch.laps.items() if k.startswith("perf/")}
        return body

    def sample(self, seed: int, watch: Stopwatch) -> StepSamples:
        """prompts -> rollout -> reward (+ overlong penalty) -> advantages for one step. With
        ``dynamic_sampling.enabled``, more rollout batches follow while any data-parallel rank has
        fewer than ``rollout.prompts_per_step`` groups whose rewards differ (at most
        ``max_extra_batches``; every rank rolls out each batch, so collectives stay in
        lock-step), and :func:`~gspo_megatron.algorithms.dapo.select_groups` picks the groups.
        Returns the step's groups; raises :class:`SkipStep` when rewards or advantages are not
        finite."""
        cfg, group = self.cfg, self.cfg.rollout.group_size
        ds, ol = cfg.dynamic_sampling, cfg.overlong
        batches: list[tuple[list, list, torch.Tensor, torch.Tensor]] = []
        metrics: dict[str, float] = {}
        generated = 0
        while True:
            b = len(batches)
            if self.partial is not None:  # the groups carried over, then fresh ones
                prompts, samples, partial = self.partial.rollout(
                    self.generator, lambda p: prompt_ids(self.task.tokenizer, p),
                    lambda: self._local_prompts(self.task.sampler.next_batch()), seed, self.step)
                generated += int(partial.pop("rollout/partial_generated_tokens"))
                metrics.update(partial)
            else:
                prompts = self._local_prompts(self.task.sampler.next_batch())
                samples = rollout_stage(self.generator, self.task.tokenizer, prompts, group,
                                        seed + EXTRA_BATCH_SEED_STRIDE * b)
                generated += sum(len(s.response_ids) for s in samples)
            watch.lap("perf/rollout_s")
            rewards, stats = reward_stage(self.task.reward_fn, self.task.tokenizer, prompts, samples, group,
                                          cfg.reward.timeout_s, self.task.reward_workers)
            rewards = overlong_stage(rewards, samples, cfg.rollout.max_new_tokens,
                                     ol.buffer_tokens, ol.penalty_factor)
            rewards = self.faults.corrupt("nan_rewards", rewards)
            watch.lap("perf/reward_s")
            if not all_finite(rewards):
                raise SkipStep("faults/nonfinite_rewards", stats)
            advantages, adv_metrics, tied = advantage_stage(rewards, group,
                                                            cfg.trainer.normalize_advantage_std)
            if ol.mask_truncated:  # DAPO overlong filtering: no policy term for cut responses
                advantages = mask_truncated(advantages, torch.tensor(
                    [s.finish_reason == "length" for s in samples]))
            if b == 0:  # reward/* describe the nominal batch, as without dynamic sampling
                metrics.update({**stats, **adv_metrics})
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
            raise SkipStep("faults/nonfinite_advantages", metrics)
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
        examples = self.task.eval[: max_examples or len(self.task.eval)]
        local = examples[self.groups.dp_rank:: self.groups.dp_size]
        samples = rollout_stage(self.greedy, self.task.tokenizer, local, 1, seed=0)
        _, stats = reward_stage(self.task.reward_fn, self.task.tokenizer, local, samples, 1,
                                self.cfg.reward.timeout_s, self.task.reward_workers)
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
        if not n or self.sampled_eval is None or not self.task.eval:
            return {}
        local = self.task.eval[self.groups.dp_rank:: self.groups.dp_size]
        samples = rollout_stage(self.sampled_eval, self.task.tokenizer, local, n,
                                seed=self.cfg.evaluation.seed + self.groups.dp_rank)
        rewards, _ = reward_stage(self.task.reward_fn, self.task.tokenizer, local, samples, n,
                                  self.cfg.reward.timeout_s, self.task.reward_workers)
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
        return make_policy_batch(sequences, prompt_lengths, self.task.tokenizer.pad_id,
                                 pad_to_multiple_of=self.pad_multiple,
                                 seq_length=self.cfg.model.seq_length if self.groups.pp_size > 1
                                 else None)

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
