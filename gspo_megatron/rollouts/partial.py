"""Partial rollouts (``rollout.partial_rollouts``): the long tail of a rollout carried into the next
step instead of waited for (APRIL, "Active Partial Rollouts in RL"; slime's partial rollouts).

A rollout's decoding steps follow its longest response, and a decoding step costs about the same
with 3 requests running as with 128 (on a GPU the weights are read once per step whatever the
batch; on CPU it is per-call overhead), so on long-tailed responses the last few requests cost
most of the steps. Here every data-parallel rank keeps a batch's worth of requests running
(``prompts_per_step x group_size``, what a rollout without a tail runs at once): as responses
end, fresh groups join the rollout (continuous batching over prompts, up to
``in_flight_groups`` groups held), and the rollout stops as soon as ``prompts_per_step`` groups
are complete (:class:`~gspo_megatron.policy.GroupStop`); the requests still running are set aside
with the tokens and log-probs written so far, and the next step's rollout continues them first,
with the newer weights (the prefix is prefilled again, so its KV cache is the new policy's).
With ``rollout.partial_keep_kv`` the engine holds the cut requests instead, KV cache and all
(PipelineRL's in-flight weight update): the next rollout continues them without prefilling
again, their earlier tokens' keys and values computed by the older weights, and the cache stays
allocated through training; after a checkpoint the prefixes are prefilled once, as a resumed run
does.

What it changes in the objective: a response carried over was written by two or more policies.
Each token keeps the log-prob of the policy that sampled it (``response_logprobs``), the trainer
recomputes the old log-probs at its step (the clip is relative to the policy being updated), and
``rollout_correction`` weighs the tokens by their own sampler's probability; ``rollout/partial_*``
says how much of a step was carried and for how long (``_max_span``: the most steps' policies
one trained response was written by; ``rollout.partial_max_age`` bounds it). Under R3 the
replayed routes of a carried response are those of its last rollout (which re-prefilled the
prefix), or with ``partial_keep_kv`` those each token was forwarded with.

State (:meth:`PartialRollouts.state_dict`): the groups in flight with their finished responses and
the unfinished ones' tokens, plain lists, saved with the checkpoint, so a resumed run continues the
same requests. Nothing here imports Megatron.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from gspo_megatron.policy import (HELD_REQUEST_KEY, STALE_TOKENS_KEY, Generator, GroupStop,
                                  RolloutSample)


@dataclass
class _Response:
    """One response of a group in flight: finished, or the tokens written so far."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: RolloutSample | None = None
    first_step: int | None = None
    """The step whose rollout wrote its first token (None: none written yet)."""
    last_step: int | None = None
    """The step whose rollout finished it."""
    held: int | None = None
    """``rollout.partial_keep_kv``: the engine request that holds it, KV cache and all, since the
    last rollout cut it (None: its prefix is prefilled when it goes on)."""


@dataclass
class _Group:
    prompt: Any
    """The prompt's example (the task's object: model input, answer)."""
    prompt_ids: list[int]
    drawn: int
    """The step whose rollout first ran it."""
    responses: list[_Response]

    @property
    def complete(self) -> bool:
        return all(r.done is not None for r in self.responses)


class PartialRollouts:
    """One data-parallel rank's groups in flight and the rule that runs them.

    ``group_size``: G; ``need``: groups a step trains on (``rollout.prompts_per_step``);
    ``in_flight``: the most groups held (``rollout.in_flight_groups``, >= ``need``);
    ``max_new_tokens``: a response's whole budget (a continued one gets what is left of it);
    ``max_age``: ``rollout.partial_max_age`` (0: none)."""

    def __init__(self, group_size: int, need: int, in_flight: int, max_new_tokens: int,
                 max_age: int = 0, keep_kv: bool = False):
        if in_flight < need:
            raise ValueError(f"in_flight ({in_flight}) must be >= need ({need})")
        self.group_size, self.need, self.in_flight = group_size, need, in_flight
        self.max_new_tokens, self.max_age, self.keep_kv = max_new_tokens, max_age, keep_kv
        self.groups: list[_Group] = []
        self.checkpointed = True
        """A checkpoint was taken (or loaded) since the last rollout: the next one prefills every
        continued prefix, as a run resumed from that checkpoint must (the engine's cache of them
        is not saved). The one record of it: set by :meth:`checkpoint_state` and
        :meth:`load_state_dict`, or by :meth:`mark_checkpoint` on a rollout rank (whose pool the
        trainer checkpoints)."""

    def rollout(self, generator: Generator, encode: Callable[[Any], list[int]],
                draw: Callable[[], list], seed: int, step: int
                ) -> tuple[list, list[RolloutSample], dict[str, float]]:
        """One step's rollout: continue every unfinished response and keep a batch's worth of
        requests (``need x group_size``) running, drawing fresh groups from ``draw()`` (a batch
        of prompts per call) as responses end while fewer than ``in_flight`` groups are held,
        until ``need`` groups are complete; hand those over (the ones drawn first). Returns
        ``(prompts, samples, rollout/partial_* metrics)``; samples are prompt-major as
        :func:`~gspo_megatron.stages.rollout_stage`'s."""
        target = self.need * self.group_size
        index = {id(g): i for i, g in enumerate(self.groups)}
        running = [(g, r) for g in self.groups for r in g.responses if r.done is None]

        def fresh(n_running: int) -> list[tuple[list[int], int, int]]:
            """Fresh groups while fewer than ``target`` requests run: their requests."""
            new = []
            while n_running + len(new) < target and len(self.groups) + self.need <= self.in_flight:
                for prompt in draw():
                    g = _Group(prompt, encode(prompt), step, [
                        _Response() for _ in range(self.group_size)])
                    index[id(g)] = len(index)
                    self.groups.append(g)
                    running.extend((g, r) for r in g.responses)
                    new += [(g.prompt_ids, self.max_new_tokens, index[id(g)])] * self.group_size
            return new

        fresh(len(running))  # before the call: they go in with the carried requests
        complete = sum(g.complete for g in self.groups)
        overdue = [g for g in self.groups if self.max_age and step - g.drawn >= self.max_age]
        generated = 0
        # The engine is called even when the groups needed are already complete (its stop then
        # done before any step: the held requests stay held): under expert parallelism a call is
        # collective, and another rank's pool may still need its rollout.
        continue_ids = {} if self.checkpointed else {
            i: r.held for i, (_, r) in enumerate(running) if r.held is not None}
        stop = GroupStop([index[id(g)] for g, _ in running], self.need - complete, fresh,
                         frozenset(index[id(g)] for g in overdue), hold_cut=self.keep_kv,
                         continue_ids=continue_ids)
        self.checkpointed = False
        out = generator.generate([g.prompt_ids + r.tokens for g, r in running], seed,
                                 budgets=[self.max_new_tokens - len(r.tokens)
                                          for _, r in running], stop=stop)
        for (g, r), sample in zip(running, out, strict=True):
            prior = len(r.tokens)  # written by older weights
            generated += len(sample.response_ids)
            if sample.response_ids and r.first_step is None:
                r.first_step = step
            r.tokens += sample.response_ids
            r.logprobs += sample.response_logprobs
            r.held = sample.extra.get(HELD_REQUEST_KEY)
            if sample.finish_reason != "aborted":
                r.last_step = step
                r.done = RolloutSample(list(g.prompt_ids), list(r.tokens), list(r.logprobs),
                                       sample.finish_reason,
                                       {**sample.extra, STALE_TOKENS_KEY: prior})
        ready = [g for g in self.groups if g.complete][:self.need]
        if len(ready) < self.need:
            raise RuntimeError(f"partial rollouts: {len(ready)} groups complete after the "
                               f"rollout, {self.need} needed")
        taken = {id(g) for g in ready}
        self.groups = [g for g in self.groups if id(g) not in taken]
        # a response finished at an earlier step: every token is the older weights'
        samples = [r.done if r.last_step == step else dataclasses.replace(
            r.done, extra={**r.done.extra, STALE_TOKENS_KEY: len(r.done.response_ids)})
            for g in ready for r in g.responses]
        carried = sum(len(r.done.response_ids) for g in ready for r in g.responses
                      if r.first_step is not None and r.first_step < step)
        total = sum(len(s.response_ids) for s in samples)
        return [g.prompt for g in ready], samples, {
            "rollout/partial_generated_tokens": float(generated),
            "rollout/partial_carried_share": carried / max(total, 1),
            "rollout/partial_max_age": float(max(step - g.drawn for g in ready)),
            "rollout/partial_max_span": float(max(
                r.last_step - (step if r.first_step is None else r.first_step) + 1
                for g in ready for r in g.responses)),
            "rollout/partial_in_flight": float(len(self.groups)),
        }

    def state_dict(self) -> dict:
        """The groups in flight, as plain data (finished responses whole, the others' tokens;
        copies: the pool goes on changing while a background checkpoint writes it)."""
        return {"groups": [
            {"prompt": g.prompt, "prompt_ids": list(g.prompt_ids), "drawn": g.drawn,
             "responses": [{"tokens": list(r.tokens), "logprobs": list(r.logprobs),
                            "done": r.done, "first_step": r.first_step,
                            "last_step": r.last_step, "held": r.held} for r in g.responses]}
            for g in self.groups]}

    def mark_checkpoint(self) -> None:
        """A checkpoint of this pool was taken elsewhere (a rollout rank's pool: the trainer saved
        the state it sent): the next rollout prefills every continued prefix."""
        self.checkpointed = True

    def checkpoint_state(self, engine_saved: bool = False) -> dict:
        """:meth:`state_dict` for a checkpoint: the next rollout also prefills every continued
        prefix again (``keep_kv``: the engine's cache of them is not saved, so the run resumed
        from this checkpoint and this one compute the same), unless ``engine_saved``: the
        checkpoint keeps the engine's held requests whole (a stop signal's)."""
        if not engine_saved:
            self.mark_checkpoint()
        return self.state_dict()

    def load_state_dict(self, state: dict, engine_restored: bool = False) -> None:
        """The pool of :meth:`state_dict`; ``engine_restored``: the engine holds the requests it
        held at the save again (continued, not prefilled)."""
        self.checkpointed = not engine_restored
        self.groups = [_Group(g["prompt"], list(g["prompt_ids"]), g["drawn"], [
            _Response(list(r["tokens"]), list(r["logprobs"]), r["done"], r["first_step"],
                      r["last_step"], r.get("held") if engine_restored else None)
            for r in g["responses"]]) for g in state["groups"]]
