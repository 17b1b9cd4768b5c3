"""The stages of one RL step, each a plain function of explicit inputs (tested alone in
``tests/unit/test_trainer_stages.py``): rollout -> reward (+ overlong shaping) -> advantages ->
batch -> minibatch updates, the supervised warm-up, and the non-finite check every stage output
passes. :class:`gspo_megatron.trainer.Trainer` calls them in that order and owns the state.

They talk to a :class:`~gspo_megatron.policy.Policy` and a :class:`~gspo_megatron.policy.Generator`
only: nothing here imports megatron (``tests/unit/test_boundaries.py``).
"""

from __future__ import annotations

import math

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import NLLObjective, PolicyGradientObjective, group_advantages
from gspo_megatron.algorithms.dapo import soft_overlong_penalty
from gspo_megatron.config import OptimConfig, TrainConfig
from gspo_megatron.distributed import ParallelGroups, all_reduce_, any_rank, exchange_objects
from gspo_megatron.faults import FaultInjector
from gspo_megatron.layout import RankBalance, balance_across_ranks
from gspo_megatron.policy import (EPISODE_KEY, POLICY_MASK_KEY, Generator, Policy, PolicyBatch,
                                  RolloutSample, StepRouting)
from gspo_megatron.progress import Progress


def all_finite(tensor: torch.Tensor | None, mask: torch.Tensor | None = None) -> bool:
    """True when ``tensor`` (masked) is finite on every rank; ranks without it vote yes."""
    bad = tensor is not None and not bool(
        torch.isfinite(tensor[mask] if mask is not None else tensor).all())
    return not any_rank(bad)


# ----------------------------------------------------------------------------- stages

def prompt_ids(tokenizer, prompt) -> list[int]:
    """The token ids the policy is prompted with: the chat template over the model input."""
    return tokenizer.encode(tokenizer.apply_chat_template(prompt.model_input))


def rollout_stage(generator: Generator, tokenizer, prompts: list, group_size: int,
                  seed: int, progress: Callable[[int], None] | None = None,
                  episodes=None, on_env_step: Callable[[], None] | None = None
                  ) -> list[RolloutSample]:
    """Sample ``group_size`` responses for every prompt. Returns the samples, prompt-major:
    sample ``i * G + g`` is response ``g`` to prompt ``i``. Each prompt is tokenized once, its
    ``G`` requests sharing the id list (a chat template and an encode per response were 1.7 ms
    of TRL's 128-request rollout; 0.2 ms per prompt). ``progress(n)``: told the number of
    responses finished as they finish (:meth:`Generator.generate`). ``episodes``: multi-turn
    rollouts (:class:`~gspo_megatron.envs.turns.Episodes`): one environment per response, whose
    ``reset`` gives its prompt; ``on_env_step``: called after every batch of their answers."""
    if episodes is not None:
        requests, turns = episodes.start([p for p in prompts for _ in range(group_size)],
                                         on_env_step=on_env_step)
        return generator.generate(requests, seed=seed, progress=progress, turns=turns)
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    requests = [ids for ids in encoded for _ in range(group_size)]
    if progress is None:  # (the plain call: RL rollouts, ranks that show no progress)
        return generator.generate(requests, seed=seed)
    return generator.generate(requests, seed=seed, progress=progress)


def reward_stage(reward_fn, tokenizer, prompts: list, samples: list[RolloutSample],
                 group_size: int, timeout_s: float, workers=None) -> tuple[torch.Tensor, dict]:
    """Score every response against its prompt's answer (inline, in ``workers`` or in threads:
    the rule is :mod:`gspo_megatron.rewards.registry`'s); multi-turn samples carry their
    environments' rewards (:func:`~gspo_megatron.envs.turns.episode_rewards`, which adds the
    ``env/`` statistics). Returns (rewards [N], ``reward/`` stats)."""
    from gspo_megatron.rewards import compute_rewards

    if samples and EPISODE_KEY in samples[0].extra:  # multi-turn: the environments scored them
        from gspo_megatron.envs.turns import episode_rewards

        return episode_rewards(samples)
    responses = [tokenizer.decode(s.response_ids) for s in samples]
    examples = [p for p in prompts for _ in range(group_size)]
    if hasattr(reward_fn, "score_batch"):  # a weighted mix (a reward model among them)
        return reward_fn.score_batch(responses, [e.answer for e in examples], examples, timeout_s)
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


class SkipStep(Exception):
    """A stage found non-finite values: the step is given up before any update."""

    def __init__(self, fault: str, metrics: dict[str, float]):
        super().__init__(fault)
        self.fault = fault
        """The ``faults/*`` key logged for it."""
        self.metrics = metrics
        """What the step had measured so far (its ``reward/*``)."""


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
    ``[N]`` and the rollout engine's log-probs ``[N, T]``; a multi-turn sample's environment
    tokens (``extra[POLICY_MASK_KEY]`` 0) are left out of ``response_mask``: no log-prob, advantage
    or loss, not in GSPO's ``|y_i|`` nor in any token count. ``pack(sequences, prompt_lengths)``
    pads (:meth:`Trainer.pack`); the log-probs are placed by its layout
    (:meth:`~gspo_megatron.layout.TokenLayout.place_labels`)."""
    batch = pack([s.prompt_ids + s.response_ids for s in samples],
                 [len(s.prompt_ids) for s in samples])
    batch.rollout_logprobs = batch.layout.place_labels([s.response_logprobs for s in samples])
    batch.advantages = advantages
    authors = [s.extra.get(POLICY_MASK_KEY) for s in samples]
    if any(a is not None for a in authors):  # multi-turn: environment tokens are context only
        batch.response_mask &= batch.layout.place_labels(
            [a if a is not None else [1] * len(s.response_ids)
             for a, s in zip(authors, samples)]) > 0
    return batch


def minibatch_order(num_samples: int, seed: int) -> torch.Tensor:
    """``[N]`` the shuffle that deals a rank's samples into minibatches (consecutive slices):
    :func:`update_stage`'s, and :func:`balance_stage`'s before it moves samples."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))


class BalancedSamples(NamedTuple):
    """A rank's samples after :func:`balance_stage`, dealt into minibatches already."""

    samples: list[RolloutSample]
    """The samples this rank trains, minibatch after minibatch."""
    advantages: torch.Tensor
    """``[N_rank]`` their advantages."""
    minibatch_sizes: list[int]
    """Samples in each minibatch on this rank (as many as before the exchange)."""
    metrics: dict[str, float]
    """``perf/dp_token_imbalance`` (largest rank's tokens / the mean, worst minibatch; 1.0 is
    even) after the exchange, and ``..._before`` without it."""


def balance_stage(samples: list[RolloutSample], advantages: torch.Tensor, num_minibatches: int,
                  seed: int, groups: ParallelGroups) -> BalancedSamples:
    """Move whole samples between data-parallel ranks so each holds about the same tokens in every
    minibatch (:func:`~gspo_megatron.layout.balance_across_ranks`). Every rank first deals its
    samples into minibatches with :func:`minibatch_order` (as :func:`update_stage` would), so a
    minibatch keeps its sequences over all ranks and the gradient does not change (its normaliser
    is the count over every rank); the samples travel with their advantages and anything in
    ``extra`` (R3's routes). Collective over ``groups.dp_group``: one all-reduce of the lengths,
    one exchange (:func:`~gspo_megatron.distributed.exchange_objects`)."""
    order = minibatch_order(len(samples), seed).tolist()
    ranks, me = groups.dp_size, groups.dp_rank
    lengths = torch.zeros(ranks, len(order), dtype=torch.float64)
    lengths[me] = torch.tensor([len(samples[i].prompt_ids) + len(samples[i].response_ids)
                                for i in order], dtype=torch.float64)
    all_reduce_(lengths, groups.dp_group)
    plan: RankBalance = balance_across_ranks(lengths.long().tolist(), num_minibatches)
    outgoing = [[(samples[order[pos]], float(advantages[order[pos]]))
                 for mb in plan.sources[dest] for src, pos in mb if src == me]
                for dest in range(ranks)]
    received = [iter(objs) for objs in exchange_objects(outgoing, groups.dp_group)]
    mine = [next(received[src]) for mb in plan.sources[me] for src, _ in mb]
    return BalancedSamples(
        samples=[s for s, _ in mine],
        advantages=torch.tensor([a for _, a in mine], dtype=advantages.dtype),
        minibatch_sizes=plan.sizes(me),
        metrics={"perf/dp_token_imbalance": RankBalance.imbalance(plan.tokens_after),
                 "perf/dp_token_imbalance_before": RankBalance.imbalance(plan.tokens_before)})


def update_stage(policy: Policy, batch: PolicyBatch, cfg: TrainConfig, seed: int, step: int = 0,
                 routing: StepRouting | None = None, faults: FaultInjector | None = None,
                 minibatch_sizes: list[int] | None = None) -> dict[str, float]:
    """Split the rollout batch into ``num_minibatches`` (shuffled by :func:`minibatch_order`), one
    optimiser step each; ``minibatch_sizes``: the batch is dealt already (:func:`balance_stage`),
    minibatch ``i`` is the next ``minibatch_sizes[i]`` rows. Returns metrics averaged over the
    minibatches, and ``optim/grad_norm_max``: the largest gradient norm of the step's optimiser
    steps.

    ``routing`` (the step's :class:`~gspo_megatron.policy.StepRouting`, or None): hooks for each
    minibatch's update forward (routing replay, or recording the routes free routing takes) and,
    after each optimiser step, ``routing/drift/*``: minibatch ``i`` runs after ``i`` optimiser
    steps, so ``routing/drift/after_{i}_updates`` is the route change after ``i`` updates (~0 for
    ``i = 0``: the on-policy check) and ``routing/drift/change_rate`` averages ``i >= 1``; on a
    diagnosed step the ``routing/*`` diagnostics of the updated policy on that minibatch."""
    faults = faults or FaultInjector()
    objective = PolicyGradientObjective(cfg.loss, cfg.rollout.temperature, faults.corrupt,
                                        correction=cfg.rollout_correction,
                                        response_budget=cfg.rollout.max_new_tokens)
    if minibatch_sizes is None:
        order = minibatch_order(batch.size, seed)
        minibatch_sizes = [batch.size // cfg.trainer.num_minibatches] * cfg.trainer.num_minibatches
        shuffled = batch.select(order)
    else:
        order, shuffled = torch.arange(batch.size), batch
    starts = [sum(minibatch_sizes[:i]) for i in range(len(minibatch_sizes))]
    history: list[dict[str, float]] = []
    for i, (start, size) in enumerate(zip(starts, minibatch_sizes)):
        minibatch = shuffled.select(slice(start, start + size))
        if i == 1:
            faults.maybe_fail("mid_update", step)
        hooks = routing.update(order[start:start + size]) if routing is not None else None
        policy.zero_grad()
        metrics = policy.train_minibatch(minibatch, objective, routing=hooks)
        if any_rank(bool(metrics.get("faults/nonfinite_loss"))):
            applied, grad_norm = False, float("nan")
        else:  # skips non-finite gradients itself
            applied, grad_norm = policy.optimizer_step(
                corrupt_grad=lambda g: faults.corrupt("nan_grads", g))
        metrics.update({"optim/grad_norm": grad_norm, "optim/skipped": float(not applied),
                        "faults/skipped_updates": float(not applied)})
        if routing is not None:
            metrics.update(routing.after_update(i, minibatch, objective))
        history.append(metrics)
    keys = set().union(*history)
    out = {k: sum(h[k] for h in history if k in h) / sum(k in h for h in history) for k in keys}
    out["optim/lr"] = policy.lr
    out.update(first_minibatch_metrics(history[0]))
    # The mean hides a one-minibatch spike; the largest applied norm shows it (NaN: none applied).
    norms = [h["optim/grad_norm"] for h in history if h["optim/grad_norm"] == h["optim/grad_norm"]]
    out["optim/grad_norm_max"] = max(norms, default=float("nan"))
    if routing is not None:
        out.update(routing.timings())
    return out


def first_minibatch_metrics(first: dict[str, float]) -> dict[str, float]:
    """Minibatch 0 of a step runs before any update. With the trainer's own old log-probs its
    ratios are 1 unless the update's forward computes differently from the old-log-prob pass:
    in bf16, kernels whose rounding depends on the batch shape do, and GSPO's eps (3e-4 / 4e-4)
    clips sequences on that alone. ``ratio/first_minibatch_max_abs_log``: the largest
    ``|log ratio|`` there (0 on CPU in fp32 and bf16); ``clip/first_minibatch_fraction``: the
    share it clipped. (With ``trainer.old_logprobs: rollout`` they measure the rollout engine
    against the trainer instead.)"""
    if "ratio/min" not in first:
        return {}
    logs = [abs(math.log(first[k])) for k in ("ratio/min", "ratio/max")
            if 0 < first[k] < math.inf]
    out = {"ratio/first_minibatch_max_abs_log": max(logs, default=0.0)}
    if "clip/fraction" in first:  # (a loss without a hard clip, SAPO or GPG, has none)
        out["clip/first_minibatch_fraction"] = first["clip/fraction"]
    return out


def response_metrics(samples: list[RolloutSample], groups: ParallelGroups) -> dict[str, float]:
    """``response/*`` of the step's rollouts, over every data-parallel rank: ``num_tokens`` (the
    step's total response tokens), ``mean_length``, ``max_length``, ``eos_fraction`` and
    ``clip_rate`` (cut at ``rollout.max_new_tokens``, verl's ``response_length/clip_ratio``)."""
    lengths = [len(s.response_ids) for s in samples]
    eos = sum(s.finish_reason == "eos" for s in samples)
    sums = all_reduce_(torch.tensor([sum(lengths), len(samples), eos], dtype=torch.float64),
                       groups.dp_group)
    longest = all_reduce_(torch.tensor([max(lengths)], dtype=torch.float64), groups.dp_group,
                          op=dist.ReduceOp.MAX)
    tokens, count, eos_count = sums.tolist()
    eos_fraction = eos_count / count
    return {"response/num_tokens": tokens, "response/mean_length": tokens / count,
            "response/max_length": float(longest), "response/eos_fraction": eos_fraction,
            "response/clip_rate": 1.0 - eos_fraction}


def sft_stage(policy: Policy, samples: list, cfg: TrainConfig, groups: ParallelGroups, pack,
              progress: Progress) -> None:
    """Supervised warm-up on prompt -> answer + EOS (``samples``: ``input_ids``/``prompt_len``/
    ``loss_mask``: the tokens after the prompt with mask 0 are context, not targets)
    through the policy's own minibatch update, with a fresh optimizer (RL's Adam state and LR
    schedule start untouched afterwards). ``progress`` is told every step and its loss."""
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
            # (a multi-turn demonstration: its environment tokens are context, not targets)
            batch.response_mask &= batch.layout.place_labels(
                [samples[i].loss_mask[samples[i].prompt_len:] for i in idx]) > 0
            policy.zero_grad()
            metrics = policy.train_minibatch(batch, objective)
            policy.optimizer_step()
            progress.update(step + 1, f"sft step {step}: nll "
                                      f"{metrics.get('loss/sft_nll', float('nan')):.4f}")
