"""The built-in multi-turn task: arithmetic with a calculator tool (``multi_turn.env:
tool_arithmetic``).

The prompts are the built-in arithmetic task's (``data.source: arithmetic``); with large operands
(``data.max_operand: 999``: three-digit sums) the tiny demo model cannot add reliably in its
head, but it can copy: call the calculator with the problem, then write the number it got back.
An episode::

    user:       "482+397="
    assistant:  <tool_call>{"name":"calc","arguments":{"expr":"482+397"}}</tool_call>   (EOS)
    tool:       "879"
    assistant:  "879"                                                                  (EOS)

A turn without a tool call is the final answer: reward 1 when it equals the reference answer,
else 0; the episode is then over. A tool call that is not valid JSON, or names another tool,
gets an ``error: ...`` tool message and the episode goes on (``multi_turn.max_turns`` bounds it).

:meth:`ToolArithmeticEnv.demonstration` writes the warm-up's episodes: the one above for a share
``TOOL_DEMO_FRACTION`` (half) of the problems (chosen by a hash of the problem), a direct answer
for the others. The warmed-up policy therefore calls the tool now and then; RL is what makes it
call the tool on problems it cannot add (``env/tool_calls`` rising with the held-out accuracy).
"""

from __future__ import annotations

import json
import zlib

from gspo_megatron.envs.base import ToolCallError, parse_tool_calls
from gspo_megatron.envs.tools import calculator

__all__ = ["ToolArithmeticEnv"]


class ToolArithmeticEnv:
    """Arithmetic with a calculator tool (module docstring)."""

    TOOL = "calc"
    """The calculator's name in a tool call; its one argument is ``expr``."""
    TOKENIZER_TEXT = ('<tool_call>{"name":"calc","arguments":{"expr":"0+1-2*3"}}</tool_call>',
                      "user: tool: assistant: error: \n")
    """Text the built-in task's character tokenizer must cover (one token per character)."""
    TOKENIZER_SYMBOLS = ("<tool_call>", "</tool_call>")
    """Multi-character strings that must each be one token."""
    TOOL_DEMO_FRACTION = 0.5
    """Share of the warm-up's demonstrations that call the tool (the rest answer directly)."""

    def reset(self, example) -> list[dict[str, str]]:
        self.answer = str(example.answer).strip()
        return [{"role": "user", "content": example.prompt}]

    def step(self, assistant_message: str):
        try:
            calls = parse_tool_calls(assistant_message)
        except ToolCallError:  # (short: the tiny model's budget; parse_tool_calls says why)
            return [{"role": "tool", "content": "error: invalid tool call"}], None, False
        if not calls:  # the final answer
            return [], float(assistant_message.strip() == self.answer), True
        out = []
        for call in calls:
            if call["name"] != self.TOOL:
                out.append({"role": "tool", "content": f"error: unknown tool {call['name']!r}"})
            else:
                out.append({"role": "tool", "content": calculator(str(call["arguments"].get("expr", "")))})
        return out, None, False

    @classmethod
    def demonstration(cls, example) -> list[dict[str, str]]:
        """The episode the warm-up trains on: the first messages, then assistant (and tool)
        messages; with the tool for ``TOOL_DEMO_FRACTION`` of the problems (module docstring)."""
        expr = example.prompt.rstrip("=")
        if zlib.crc32(expr.encode("utf-8")) % 1000 >= 1000 * cls.TOOL_DEMO_FRACTION:
            return [{"role": "user", "content": example.prompt},
                    {"role": "assistant", "content": str(example.answer)}]
        call = json.dumps({"name": cls.TOOL, "arguments": {"expr": expr}}, separators=(",", ":"))
        return [{"role": "user", "content": example.prompt},
                {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "content": calculator(expr)},
                {"role": "assistant", "content": str(example.answer)}]
