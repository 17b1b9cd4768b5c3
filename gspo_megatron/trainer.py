"""The RL loop: prompts -> rollout -> reward -> advantages -> old log-probs -> minibatch updates ->
log -> checkpoint.

Each stage is a plain function of explicit inputs (:mod:`gspo_megatron.stages`);
:class:`Trainer` owns the state (policy, data position, step) and :meth:`Trainer.fit` the run:
resume, the optional supervised warm-up, evaluation, checkpoints, stop signals and the loop. The
trainer talks to a :class:`~gspo_megatron.policy.Policy` and a :class:`~gspo_megatron.policy.Generator`
only: it imports nothing from megatron (``tests/unit/test_boundaries.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
from typing import Iterator

import torch

from gspo_megatron.algorithms import rollout_mismatch
from gspo_megatron.algorithms.objectives import stale_mask, tokens_differ
from gspo_megatron.algorithms.pass_at_k import pass_at_k_ladder, sampled_eval_metrics
from gspo_megatron.config import TrainConfig, token_budget
from gspo_megatron.config.paths import resume_dir_of, save_dir_of
from gspo_megatron.distributed import ParallelGroups, all_reduce_, any_rank, gather_on_logging_rank
from gspo_megatron.faults import FaultInjector
from gspo_megatron.gc_watch import GcWatch
from gspo_megatron.memory_profile import MemoryProfile
from gspo_megatron.metrics import MemoryPeaks, MetricsLogger, Stopwatch
from gspo_megatron.progress import Progress
from gspo_megatron.policy import (RANK_STATE_KEY, Generator, Policy, PolicyBatch,
                                  make_policy_batch)
from gspo_megatron.rollouts.sampling import StepSampler, step_seed
from gspo_megatron.rollouts.source import LocalRollouts, RolloutSource
from gspo_megatron.stages import (SkipStep, all_finite, balance_stage, batch_stage,
                                  response_metrics, reward_stage, rollout_stage, sft_stage,
                                  update_stage)
from gspo_megatron.task import Task

__all__ = ["NonFiniteError", "REQUEUE_EXIT_CODE", "Task", "Trainer"]

logger = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75
"""Exit code after a SIGTERM/SIGUSR1 checkpoint (EX_TEMPFAIL): launch scripts requeue on it."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had NaN/Inf; the run stops, the last checkpoint is untouched."""


class Trainer:
    """Owns the policy, data position and step. :meth:`fit` runs everything after the build;
    :meth:`rl_step` is the loop body, top to bottom."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, policy: Policy,
                 generator: Generator, task: Task, reference: Policy | None = None,
                 faults: FaultInjector | None = None, rollouts: RolloutSource | None = None):
        """``generator`` is the engine this process evaluates with: the held-out greedy
        accuracy and (with ``evaluation.num_samples`` > 0) the sampled mean@n / pass@k, and the
        step's rollouts at ``rollout``'s settings unless ``rollouts`` says where they come from
        (:mod:`gspo_megatron.rollouts`; None: this process samples them, colocated).
        ``reference``: the frozen policy of the KL term (``trainer.reference_model``)."""
        self.cfg, self.groups, self.policy, self.reference = cfg, groups, policy, reference
        self.task, self.generator = task, generator
        self.greedy = generator.with_sampling(
            dataclasses.replace(cfg.rollout, temperature=1.0, top_k=1, top_p=1.0))
        ev = cfg.evaluation
        self.sampled_eval = generator.with_sampling(dataclasses.replace(
            cfg.rollout, temperature=ev.temperature, top_p=ev.top_p, top_k=0)
        ) if ev.num_samples else None
        self.faults = faults or FaultInjector()
        self.rollouts: RolloutSource = rollouts or LocalRollouts(
            StepSampler(cfg, groups, generator, task, self.faults))
        """Where each step's samples come from (:class:`~gspo_megatron.rollouts.source.
        RolloutSource`)."""
        self.step = 0
        self.saved_step: int | None = None
        """The step of the latest checkpoint this process started (committed or in flight)."""
        self.consecutive_faults = 0
        """Steps in a row with non-finite values (checkpointed: a resumed run counts on)."""
        self._stop_signal: int | None = None
        tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
        self.pad_multiple = tp * (2 * cp if cp > 1 else 1)
        # Packed microbatches follow each rank's tokens: even those out (padded ones are equal).
        self.balances_ranks = (cfg.trainer.balance_data_parallel and groups.dp_size > 1
                               and token_budget(cfg) is not None)
        self.save_dir, self.load_dir = save_dir_of(cfg)[1], resume_dir_of(cfg)[1]
        self._rank_state: dict | None = None
        """This rank's part of the checkpoint resumed from (the rollouts in flight)."""
        self.progress: Progress | None = None
        """The RL steps' display while :meth:`fit` runs them (messages go through it)."""
        self.gc_watch: GcWatch | None = None
        """The garbage collector's time per step (``perf/gc_s``) while :meth:`fit` trains."""

    def close(self) -> None:
        """Stop what the run started outside this process: the reward workers, and the writer of
        a background checkpoint that was not committed (only after an error: :meth:`fit` commits
        every checkpoint it starts)."""
        self.policy.abort_checkpoint()
        self.rollouts.close()  # (after an error: rollout ranks must not wait on)
        if self.task.reward_workers is not None:
            self.task.reward_workers.close()
        if self.task.episodes is not None:
            self.task.episodes.close()
        if hasattr(self.task.reward_fn, "close"):  # a mix's reward model process
            self.task.reward_fn.close()

    def log(self, msg: str) -> None:
        if not self.groups.is_logging_rank:
            return
        if self.progress is not None and self.progress.enabled:
            self.progress.write(msg)  # (on a terminal, above the RL steps' live line)
        else:
            print(msg, flush=True)

    def new_progress(self, label: str, total: int, **kwargs) -> Progress:
        """A :class:`Progress` shown on the logging rank when ``logging.progress`` is on."""
        return Progress(label, total, enabled=self.groups.is_logging_rank
                        and self.cfg.logging.progress, **kwargs)

    # -- the run
    def fit(self) -> dict:
        """Resume (or start from ``checkpoint.init_weights``), warm up, evaluate, train
        ``trainer.steps`` RL steps with checkpoints, evaluate again. Returns the summary (also
        written to ``<run_dir>/summary.json``); ``exit_code`` is :data:`REQUEUE_EXIT_CODE` after a
        stop signal."""
        start_step = self._resume_or_init()
        with self.stop_signals():  # the caller's handlers back when the run ends (in-process runs)
            return self._fit_from(start_step)

    def _fit_from(self, start_step: int) -> dict:
        """:meth:`fit` after the resume: warm-up, evaluation, the RL steps, the summary."""
        cfg = self.cfg
        n = cfg.evaluation.num_samples
        shown = ((f"eval/mean@{n}", f"mean@{n}"), (f"eval/pass@{n}", f"pass@{n}")) if n else ()
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
        # (from here: the ETA counts RL steps only, not the warm-up and evaluation above)
        self.progress = self.new_progress("RL", cfg.trainer.steps, start=start_step, every=1)
        metrics_log = MetricsLogger(cfg.logging.run_dir, enabled=self.groups.is_logging_rank,
                                    progress=self.progress,
                                    wandb_project=cfg.logging.wandb_project,
                                    resume_step=start_step - 1,  # a fresh run (-1) starts empty
                                    extra_progress=shown,
                                    tensorboard_dir=cfg.logging.tensorboard_dir)
        try:
            exit_code = self._train(start_step, metrics_log, summary)
        except NonFiniteError:
            self.commit_checkpoint()  # the last good checkpoint stays the one to resume from
            raise
        finally:
            self.progress.close()
            self.progress = None
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
        self.rollouts.start(self.step, self._rank_state)
        self.rollouts.publish(self.policy, self.step, stop=False)
        memory = MemoryProfile(cfg.logging.memory_profile_steps if self.groups.is_logging_rank
                               else 0, os.path.join(cfg.logging.run_dir, "memory_profile.json"))
        self.gc_watch = GcWatch()
        with contextlib.closing(memory), contextlib.closing(self.gc_watch):
            if cfg.trainer.gc_freeze:
                self.gc_watch.freeze()  # set-up's objects out of the collector's scans
            memory.start()
            return self._train_steps(start_step, metrics_log, summary, memory)

    def _train_steps(self, start_step: int, metrics_log: MetricsLogger, summary: dict,
                     memory: MemoryProfile) -> int:
        """:meth:`_train`'s loop, the allocator's history recorded over its first steps."""
        cfg = self.cfg
        while self.step < cfg.trainer.steps:
            metrics = self.rl_step()
            memory.step_done(self.step - start_step)
            if cfg.trainer.gc_freeze and self.step == start_step + 1:
                self.gc_watch.freeze()  # and what the first step built (the engine's context)
            if cfg.trainer.eval_interval and self.step % cfg.trainer.eval_interval == 0 \
                    and self.task.eval and self.step < cfg.trainer.steps:
                metrics["eval/accuracy"] = self.evaluate()
                metrics.update(self.evaluate_sampled())
            stop = self.stop_requested()
            if stop or (cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0):
                metrics["perf/checkpoint_s"] = self.save(stop=stop)
            published = self.rollouts.publish(self.policy, self.step, stop=stop)
            if published is not None:
                metrics["perf/publish_weights_s"] = published
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
            self.step, extra = self.policy.load_checkpoint(
                self.load_dir, allow_pickle=self.cfg.checkpoint.allow_pickle)
            self.task.sampler.load_state_dict(extra["sampler"])
            self._rank_state = extra.get(RANK_STATE_KEY)
            self.consecutive_faults = int(extra.get("consecutive_faults", 0))
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

    def save(self, stop: bool = False) -> float:
        """Checkpoint the current step (once: a second call for the same step does nothing;
        ``stop``: a stop signal's, see :meth:`~gspo_megatron.rollouts.source.RolloutSource.state`);
        returns the seconds the step was stalled (with ``checkpoint.async_save``, building the
        state dict and forking the writer; :meth:`commit_checkpoint` finishes it)."""
        if self.saved_step == self.step:
            return 0.0
        watch = Stopwatch()
        extra = {"sampler": self.task.sampler.state_dict(),
                 "consecutive_faults": self.consecutive_faults,
                 RANK_STATE_KEY: self.rollouts.state(self.step, stop)}  # in flight, per rank
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

        train = self.task.train[: self.cfg.sft.num_examples or len(self.task.train)]
        episodes = self.task.episodes
        if episodes is not None and episodes.demonstrates:  # whole episodes, policy turns trained
            samples = episodes.sft_samples(train)
        else:
            samples = sft_samples(self.task.tokenizer, train)
        with self.new_progress("sft", self.cfg.sft.steps, every=50) as progress:
            sft_stage(self.policy, samples, self.cfg, self.groups, self.pack, progress)

    # -- the loop body, top to bottom
    def rl_step(self) -> dict[str, float]:
        cfg, g, faults = self.cfg, self.groups, self.faults
        seed = step_seed(cfg, self.step, g.dp_rank)
        faults.step = self.step
        faults.maybe_fail("step_start")
        faults.maybe_fail("stop_signal")
        watch = Stopwatch()
        memory = MemoryPeaks()

        try:
            # trainer.offload: the optimizer state (and gradients) wait in host memory while this
            # rank rolls out, so the KV cache has their device memory; back before any pass.
            with self.policy.training_state_offloaded() as moved:
                sampled, rollout_perf = self.rollouts.next(self.step, watch)
                memory.phase("perf/rollout_peak_mem_gib")  # gspo-plan's "rollout peak" (KV in)
        except SkipStep as skip:
            return self._skip_step(skip.fault, skip.metrics, watch)
        if moved:
            rollout_perf = {**rollout_perf, "perf/offloaded_gib": moved / 1024 ** 3}
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
            extra.update(tokens_differ(train_lp, batch.rollout_logprobs, batch.response_mask,
                                       stale_mask(samples, batch.response_mask)))
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

        timings = {**watch.total("perf/step_s"), **rollout_perf,
                   **(self.gc_watch.take() if self.gc_watch is not None else {})}
        timings["perf/rollout_tokens_per_s"] = (sampled.generated_tokens
                                                / max(timings["perf/rollout_s"], 1e-9))
        metrics = {**sampled.metrics, **extra, **update_metrics, **timings,
                   **memory.metrics(), **response_metrics(samples, g)}
        return gather_on_logging_rank(metrics, g)

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
        # (trainer.offload: its rollouts hold the KV cache as the training steps' do)
        with self.policy.training_state_offloaded(), self.new_progress("eval", len(local)) as progress:
            samples = rollout_stage(self.greedy, self.task.tokenizer, local, 1, seed=0,
                                    progress=progress.callback(), episodes=self.task.episodes)
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
        with self.policy.training_state_offloaded(), \
                self.new_progress(f"eval@{n}", len(local) * n) as progress:
            samples = rollout_stage(self.sampled_eval, self.task.tokenizer, local, n,
                                    seed=self.cfg.evaluation.seed + self.groups.dp_rank,
                                    progress=progress.callback(), episodes=self.task.episodes)
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

    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[None]:
        """For the ``with`` block, SIGTERM / SIGUSR1 finish the current step, checkpoint and exit
        with REQUEUE_EXIT_CODE; the handlers before it are put back on the way out (a run called
        in-process, as the tests do, leaves its caller's handlers as they were)."""
        def handler(signum, frame):
            self._stop_signal = signum
            logger.warning("received signal %d: will checkpoint after this step and exit", signum)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def stop_requested(self) -> bool:
        """Whether any rank received a stop signal (agreed by all ranks, so they stop together)."""
        return any_rank(self._stop_signal is not None)
