"""Coercion of recipe and command-line values to the fields' annotated types.

YAML gives ints, floats, bools, strings, lists and null; an override gives a YAML scalar of its
text. :func:`coerce` converts one to a field's annotation (``int``, ``float`` incl. ``3e-4``,
``bool``, ``str``, ``X | None`` with ``null``/``none``, ``Literal[...]``, ``list[int]`` like
``[1,0,1]``, ``int | list[int]``, ``dict[str, Any]`` like ``{enable_thinking: false}``, a dataclass from a
mapping of its fields like ``{clip_low: 0.01}``) or raises :class:`CoerceError` saying what was expected, with a
closest-name suggestion for an enum value (``GSPO`` -> ``'gspo'``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Iterable, Literal, Union

__all__ = ["CoerceError", "NULL_WORDS", "accepts_str", "coerce", "suggest", "type_name"]


def suggest(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``name``, or ``""``.

    Compared case-insensitively (difflib's ratio alone misses ``GSPO`` -> ``gspo``)."""
    choices = list(choices)
    lowered = {c.lower(): c for c in reversed(choices)}  # the first choice wins a case tie
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


class CoerceError(Exception):
    """A value that does not fit its field's type; ``hint`` is a :func:`suggest` suffix."""

    def __init__(self, msg: str, hint: str = ""):
        super().__init__(msg)
        self.hint = hint


NULL_WORDS = ("null", "none", "~", "")
_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def type_name(tp: Any) -> str:
    """Human-readable type: ``int``, ``float or null``, ``one of 'a', 'b'``, ``list of int``."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        (arg, *_) = typing.get_args(tp) or (Any,)
        return f"list of {type_name(arg)}"
    if origin is dict:
        return "a mapping such as {key: value}"
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp) if f.init)
    return getattr(tp, "__name__", str(tp))


def accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    return _is_union(tp) and any(a is str for a in typing.get_args(tp))


def _is_list_type(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple)


def coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp`` or ``CoerceError`` (message: what was expected)."""
    if tp is Any:
        return value
    if tp is type(None):
        if value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS):
            return None
        raise CoerceError("expected null")
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = typing.get_args(tp)
        if type(None) in args and (
                value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS)):
            return None
        members = [a for a in args if a is not type(None)]
        # Lists try list members first; scalars try scalar members first (so "2" for
        # ``list[int] | int`` is 2, not [2]).
        members.sort(key=lambda a: _is_list_type(a) != isinstance(value, (list, tuple)))
        hint = ""
        for member in members:
            try:
                return coerce(value, member)
            except CoerceError as e:
                if isinstance(value, dict) and dataclasses.is_dataclass(member):
                    raise  # a mapping for a dataclass field: its own error names the key
                hint = hint or e.hint
        raise CoerceError(f"expected {type_name(tp)}", hint)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) or value is None:
            for a in allowed:
                if a == value and type(a) is type(value):
                    return a
        hint = suggest(value, [a for a in allowed if isinstance(a, str)]) if isinstance(value, str) else ""
        raise CoerceError(f"expected {type_name(tp)}", hint)
    if origin in (list, tuple):
        (arg, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [] if not text.strip() else [x.strip() for x in text.split(",")]
        if not isinstance(value, (list, tuple)):
            raise CoerceError(f"expected {type_name(tp)}")
        try:
            return [coerce(x, arg) for x in value]
        except CoerceError:
            raise CoerceError(f"expected {type_name(tp)}") from None
    if origin is dict:
        key_type, value_type = typing.get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise CoerceError(f"expected {type_name(tp)}")
        try:
            return {coerce(k, key_type): coerce(v, value_type) for k, v in value.items()}
        except CoerceError:
            raise CoerceError(f"expected {type_name(tp)} with {type_name(key_type)} keys") from None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _coerce_dataclass(value, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
        raise CoerceError("expected bool (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise CoerceError("expected int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            text = value.strip().replace("_", "")
            try:
                return int(text)
            except ValueError:
                try:
                    f = float(text)
                except ValueError:
                    f = math.nan
                if math.isfinite(f) and f.is_integer():
                    return int(f)
        raise CoerceError("expected int")
    if tp is float:
        if isinstance(value, bool):
            raise CoerceError("expected float")
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip().replace("_", ""))
            except ValueError:
                raise CoerceError("expected float") from None
        else:
            raise CoerceError("expected float")
        if not math.isfinite(out):
            raise CoerceError("expected a finite float")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise CoerceError("expected str")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise CoerceError(f"expected {type_name(tp)}")


def _coerce_dataclass(value: Any, tp: type) -> Any:
    """A mapping of some of ``tp``'s fields (each coerced to its type; the others take their
    defaults) as a ``tp``; an unknown key is an error naming it, with the closest field."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise CoerceError(f"expected {type_name(tp)}")
    hints = typing.get_type_hints(tp)
    names = [f.name for f in dataclasses.fields(tp) if f.init]
    kwargs = {}
    for key, item in value.items():
        if key not in names:
            raise CoerceError(f"unknown key {key!r} (expected {type_name(tp)})",
                              suggest(str(key), names))
        try:
            kwargs[key] = coerce(item, hints[key])
        except CoerceError as e:
            raise CoerceError(f"{key}: {e}", e.hint) from None
    return tp(**kwargs)
