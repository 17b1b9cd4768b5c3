"""The turn loop of a multi-turn rollout: episodes on the engine, one request each.

:meth:`Episodes.start` resets one environment per prompt example and returns the first prompts;
the engine then runs one request per episode (:meth:`~gspo_megatron.backends.megatron.engine.
dynamic.DynamicRollout.generate` with ``turns=``), and at every step hands the sampled tokens to
the call's :class:`TurnDriver`, which decides per request:

* a **policy token**: kept. When it is the EOS (the assistant turn is over), the environment
  steps on the turn's text (every request whose turn ended at this step in one batch, in the
  environment workers). Its answer, rendered through the chat template
  (:meth:`~gspo_megatron.tokenizer.Tokenizer.continuation`), is queued as the request's next
  tokens and the request goes on instead of finishing;
* an **environment token**: while a request has queued tokens, each step's sampled token is
  replaced by the next of them (the engine forwards it at the next step, as it forwards a
  sampled token): the *same* request continues with its KV cache, and no earlier token is ever
  prefilled again (``DynamicRollout.tokens_forwarded`` counts each token once). The R3 recorder
  records the routes of these tokens too, as of every token the engine forwards.

An episode ends when the environment says ``done`` (its reward is the episode's), at a bad
answer (reward 0), after ``max_turns`` assistant turns, when a turn reaches ``max_turn_tokens``
policy tokens, or when the environment's answer would not fit in the episode's budget
(``rollout.max_new_tokens``: policy and environment tokens together); each cut is counted
(:meth:`TurnDriver.metrics`, ``env/*``).

What a sample carries (:meth:`TurnDriver.extra`): ``extra[POLICY_MASK_KEY]``, one 0/1 per
response token (1: the policy wrote it), which :func:`~gspo_megatron.stages.batch_stage` ANDs into
the batch's ``response_mask`` (environment tokens are context: no log-prob, advantage or loss,
not in GSPO's ``|y_i|``); ``extra[EPISODE_KEY]``: the episode's reward, turns, tool calls and how
it ended. The engine's log-prob of an environment token is reported as 0 (never used).

The env step runs synchronously inside the engine's step (the batch waits for it; the
environments' timeout bounds the wait). A rollout that is cut by a stop signal does not keep its
episodes: a resumed run starts them again (the restart rule: an episode is never resumed
mid-way, its environment state is not checkpointed).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Sequence

import torch

from gspo_megatron.envs.base import ToolCallError, check_answer, parse_tool_calls
from gspo_megatron.policy import EPISODE_KEY, POLICY_MASK_KEY

__all__ = ["EPISODE_KEY", "POLICY_MASK_KEY", "Episodes", "TurnDriver"]


COUNTERS = ("errors", "timeouts", "bad_answers", "truncated_messages", "invalid_tool_calls",
            "max_turns_cut", "turn_budget_cut", "budget_cut", "no_reward")
"""``env/<name>`` counts of a rollout (what each means: :meth:`TurnDriver.metrics`)."""


@dataclasses.dataclass
class _Episode:
    key: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    authors: list[int] = dataclasses.field(default_factory=list)
    forced: deque = dataclasses.field(default_factory=deque)
    turn_start: int = 0
    turns: int = 0
    tool_calls: int = 0
    reward: float | None = None
    end: str | None = None
    """None while running; ``done`` (the environment ended it), or why it was cut."""


class TurnDriver:
    """One rollout call's episodes (the module docstring). ``runner``: the environments
    (:mod:`.workers`); ``keys[i]``: request ``i``'s episode; ``budgets[i]``: its token budget
    (policy + environment tokens); ``dead``: requests whose environment failed at reset (ended
    at their first token, reward 0)."""

    def __init__(self, runner, tokenizer, keys: Sequence[int], budgets: Sequence[int], *,
                 max_turns: int, max_turn_tokens: int, max_message_chars: int,
                 counts: dict[str, int] | None = None, dead: Sequence[int] = ()):
        self.runner, self.tokenizer = runner, tokenizer
        self.eos_id = int(tokenizer.eos_id)
        self.max_turns, self.max_turn_tokens = int(max_turns), int(max_turn_tokens)
        self.max_message_chars = int(max_message_chars)
        self.episodes = [_Episode(int(k)) for k in keys]
        self.budgets = [int(b) for b in budgets]
        self.counts = dict.fromkeys(COUNTERS, 0) if counts is None else counts
        for i in dead:
            self.episodes[i].end = "reset_failed"

    # ------------------------------------------------------------------ engine side
    def step(self, rows: Sequence[int], sampled: torch.Tensor, ended: torch.Tensor):
        """One engine step: ``rows[k]`` (the call's request index) sampled ``sampled[k]``;
        ``ended[k]``: the request reached its length limit (the engine's finish rule without
        its stop token: the EOS is the driver's to rule on). Returns ``(tokens [n], ended [n],
        forced [n] bool)``: the tokens to append (environment tokens in place of samples) and
        which requests end, as the driver decides."""
        tokens, ended = sampled.clone(), ended.clone()
        forced = torch.zeros_like(ended)
        values = sampled.tolist()
        turn_over: list[tuple[int, int]] = []  # (k, row) whose assistant turn just ended
        for k, row in enumerate(rows):
            ep = self.episodes[row]
            if ep.end is not None:  # failed at reset: its one token is not the policy's
                ep.tokens.append(values[k])
                ep.authors.append(0)
                ended[k] = True
                continue
            if ep.forced:
                tok = ep.forced.popleft()
                tokens[k], forced[k] = tok, True
                ep.tokens.append(tok)
                ep.authors.append(0)
                if bool(ended[k]):  # (the budget was checked when the answer was queued)
                    self._end(ep, "budget_cut")
                if not ep.forced:
                    ep.turn_start = len(ep.tokens)
                continue
            ep.tokens.append(values[k])
            ep.authors.append(1)
            if values[k] == self.eos_id:
                turn_over.append((k, row))
                ended[k] = False
            elif bool(ended[k]):
                self._end(ep, "length")
            elif len(ep.tokens) - ep.turn_start >= self.max_turn_tokens:
                self._end(ep, "turn_budget_cut")
                ended[k] = True
        if turn_over:
            answers = self._env_step([row for _, row in turn_over])
            for (k, row), answer in zip(turn_over, answers):
                ended[k] = not self._answer_queued(row, answer)
        return tokens, ended, forced

    def _env_step(self, rows: list[int]) -> list:
        """The environment's checked answer to each row's finished turn (one batch)."""
        calls = []
        for row in rows:
            ep = self.episodes[row]
            text = self.tokenizer.decode(ep.tokens[ep.turn_start:])
            ep.turns += 1
            try:
                ep.tool_calls += len(parse_tool_calls(text))
            except ToolCallError:
                self.counts["invalid_tool_calls"] += 1
            calls.append(("step", ep.key, text))
        return [check_answer(o, self.max_message_chars) for o in self.runner.run(calls)]

    def _answer_queued(self, row: int, answer) -> bool:
        """Queue ``answer``'s tokens for ``row`` (True: the request goes on) or end it."""
        ep = self.episodes[row]
        self.counts["truncated_messages"] += answer.truncated
        if answer.problem is not None:
            self._end(ep, answer.kind)
            return False
        if answer.done:
            ep.reward = answer.reward
            if answer.reward is None:
                self.counts["no_reward"] += 1
            self._end(ep, "done")
            return False
        if ep.turns >= self.max_turns:
            self._end(ep, "max_turns_cut")
            return False
        ids = self.tokenizer.encode(self.tokenizer.continuation(answer.messages))
        # + 1: the first token of the next turn must fit too
        if not ids or len(ep.tokens) + len(ids) + 1 > self.budgets[row]:
            self._end(ep, "budget_cut")
            return False
        ep.forced.extend(ids)
        return True

    def _end(self, ep: _Episode, why: str) -> None:
        ep.end = why
        if why in self.counts:
            self.counts[why] += 1
        self.runner.drop([ep.key])

    # ------------------------------------------------------------------ sample side
    def finish_reason(self, row: int) -> str:
        """``eos`` for an episode its environment ended, ``length`` for any other end."""
        return "eos" if self.episodes[row].end == "done" else "length"

    def extra(self, row: int, tokens: Sequence[int]) -> dict[str, Any]:
        """``RolloutSample.extra`` of request ``row`` whose response is ``tokens``."""
        ep = self.episodes[row]
        if list(tokens) != ep.tokens:
            raise RuntimeError(f"turn driver: request {row}'s tokens differ from the engine's")
        return {POLICY_MASK_KEY: list(ep.authors),
                EPISODE_KEY: {"reward": 0.0 if ep.reward is None else float(ep.reward),
                              "turns": ep.turns, "tool_calls": ep.tool_calls,
                              "end": ep.end or "aborted"}}

    def metrics(self) -> dict[str, float]:
        """``env/*``: per episode means of ``turns``, ``tool_calls``, ``policy_tokens`` and
        ``env_tokens``; the counts of :data:`COUNTERS` (errors and timeouts of ``reset`` /
        ``step``, bad answers, messages cut to ``max_message_chars``, tool calls that are not
        valid JSON, episodes cut at ``max_turns`` / ``max_turn_tokens`` / the token budget,
        episodes done without a reward)."""
        n = max(1, len(self.episodes))
        out = {f"env/{k}": float(v) for k, v in self.counts.items()}
        out["env/turns"] = sum(e.turns for e in self.episodes) / n
        out["env/tool_calls"] = sum(e.tool_calls for e in self.episodes) / n
        out["env/policy_tokens"] = sum(sum(e.authors) for e in self.episodes) / n
        out["env/env_tokens"] = sum(len(e.authors) - sum(e.authors) for e in self.episodes) / n
        return out


class Episodes:
    """The run's multi-turn rollouts: the environment runner (:mod:`.workers`), the tokenizer
    and ``multi_turn``'s limits (:class:`~gspo_megatron.config.MultiTurnConfig`)."""

    def __init__(self, runner, tokenizer, max_turns: int, max_turn_tokens: int,
                 max_message_chars: int):
        self.runner, self.tokenizer = runner, tokenizer
        self.max_turns, self.max_turn_tokens = max_turns, max_turn_tokens
        self.max_message_chars = max_message_chars
        self._next_key = 0

    def start(self, examples: Sequence[Any], budget: int) -> tuple[list[list[int]], TurnDriver]:
        """Reset one environment per example (repeat an example for a group); returns the
        first prompts' token ids and the call's :class:`TurnDriver`. An environment whose
        ``reset`` fails gets the example's own prompt and ends at its first token."""
        keys = list(range(self._next_key, self._next_key + len(examples)))
        self._next_key += len(examples)
        counts = dict.fromkeys(COUNTERS, 0)
        outcomes = self.runner.run([("reset", k, e) for k, e in zip(keys, examples)])
        prompts, dead = [], []
        for i, (example, outcome) in enumerate(zip(examples, outcomes)):
            answer = check_answer(outcome, self.max_message_chars, first=True)
            counts["truncated_messages"] += answer.truncated
            if answer.problem is not None or not answer.messages:
                counts[answer.kind or "bad_answers"] += 1
                dead.append(i)
                self.runner.drop([keys[i]])
                prompts.append(self.tokenizer.encode_prompt(example.model_input))
            else:
                prompts.append(self.tokenizer.encode_prompt(answer.messages))
        driver = TurnDriver(self.runner, self.tokenizer, keys, [budget] * len(examples),
                            max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
                            max_message_chars=self.max_message_chars, counts=counts, dead=dead)
        return prompts, driver

    def close(self) -> None:
        self.runner.close()
