"""Environments for the multi-turn tests, importable by spawned worker processes
(``tests.helpers.envs:Class``). Each reads what to do from its example's prompt."""

from __future__ import annotations

import time


class BadEnv:
    """``reset(example)``: the prompt names the misbehaviour of ``step``: ``raise``, ``sleep``
    (longer than any test timeout), ``huge`` (a 10,000-character answer), ``bytes`` (content
    that is not UTF-8), ``surrogate`` (a str with a lone surrogate), ``badreward`` (NaN),
    ``never`` (never done), ``resetfail`` (``reset`` raises), ``good`` (done at the 2nd turn,
    reward 1)."""

    def reset(self, example):
        self.mode, self.turn = example.prompt, 0
        if self.mode == "resetfail":
            raise RuntimeError("reset failed on purpose")
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.turn += 1
        mode = self.mode
        if mode == "raise":
            raise ValueError("step failed on purpose")
        if mode == "sleep":
            time.sleep(60)
        if mode == "huge":
            return [{"role": "tool", "content": "7" * 10_000}], None, self.turn >= 2
        if mode == "bytes":
            return [{"role": "tool", "content": b"\xff\xfe"}], None, False
        if mode == "surrogate":
            return [{"role": "tool", "content": "a\udc80"}], None, False
        if mode == "badreward":
            return [], float("nan"), True
        if mode == "never":
            return [{"role": "tool", "content": "again"}], None, False
        return [{"role": "tool", "content": "ok"}], (1.0 if self.turn >= 2 else None), self.turn >= 2


class AsyncEnv:
    """``async def`` methods: done at the first step with reward 2."""

    async def reset(self, example):
        return [{"role": "user", "content": example.prompt}]

    async def step(self, text):
        return [], 2.0, True


class Example:
    """A stand-in for a prompt example (``prompt``, ``model_input``), cheap to unpickle in a
    worker (a class of a test module would import the module, torch included)."""

    def __init__(self, prompt, answer=""):
        self.prompt = self.model_input = prompt
        self.answer = answer
