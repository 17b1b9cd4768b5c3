"""Built-in verifiable rewards: arithmetic exact match and math answers.

All rewards follow ``fn(response, answer, example=None) -> float`` and return 1.0 (correct) or
0.0. Registered names:

* ``arithmetic_exact``: the response, stripped and cut at the first EOS marker, equals the answer
  (the built-in arithmetic task).
* ``math_verify``: the final answer is taken from the response's last ``\\boxed{...}`` or, failing
  that, a GSM8K-style ``#### 42`` line, and checked against the reference with the
  ``math-verify`` package (symbolic equivalence: ``\\frac{1}{2}`` == ``0.5``). A response with
  neither form scores 0. Needs ``pip install math-verify``.
* ``math_exact``: the same extraction, then a dependency-free comparison of normalised numbers
  (integers, decimals, ``a/b``, ``\\frac{a}{b}``, thousands separators) or normalised strings.
* ``format_boxed``: 1.0 if the response contains a ``\\boxed{...}`` answer.
"""

from __future__ import annotations

import re
import sys
import threading
from fractions import Fraction
from typing import TYPE_CHECKING

from gspo_megatron.rewards.base import register_reward

if TYPE_CHECKING:  # pragma: no cover
    from gspo_megatron.data.prompts import PromptExample

__all__ = [
    "EOS_MARKERS",
    "arithmetic_exact",
    "extract_boxed",
    "extract_final_answer",
    "extract_hash_answer",
    "format_boxed",
    "math_exact",
    "math_verify_reward",
    "normalize_answer",
]

#: Textual end markers cut from responses decoded without skipping special tokens.
EOS_MARKERS: tuple[str, ...] = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*?)[ \t]*$", re.MULTILINE)


def _cut_eos(text: str) -> str:
    for marker in EOS_MARKERS:
        pos = text.find(marker)
        if pos >= 0:
            text = text[:pos]
    return text


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), braces balanced."""
    matches = list(_BOXED_RE.finditer(text))
    for m in reversed(matches):
        pos = m.end()
        if pos < len(text) and text[pos] == "{":
            depth = 0
            for j in range(pos, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[pos + 1 : j].strip()
            continue  # unbalanced: try an earlier one
        bare = re.match(r"[^\s$]+", text[pos:])
        if bare:
            return bare.group(0).strip()
    return None


def extract_hash_answer(text: str) -> str | None:
    """The answer on the last GSM8K-style ``#### answer`` line, or None."""
    matches = [m.strip() for m in _HASH_RE.findall(text) if m.strip()]
    return matches[-1] if matches else None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a response: last ``\\boxed{}``, else last ``####`` line, else None."""
    text = _cut_eos(text)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    return extract_hash_answer(text)


def _gold(answer: str) -> str:
    """Reference answers may themselves be full solutions (GSM8K ``#### 42``) or boxed."""
    extracted = extract_final_answer(answer)
    return extracted if extracted is not None else answer.strip()


_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC_RE = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?)\\frac(\d)(\d)$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalize_answer(text: str) -> str:
    """Canonical string form of an answer: LaTeX spacing/markup and units of notation removed."""
    s = text.strip()
    s = _TEXT_RE.sub(r"\1", s)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                     ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("$", ""), ("^\\circ", ""),
                     ("^{\\circ}", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return s


_MAX_EXPONENT = 400
"""Answers written with a larger decimal exponent are compared as text: ``Fraction("1e999999999")``
builds a billion-digit integer (minutes of CPU and gigabytes for one model output)."""
_EXPONENT_RE = re.compile(r"[eE][+-]?0*(\d+)")


def _to_fraction(s: str) -> Fraction | None:
    exponent = _EXPONENT_RE.search(s)
    digits = exponent.group(1) if exponent else ""
    if len(digits) > 3 or (digits and int(digits) > _MAX_EXPONENT):
        return None
    try:
        return Fraction(s)  # ints, decimals, "a/b", "1e3"
    except (ValueError, ZeroDivisionError):
        pass
    m = _FRAC_RE.match(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5), m.group(6))
        try:
            value = Fraction(int(num), int(den))
        except ZeroDivisionError:
            return None
        return -value if sign else value
    if s.endswith("\\%") or s.endswith("%"):
        inner = _to_fraction(s[: -2 if s.endswith("\\%") else -1])
        return inner / 100 if inner is not None else None
    return None


def _answers_match(pred: str, gold: str) -> bool:
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return bool(p)
    fp, fg = _to_fraction(p), _to_fraction(g)
    if fp is not None and fg is not None:
        return fp == fg
    return p.lower() == g.lower()


@register_reward("arithmetic_exact", cheap=True)
def arithmetic_exact(response: str, answer: str, example: "PromptExample | None" = None) -> float:
    """1.0 if the response (stripped, up to the first EOS marker) equals the answer exactly."""
    return 1.0 if _cut_eos(response).strip() == answer.strip() else 0.0


@register_reward("math_exact", cheap=True)
def math_exact(response: str, answer: str, example: "PromptExample | None" = None) -> float:
    """1.0 if the extracted final answer equals the reference after normalisation (no deps)."""
    pred = extract_final_answer(response)
    if pred is None:
        return 0.0
    return 1.0 if _answers_match(pred, _gold(answer)) else 0.0


def _silence_math_verify_timeout_warning() -> None:
    """math-verify warns once that its own timeout is off; here the caller's timeout applies."""
    for name in ("math_verify.parser", "math_verify.grader"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True


@register_reward("math_verify", requires=("math_verify", "math-verify"),
                 warmup=("\\boxed{\\frac{\\sqrt{2}}{2} x^2 + 1}", "\\frac{x^2}{\\sqrt{2}} + 1"))
def math_verify_reward(response: str, answer: str, example: "PromptExample | None" = None) -> float:
    """1.0 if math-verify finds the extracted final answer equivalent to the reference.

    math-verify's own timeouts use ``signal.alarm``, which only works in the main thread; off the
    main thread (e.g. under :func:`~gspo_megatron.rewards.registry.compute_rewards` with a
    timeout) they are switched off and the caller's timeout applies instead.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("The 'math_verify' reward needs math-verify: `pip install math-verify`") from None
    pred = extract_final_answer(response)
    if pred is None:
        return 0.0
    gold = _gold(answer)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        _silence_math_verify_timeout_warning()
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=timeout)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return 1.0 if _answers_match(pred, gold) else 0.0
    if verify(gold_parsed, pred_parsed, timeout_seconds=timeout):
        return 1.0
    return 1.0 if _answers_match(pred, gold) else 0.0


@register_reward("format_boxed", cheap=True)
def format_boxed(response: str, answer: str, example: "PromptExample | None" = None) -> float:
    """1.0 if the response contains a ``\\boxed{...}`` final answer (format-only reward)."""
    return 1.0 if extract_boxed(_cut_eos(response)) is not None else 0.0
