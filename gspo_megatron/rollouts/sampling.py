"""One step's samples: prompts -> rollout -> reward (+ overlong penalty) -> advantages, with
DAPO's dynamic sampling and partial rollouts. The same code runs in the trainer's process
(:class:`~gspo_megatron.rollouts.source.LocalRollouts`) and on the rollout ranks of
``rollout.placement: separate`` (:class:`~gspo_megatron.rollouts.remote.RolloutServer`), so both
placements sample the same tokens for a step."""

from __future__ import annotations

import torch

from gspo_megatron.algorithms.dapo import mask_truncated, select_groups
from gspo_megatron.config import TrainConfig
from gspo_megatron.distributed import ParallelGroups, all_reduce_, any_rank
from gspo_megatron.faults import FaultInjector
from gspo_megatron.metrics import Stopwatch
from gspo_megatron.policy import Generator
from gspo_megatron.rollouts.partial import PartialRollouts
from gspo_megatron.stages import (SkipStep, StepSamples, advantage_stage, all_finite,
                                  overlong_stage, prompt_ids, reward_stage, rollout_stage)
from gspo_megatron.task import Task

EXTRA_BATCH_SEED_STRIDE = 1_000_000_007
"""Dynamic sampling: extra rollout batch ``b`` of a step samples with the step's seed plus ``b``
times this (batch 0 keeps the step's seed, so runs without dynamic sampling are unchanged)."""


def step_seed(cfg: TrainConfig, step: int, dp_rank: int) -> int:
    """The seed of step ``step`` on data-parallel rank ``dp_rank``: its rollouts' (the same
    whichever process samples them) and its minibatch order's."""
    return cfg.trainer.seed + 1000 * step + dp_rank


class StepSampler:
    """This data-parallel rank's samples of a step. ``partial``: the rank's partial-rollout pool
    (``rollout.partial_rollouts``), built here; None when off."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, generator: Generator, task: Task,
                 faults: FaultInjector):
        self.cfg, self.groups, self.generator, self.task, self.faults = (cfg, groups, generator,
                                                                          task, faults)
        ro = cfg.rollout
        self.partial = (PartialRollouts(ro.group_size, ro.prompts_per_step, ro.in_flight(),
                                        ro.max_new_tokens, ro.partial_max_age, ro.partial_keep_kv)
                        if ro.partial_rollouts else None)

    def sample(self, step: int, watch: Stopwatch) -> StepSamples:
        """prompts -> rollout -> reward (+ overlong penalty) -> advantages for step ``step``. With
        ``dynamic_sampling.enabled``, more rollout batches follow while any data-parallel rank has
        fewer than ``rollout.prompts_per_step`` groups whose rewards differ (at most
        ``max_extra_batches``; every rank rolls out each batch, so collectives stay in
        lock-step), and :func:`~gspo_megatron.algorithms.dapo.select_groups` picks the groups.
        Laps ``perf/rollout_s`` and ``perf/reward_s`` on ``watch``. Raises :class:`SkipStep` when
        rewards or advantages are not finite."""
        cfg, task, group = self.cfg, self.task, self.cfg.rollout.group_size
        ds, ol = cfg.dynamic_sampling, cfg.overlong
        seed = step_seed(cfg, step, self.groups.dp_rank)
        batches: list[tuple[list, list, torch.Tensor, torch.Tensor]] = []
        metrics: dict[str, float] = {}
        generated = 0
        while True:
            b = len(batches)
            if self.partial is not None:  # the groups carried over, then fresh ones
                prompts, samples, partial = self.partial.rollout(
                    self.generator, lambda p: prompt_ids(task.tokenizer, p),
                    lambda: self._local_prompts(task.sampler.next_batch()), seed, step)
                generated += int(partial.pop("rollout/partial_generated_tokens"))
                metrics.update(partial)
            else:
                prompts = self._local_prompts(task.sampler.next_batch())
                samples = rollout_stage(self.generator, task.tokenizer, prompts, group,
                                        seed + EXTRA_BATCH_SEED_STRIDE * b,
                                        episodes=task.episodes,
                                        on_env_step=lambda: self.faults.maybe_fail("mid_episode"))
                generated += sum(len(s.response_ids) for s in samples)
            watch.lap("perf/rollout_s")
            if b == 0 and hasattr(self.generator, "weight_metrics"):  # rollout/fp8_weight_*
                metrics.update(self.generator.weight_metrics())
            rewards, stats = reward_stage(task.reward_fn, task.tokenizer, prompts, samples, group,
                                          cfg.reward.timeout_s, task.reward_workers)
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
        path = getattr(self.generator, "decode_path", None)
        if path is not None:  # which decoder ran (the fast step function, or Megatron's forward)
            metrics["rollout/decode_path"] = path
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

    def _local_prompts(self, global_prompts: list) -> list:
        per_rank = self.cfg.rollout.prompts_per_step
        start = self.groups.dp_rank * per_rank
        return global_prompts[start: start + per_rank]
