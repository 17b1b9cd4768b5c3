"""Typed config sections (``Section``): each section's own checks, run by its ``__post_init__``: a
section that exists is consistent. Kept outside ``gspo_megatron.config`` so that components owning
a section (e.g. :mod:`gspo_megatron.algorithms.rollout_correction`) import it without the config
package (which imports them).

A section lists its problems (a field out of range, two fields of the same section that disagree)
in ``_problems``; :meth:`Section.check` raises them together as one :class:`FieldError`. Checks
that need more than one section (batch divisibility, layout vs world size, lengths, paths, the
reward function) live in :func:`gspo_megatron.config.validation.validate_config`.

A problem is the fields it is about (its subject first) and a text that follows the subject's
name: raised directly it reads ``rollout.top_p must be in (0, 1], got 1.5``; through the loader,
which points at the recipe line or override that set one of the fields,
``recipe.yaml:12: rollout.top_p: must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Iterator, Literal, Sequence, Union

Problem = tuple[tuple[str, ...], str]
"""``(fields, text)``: the fields involved (the subject first) and what is wrong with the subject
(``"must be >= 1, got 0"``), phrased to follow its name."""


class FieldError(ValueError):
    """One or more invalid fields of section ``section``; ``problems`` lists them."""

    def __init__(self, section: str, problems: Sequence[Problem]):
        self.section = section
        self.problems = list(problems)
        super().__init__("\n".join(self.messages))

    @property
    def messages(self) -> list[str]:
        """One ``section.field text`` line per problem."""
        return [f"{self.section}.{fields[0]} {text}" for fields, text in self.problems]


@functools.lru_cache(maxsize=None)
def _literal_fields(cls: type) -> dict[str, tuple]:
    """``{field: allowed values}`` for the fields annotated ``Literal[...]`` (or ``... | None``)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        union = typing.get_origin(tp) in (Union, types.UnionType)
        members = typing.get_args(tp) if union else (tp,)
        allowed: tuple = ()
        for member in members:
            if typing.get_origin(member) is Literal:
                allowed += typing.get_args(member)
            elif member is type(None):
                allowed += (None,)
            else:  # a union with a non-Literal member (``int | list[int]``): not an enum
                allowed = ()
                break
        if allowed and any(a is not None for a in allowed):
            out[f.name] = allowed
    return out


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for a dataclass: the string literal right after each field in its
    source, or the class's ``__field_docs__`` mapping when it has one (a section generated from
    other classes' fields, as the ``loss`` section is from the registered losses')."""
    generated = getattr(cls, "__field_docs__", None)
    if generated is not None:
        return dict(generated)
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return {}
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


class Section:
    """Base of the config dataclasses: ``__post_init__`` runs :meth:`check`.

    Subclasses name their section (``class RolloutConfig(Section, name="rollout")``), used in the
    messages, and yield their problems from ``_problems``. The values of ``Literal`` fields are
    checked here for every section.
    """

    _section = "section"

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls._section = name

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`FieldError` listing every problem of this section. Runs on construction;
        call it again after changing a field in place (``validate_config`` does)."""
        problems = list(self._enum_problems()) + list(self._problems())
        if problems:
            raise FieldError(self._section, problems)

    def _problems(self) -> Iterator[Problem]:
        return iter(())

    def _enum_problems(self) -> Iterator[Problem]:
        for name, allowed in _literal_fields(type(self)).items():
            value = getattr(self, name)
            if value not in allowed or type(value) not in {type(a) for a in allowed}:
                shown = ", ".join("null" if a is None else repr(a) for a in allowed)
                yield (name,), f"must be one of {shown}, got {value!r}"

    # Helpers for the common single-field checks ------------------------------------------------

    def _at_least(self, low: float, *names: str, note: str = "") -> Iterator[Problem]:
        """``name >= low`` for each field (``None`` passes: optional fields mean "unset")."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < low:
                yield (name,), f"must be >= {low}{note}, got {value}"

    def _positive(self, *names: str) -> Iterator[Problem]:
        """``name > 0`` for each field."""
        for name in names:
            value = getattr(self, name)
            if not value > 0:
                yield (name,), f"must be > 0, got {value}"

    @staticmethod
    def _problem(fields: str | tuple[str, ...], text: str) -> Problem:
        """A problem about ``fields`` (one name or several, the subject first)."""
        return ((fields,) if isinstance(fields, str) else tuple(fields)), text
