"""The environment contract of a multi-turn rollout, and the checks every answer passes.

An environment is a class named in the config (``multi_turn.env``: a built-in name or
``package.module:Class``, as ``reward.fn``), built with no arguments, one instance per episode::

    class MyEnv:
        def reset(self, example) -> list[dict]:          # the first messages (the prompt)
            ...
        def step(self, assistant_message: str) -> tuple[list[dict], float | None, bool]:
            ...                                           # (messages, reward or None, done)

``example`` is the :class:`~gspo_megatron.data.PromptExample` the episode starts from;
``assistant_message`` the text of the policy's last turn (special tokens dropped). ``step``
answers with the messages to append (``{"role": "tool" | "user", "content": str}``), the
episode's reward once it has one, and whether the episode is over. Either method may be
``async def`` (it is then run to completion in its worker). Nothing here imports torch: the
methods run in worker processes (:mod:`.workers`).

What counts as a bad answer, and what the rollout does with it (:func:`check_answer`; each is
counted under ``env/...``, the run goes on):

* an exception or a timeout in ``reset`` or ``step``: the episode ends there, reward 0;
* a message that is not ``{"role": str, "content": str}``, or content that is not UTF-8 (bytes
  that do not decode, lone surrogates): the episode ends, reward 0 (``env/bad_answers``);
* content longer than ``multi_turn.max_message_chars``: cut to that length
  (``env/truncated_messages``), the episode goes on;
* a reward that is not a finite number (or None): reward 0, the episode ends.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple, Protocol

__all__ = ["Environment", "EnvAnswer", "ToolCallError", "check_answer", "check_messages",
           "parse_tool_calls"]

Message = dict[str, str]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
"""Qwen3's tool-call markers (its chat template): ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, one JSON object between them."""
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


class Environment(Protocol):
    """What ``multi_turn.env`` names (the module docstring)."""

    def reset(self, example: Any) -> list[Message]: ...

    def step(self, assistant_message: str) -> tuple[list[Message], float | None, bool]: ...


class ToolCallError(ValueError):
    """A ``<tool_call>`` block whose body is not a JSON object with a string ``name``."""


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls of an assistant message, in order: each ``{"name": str, "arguments":
    dict}`` (Qwen3's format). Raises :class:`ToolCallError` for a block that is not valid JSON,
    has no string ``name`` or non-object ``arguments``, or an opened block never closed."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"tool call is not valid JSON ({e.msg} at {e.pos}): "
                                f"{body.strip()[:80]!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError(f"tool call must be a JSON object with a string 'name': "
                                f"{body.strip()[:80]!r}")
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            raise ToolCallError(f"tool call 'arguments' must be a JSON object: {body.strip()[:80]!r}")
        calls.append({"name": obj["name"], "arguments": args})
    if text.count(TOOL_CALL_OPEN) != len(calls):
        raise ToolCallError("a <tool_call> block is not closed by </tool_call>")
    return calls


class EnvAnswer(NamedTuple):
    """One checked answer of an environment (:func:`check_answer`)."""

    messages: list[Message]
    reward: float | None
    done: bool
    problem: str | None
    """Why the episode must end here (a bad answer, the method's exception or timeout), None
    when the answer is good; ``kind`` names its ``env/`` counter."""
    kind: str | None = None
    truncated: int = 0
    """Messages cut to ``max_message_chars``."""


def _utf8(content: Any) -> str | None:
    """``content`` as a str when it is valid UTF-8 text (a str without lone surrogates, or bytes
    that decode), else None."""
    if isinstance(content, (bytes, bytearray)):
        try:
            return bytes(content).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(content, str):
        return None
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return content


def check_messages(messages: Any, max_chars: int) -> tuple[list[Message], str | None, int]:
    """``(messages, problem, truncated)``: the messages as ``{"role", "content"}`` str dicts, each
    content cut to ``max_chars``; ``problem`` says what is wrong when they are unusable."""
    if messages is None:
        return [], None, 0
    if not isinstance(messages, (list, tuple)):
        return [], f"messages must be a list of dicts, got {type(messages).__name__}", 0
    out, truncated = [], 0
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return [], f"a message must be a dict with a str 'role', got {m!r:.80}", 0
        content = _utf8(m.get("content"))
        if content is None:
            return [], f"message content is not UTF-8 text ({type(m.get('content')).__name__})", 0
        if len(content) > max_chars:
            content, truncated = content[:max_chars], truncated + 1
        out.append({"role": m["role"], "content": content})
    return out, None, truncated


def check_answer(outcome: tuple[Any, str | None, bool], max_chars: int,
                 first: bool = False) -> EnvAnswer:
    """An environment call's ``(value, error, timed_out)`` (:mod:`.workers`) as an
    :class:`EnvAnswer`. ``first``: ``reset``'s value (messages only), else ``step``'s
    ``(messages, reward, done)``."""
    value, error, timed_out = outcome
    if timed_out:
        return EnvAnswer([], None, True, "timed out", "timeouts")
    if error is not None:
        return EnvAnswer([], None, True, error, "errors")
    if first:
        messages, reward, done = value, None, False
    else:
        if not isinstance(value, (tuple, list)) or len(value) != 3:
            return EnvAnswer([], None, True, f"step must return (messages, reward, done), got "
                             f"{value!r:.80}", "bad_answers")
        messages, reward, done = value
    messages, problem, truncated = check_messages(messages, max_chars)
    if problem is not None:
        return EnvAnswer([], None, True, problem, "bad_answers")
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            return EnvAnswer([], None, True, f"reward is not a finite number: {value[1]!r:.40}",
                             "bad_answers")
    return EnvAnswer(messages, reward, bool(done), None, None, truncated)
