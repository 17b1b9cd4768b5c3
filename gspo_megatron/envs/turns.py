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
(:func:`episode_rewards`, ``env/*``).

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
    truncated: int = 0
    invalid_calls: int = 0
    end: str | None = None
    """None while running; ``done`` (the environment ended it), or why it was cut."""


class TurnDriver:
    """One rollout call's episodes (the module docstring). ``runner``: the environments
    (:mod:`.workers`); ``keys[i]``: request ``i``'s episode; ``budgets[i]``: its token budget
    (policy + environment tokens); ``dead``: requests whose environment failed at reset (ended
    at their first token, reward 0)."""

    def __init__(self, runner, tokenizer, keys: Sequence[int], budgets: Sequence[int], *,
                 max_turns: int, max_turn_tokens: int, max_message_chars: int,
                 dead: Sequence[int] = (), on_env_step=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.eos_id = int(tokenizer.eos_id)
        self.max_turns, self.max_turn_tokens = int(max_turns), int(max_turn_tokens)
        self.max_message_chars = int(max_message_chars)
        self.episodes = [_Episode(int(k)) for k in keys]
        self.budgets = [int(b) for b in budgets]
        self.on_env_step = on_env_step
        """Called after every batch of environment answers (a fault injection point)."""
        for i in dead:
            self.episodes[i].end = "reset_failed"
        self.runner.drop([k for i, k in enumerate(keys) if i in set(dead)])

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
                ep.invalid_calls += 1
            calls.append(("step", ep.key, text))
        answers = [check_answer(o, self.max_message_chars) for o in self.runner.run(calls)]
        if self.on_env_step is not None:
            self.on_env_step()
        return answers

    def _answer_queued(self, row: int, answer) -> bool:
        """Queue ``answer``'s tokens for ``row`` (True: the request goes on) or end it."""
        ep = self.episodes[row]
        ep.truncated += answer.truncated
        if answer.problem is not None:
            self._end(ep, answer.kind)
            return False
        if answer.done:
            ep.reward = answer.reward
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
                              "invalid_tool_calls": ep.invalid_calls,
                              "truncated_messages": ep.truncated, "end": ep.end or "aborted"}}


class Episodes:
    """The run's multi-turn rollouts: the environment runner (:mod:`.workers`), the tokenizer
    and ``multi_turn``'s limits (:class:`~gspo_megatron.config.MultiTurnConfig`)."""

    def __init__(self, runner, tokenizer, max_turns: int, max_turn_tokens: int,
                 max_message_chars: int, budget: int = 0, env_cls: type | None = None):
        self.runner, self.tokenizer, self.budget = runner, tokenizer, int(budget)
        self.env_cls = env_cls
        """The environment class (resolved in this process: its demonstrations)."""
        self.max_turns, self.max_turn_tokens = max_turns, max_turn_tokens
        self.max_message_chars = max_message_chars
        self._next_key = 0

    def start(self, examples: Sequence[Any], budget: int | None = None, on_env_step=None
              ) -> tuple[list[list[int]], TurnDriver]:
        """Reset one environment per example (repeat an example for a group); returns the
        first prompts' token ids and the call's :class:`TurnDriver` (``budget``: each episode's
        tokens, default the one given at construction; ``on_env_step``: called after every batch
        of environment answers). An environment whose
        ``reset`` fails gets the example's own prompt and ends at its first token."""
        keys = list(range(self._next_key, self._next_key + len(examples)))
        self._next_key += len(examples)
        budget = self.budget if budget is None else budget
        outcomes = self.runner.run([("reset", k, e) for k, e in zip(keys, examples)])
        prompts, dead, reset_failures, truncated = [], [], {}, []
        for i, (example, outcome) in enumerate(zip(examples, outcomes)):
            answer = check_answer(outcome, self.max_message_chars, first=True)
            truncated.append(answer.truncated)
            if answer.problem is not None or not answer.messages:
                reset_failures[i] = answer.kind or "bad_answers"
                dead.append(i)
                prompts.append(self.tokenizer.encode_prompt(example.model_input))
            else:
                prompts.append(self.tokenizer.encode_prompt(answer.messages))
        driver = TurnDriver(self.runner, self.tokenizer, keys, [budget] * len(examples),
                            max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
                            max_message_chars=self.max_message_chars, dead=dead,
                            on_env_step=on_env_step)
        for i, why in reset_failures.items():
            driver.episodes[i].end = f"reset_{why}"
        for ep, n in zip(driver.episodes, truncated):
            ep.truncated = n
        return prompts, driver

    @property
    def demonstrates(self) -> bool:
        """Whether the environment class writes demonstrations (``demonstration(example) ->
        messages``, a classmethod) for the supervised warm-up."""
        return callable(getattr(self.env_cls, "demonstration", None))

    def sft_samples(self, examples: Sequence[Any]) -> list:
        """One :class:`~gspo_megatron.data.SFTSample` per example: its demonstration laid out as
        a rollout lays an episode out (the first messages through the chat template, each
        assistant message + EOS with loss mask 1, the messages between them through
        :meth:`~gspo_megatron.tokenizer.Tokenizer.continuation` with loss mask 0)."""
        from gspo_megatron.data import SFTSample

        out = []
        tok = self.tokenizer
        for example in examples:
            messages = self.env_cls.demonstration(example)
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            ids = tok.encode_prompt(messages[:first])
            mask, prompt_len, pending = [0] * len(ids), len(ids), []
            for m in messages[first:]:
                if m["role"] != "assistant":
                    pending.append(m)
                    continue
                if pending:
                    env = tok.encode(tok.continuation(pending))
                    ids, mask, pending = ids + env, mask + [0] * len(env), []
                turn = tok.encode(m["content"]) + [tok.eos_id]
                ids, mask = ids + turn, mask + [1] * len(turn)
            out.append(SFTSample(input_ids=ids, loss_mask=mask, prompt_len=prompt_len))
        return out

    def close(self) -> None:
        self.runner.close()


def episode_rewards(samples: Sequence[Any], correct_threshold: float = 1.0
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards ``[N]`` (float32) of multi-turn samples (their environments'; 0 for an
    episode cut or failed) and the step's ``reward/*`` and ``env/*`` statistics: per episode
    means of ``turns``, ``tool_calls``, ``policy_tokens``, ``env_tokens``; totals of the bad
    answers and cuts (``env/<end>``, ``env/reset_failures``), of messages cut to
    ``multi_turn.max_message_chars`` and of tool calls that are not valid JSON."""
    from gspo_megatron.rewards.base import is_correct

    eps = [s.extra[EPISODE_KEY] for s in samples]
    n = max(1, len(eps))
    rewards = torch.tensor([e["reward"] for e in eps], dtype=torch.float32)
    stats = {"reward/mean": float(rewards.mean()) if eps else 0.0,
             "reward/std": float(rewards.std(unbiased=False)) if eps else 0.0,
             "reward/accuracy": sum(is_correct(float(r), correct_threshold) for r in rewards) / n}
    def count(pred) -> float:
        return float(sum(pred(e) for e in eps))

    stats.update({
        "env/errors": count(lambda e: e["end"] in ("errors", "reset_errors")),
        "env/timeouts": count(lambda e: e["end"] in ("timeouts", "reset_timeouts")),
        "env/bad_answers": count(lambda e: e["end"] in ("bad_answers", "reset_bad_answers")),
        "env/reset_failures": count(lambda e: e["end"].startswith("reset_")),
        "env/max_turns_cut": count(lambda e: e["end"] == "max_turns_cut"),
        "env/turn_budget_cut": count(lambda e: e["end"] == "turn_budget_cut"),
        "env/budget_cut": count(lambda e: e["end"] == "budget_cut"),
        "env/length": count(lambda e: e["end"] == "length"),
        "env/truncated_messages": float(sum(e["truncated_messages"] for e in eps)),
        "env/invalid_tool_calls": float(sum(e["invalid_tool_calls"] for e in eps)),
    })
    stats["env/turns"] = sum(e["turns"] for e in eps) / n
    stats["env/tool_calls"] = sum(e["tool_calls"] for e in eps) / n
    policy = [sum(s.extra[POLICY_MASK_KEY]) for s in samples]
    stats["env/policy_tokens"] = sum(policy) / n
    stats["env/env_tokens"] = sum(len(s.response_ids) - p for s, p in zip(samples, policy)) / n
    return rewards, stats
