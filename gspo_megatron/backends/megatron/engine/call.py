"""One :meth:`~.dynamic.DynamicRollout.generate` call's requests: their prompts and budgets,
the queue waiting for a slot, the call's sampling and finish rules, and every step's
``(ids, tokens, log-probs)``, joined per request once at the end (:class:`GenerateCall`)."""

from __future__ import annotations

import collections
import copy
import itertools

import torch

from gspo_megatron.backends.megatron.engine.sampler import FinishRule, Sampler


class Generated:
    """What one request wrote in one call: ``tokens`` and their ``logprobs`` (a continued held
    request: only this call's, after its ``prompt``), ``finished`` (False: aborted)."""

    __slots__ = ("request_id", "prompt", "tokens", "logprobs", "finished")

    def __init__(self, request_id, prompt, tokens, logprobs, finished):
        self.request_id, self.prompt = request_id, prompt
        self.tokens, self.logprobs, self.finished = tokens, logprobs, finished


class GenerateCall:
    """The requests of one :meth:`DynamicRollout.generate`: their prompts and budgets, the
    queue waiting for a slot, and every step's ``(ids, tokens, log-probs)`` (joined per request
    once, at the end, instead of a Python append per request and step)."""

    def __init__(self, sp, generator=None, method: str = "multinomial", invariant: bool = False):
        self.sp = sp
        self.sampler = Sampler(int(sp.top_k), float(sp.top_p), generator, method, invariant)
        """The call's one sampling rule (every decoding path's: :mod:`.sampler`)."""
        self.finish_rule = FinishRule()
        self._sp_of_budget = {int(sp.num_tokens_to_generate): sp}
        """One ``SamplingParams`` per budget, shared by the requests of that budget."""
        self.row: dict[int, int] = {}
        """Request id -> its place in the call."""
        self.prompts: list[list[int]] = []
        self.budgets: list[int] = []
        self.done: list[bool] = []
        self.running = 0
        """Requests of the call not finished."""
        self.turns = None  # a multi-turn rollout's :class:`~gspo_megatron.envs.turns.TurnDriver`
        self.waiting: collections.deque = collections.deque()
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _enter(self, request_id: int, prompt: list[int], budget: int) -> None:
        self.row[request_id] = len(self.prompts)
        self.prompts.append(prompt)
        self.budgets.append(budget)
        self.done.append(False)
        self.running += 1

    def add(self, request_id: int, prompt: list[int], budget: int) -> None:
        """A new request, queued for a slot."""
        self._enter(request_id, prompt, budget)
        self.waiting.append(self._request(request_id, prompt, budget))

    def join(self, request_id: int, prompt: list[int], budget: int) -> None:
        """A held request the context already runs (``budget``: what is left of its own)."""
        self._enter(request_id, prompt, budget)

    def _request(self, request_id: int, prompt: list[int], budget: int):
        from gspo_megatron.backends.megatron.engine.admission import RolloutRequest

        sp = self._sp_of_budget.get(budget)
        if sp is None:
            sp = self._sp_of_budget[budget] = copy.copy(self.sp)
            sp.num_tokens_to_generate = budget
        return RolloutRequest(request_id, sp, prompt)

    def record(self, ids: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """One step: request ``ids[i]`` sampled ``tokens[i]`` with ``logprobs[i]``."""
        self._steps.append((ids, tokens, logprobs))

    def finish(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self.done[self.row[request_id]] = True
        self.running -= len(request_ids)

    def _written(self) -> tuple[list[list[int]], list[list[float]]]:
        """Per request: the tokens and log-probs of every step, in step order."""
        n = len(self.prompts)
        if not self._steps:
            return [[] for _ in range(n)], [[] for _ in range(n)]
        ids, tokens, logprobs = (torch.cat(x) for x in zip(*self._steps))
        base = min(self.row)  # ids are unique for the engine's life: index from the call's least
        lookup = torch.full((max(self.row) + 1 - base,), -1, dtype=torch.long)
        lookup[torch.tensor(list(self.row)) - base] = torch.tensor(list(self.row.values()))
        rows = lookup[ids.cpu().long() - base]
        order = torch.argsort(rows, stable=True)
        counts = torch.bincount(rows, minlength=n).tolist()
        tokens, logprobs = tokens.cpu()[order].tolist(), logprobs.cpu()[order].tolist()
        starts = list(itertools.accumulate(counts, initial=0))
        return ([tokens[a:b] for a, b in zip(starts, starts[1:])],
                [logprobs[a:b] for a, b in zip(starts, starts[1:])])

    def requeue(self, request_id: int) -> None:
        """An evicted request (Megatron freed its blocks) waits at the head of the queue,
        its prompt + what it wrote as the prompt of a fresh prefill, the rest of its budget."""
        row = self.row[request_id]
        written = self._written()[0][row]
        self.waiting.appendleft(self._request(
            request_id, self.prompts[row] + written, self.budgets[row] - len(written)))

    def results(self) -> list[Generated]:
        tokens, logprobs = self._written()
        return [Generated(request_id, self.prompts[row], tokens[row], logprobs[row],
                          self.done[row]) for request_id, row in self.row.items()]
