"""The ``loss`` section of a recipe (:data:`PolicyLossConfig`), generated from the registry.

Its fields: ``variant`` (a registered loss), ``aggregation``, ``kl_coef``, then every knob of
every registered loss (the fields of their :class:`~.base.LossParams`), each typed ``T | None``
where ``null`` means the variant's own default (the paper's). A knob another variant reads but
``variant`` does not is an error naming the field; so is an aggregation the variant does not
take; values are checked by the loss's own params. Knobs shared by several losses
(``clip_low``, ``clip_high``) keep one field with a per-variant default, as verl's and TRL's
configs do; each variant's meaning and default are listed in the field's help.

Then one field per variant that has knobs, named after it (``gspo``, ``sapo`` ...): that loss's knobs as a
mapping (``gspo: {clip_low: 1.0e-2}``), read only while ``variant`` is that loss. A recipe
keeps its tuned values there, so ``--loss.variant=OTHER`` switches loss with one override (OTHER
takes its own defaults) instead of failing on, or silently reusing, another loss's eps.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import warnings
from typing import Any, Iterator, Literal, Optional

from gspo_megatron.sections import Problem, Section, field_docs

from .aggregations import AGGREGATIONS
from .base import LossSpec
from .registry import LOSSES

__all__ = ["PolicyLossConfig"]


def _reads(spec: LossSpec) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(spec.params))


class LossSection(Section, name="loss"):
    """The policy loss. ``variant`` picks a registered loss (gspo_megatron/algorithms/losses/);
    every other field but ``aggregation`` and ``kl_coef`` is a knob of one or more variants:
    null takes that variant's paper default, a knob the variant does not read is an error. Invalid values raise FieldError naming the field."""

    @property
    def spec(self) -> LossSpec:
        """The registered loss of ``variant``."""
        return LOSSES[self.variant]

    @property
    def params(self) -> Any:
        """The variant's knobs, resolved: the flat knobs set here, then the variant's own block
        (``loss.<variant>``), then its defaults."""
        spec = self.spec
        block = getattr(self, self.variant, None) or spec.params()
        return dataclasses.replace(block, **{k: getattr(self, k) for k in _reads(spec)
                                             if getattr(self, k) is not None})

    @property
    def resolved_aggregation(self) -> str:
        """``aggregation``, or the variant's default (the first it lists) when null."""
        return self.aggregation or self.spec.aggregations[0]

    def _clip(self, name: str) -> float:
        if name not in _reads(self.spec):
            raise ValueError(f"loss variant {self.variant!r} has no {name} (it reads "
                             f"{list(_reads(self.spec))})")
        return float(getattr(self.params, name))

    @property
    def eps_low(self) -> float:
        """Resolved ``clip_low`` of a variant that has one."""
        return self._clip("clip_low")

    @property
    def eps_high(self) -> float:
        """Resolved ``clip_high`` of a variant that has one."""
        return self._clip("clip_high")

    def _problems(self) -> Iterator[Problem]:
        spec = LOSSES.get(self.variant)
        if spec is not None:  # (an unknown variant is reported by the Literal check)
            reads = _reads(spec)
            for knob in type(self).knobs:
                if getattr(self, knob) is not None and knob not in reads:
                    readers = ", ".join(repr(v) for v, s in LOSSES.items() if knob in _reads(s))
                    yield ((knob, "variant"), f"not read by variant={self.variant!r} (only by "
                           f"{readers}); leave it unset (null) or pick one of those")
            agg = self.aggregation
            if agg in AGGREGATIONS and agg not in spec.aggregations:
                yield (("aggregation", "variant"),
                       f"{agg!r} is not an aggregation of variant={self.variant!r}; it takes "
                       f"{', '.join(repr(a) for a in spec.aggregations)} (default "
                       f"{spec.aggregations[0]!r})")
            block = getattr(self, self.variant, None)
            for fields, text in self.params.problems():
                if block is not None and getattr(self, fields[0], None) is None:
                    # The value came from the variant's block: name it there.
                    fields = (f"{self.variant}.{fields[0]}", self.variant, *fields[1:])
                yield fields, text
            for name in LOSSES:
                other = getattr(self, name, None)
                if name != self.variant and other is not None:
                    for fields, text in other.problems():
                        yield (f"{name}.{fields[0]}", name, *fields[1:]), text
        kl = self.kl_coef
        if isinstance(kl, bool) or not isinstance(kl, (int, float)) or not (
                math.isfinite(kl) and kl >= 0):
            yield ("kl_coef",), f"must be a finite float >= 0, got {kl!r}"

    def __post_init__(self) -> None:
        super().__post_init__()
        for message in self.params.warnings(self.variant):
            # Python's default filter shows it once per calling line (a run builds its loss
            # config once); no process-wide flag of our own.
            warnings.warn(message, UserWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class _Shared:
    """The fields every variant reads (their docstrings; the generated section adds the rest)."""

    aggregation: str | None = None
    """How the per-token (or per-sequence) terms become the loss; null = the variant's default
    (its paper's)."""

    kl_coef: float = 0.0
    """Weight of the k3 KL penalty ``exp(ref - logp) - (ref - logp) - 1`` to the reference policy
    (needs ``trainer.reference_model``), aggregated as the policy term. 0 disables it."""


def _knobs() -> dict[str, tuple[Any, list[tuple[str, Any, str]]]]:
    """``{knob: (type, [(variant, default, doc), ...])}`` over the registry, in order of first
    appearance; a knob two losses declare with different types is a bug in one of them."""
    out: dict[str, tuple[Any, list[tuple[str, Any, str]]]] = {}
    for spec in LOSSES.values():
        hints, docs = typing.get_type_hints(spec.params), field_docs(spec.params)
        for f in dataclasses.fields(spec.params):
            tp, readers = out.setdefault(f.name, (hints[f.name], []))
            if tp != hints[f.name]:
                raise TypeError(f"loss knob {f.name!r}: {spec.name} declares {hints[f.name]}, "
                                f"another loss {tp}")
            readers.append((spec.name, f.default, docs.get(f.name, "")))
    return out


def _knob_doc(readers: list[tuple[str, Any, str]]) -> str:
    """One paragraph per (default, doc) shared by some variants."""
    groups: dict[tuple[str, str], list[str]] = {}
    for variant, default, doc in readers:
        groups.setdefault(("null (off)" if default is None else f"{default:g}", doc), []).append(
            variant)
    return "\n\n".join(f"{', '.join(variants)} (default {default}): {doc}"
                       for (default, doc), variants in groups.items())


def _build() -> type:
    knobs = _knobs()
    shared = field_docs(_Shared)
    docs = {"variant": "The registered loss:\n\n" + "\n\n".join(
        f"{name}: {spec.summary}." for name, spec in LOSSES.items())}
    docs["aggregation"] = shared["aggregation"] + "\n\n" + "\n\n".join(
        f"{name}: {agg.doc}. Taken by " + ", ".join(
            v + (" (its default)" if s.aggregations[0] == name else "")
            for v, s in LOSSES.items() if name in s.aggregations) + "."
        for name, agg in AGGREGATIONS.items())
    docs["kl_coef"] = shared["kl_coef"]
    fields: list[tuple[str, Any, Any]] = [
        ("variant", Literal[tuple(LOSSES)], dataclasses.field(default="gspo")),
        ("aggregation", Optional[Literal[tuple(AGGREGATIONS)]], dataclasses.field(default=None)),
        ("kl_coef", float, dataclasses.field(default=0.0)),
    ]
    for name, (tp, readers) in knobs.items():
        fields.append((name, Optional[tp], dataclasses.field(default=None)))
        docs[name] = _knob_doc(readers)
    for name, spec in LOSSES.items():
        if not _reads(spec):
            continue  # (gpg: no knobs)
        if name in docs:
            raise TypeError(f"loss variant {name!r} has the name of a loss field")
        fields.append((name, Optional[spec.params], dataclasses.field(default=None)))
        docs[name] = (
            f"The knobs of variant {name!r} ({', '.join(_reads(spec))}), read only "
            f"while ``variant`` is {name!r}; null or a knob left out takes its default. A recipe "
            f"tuned for one loss keeps its values here, so that ``--loss.variant=OTHER`` runs "
            f"OTHER with its own defaults. One knob: ``--loss.{name}.KNOB=VALUE``. A flat knob "
            f"(``loss.clip_low`` ...) set as well wins over this block.")
    return dataclasses.make_dataclass(
        "PolicyLossConfig", fields, bases=(LossSection,), frozen=True, kw_only=True,
        namespace={"__module__": __name__, "__doc__": LossSection.__doc__,
                   "__field_docs__": docs, "knobs": tuple(knobs)})


PolicyLossConfig = _build()
"""The ``loss`` section (a frozen dataclass, keyword-only): ``PolicyLossConfig(variant="sapo",
tau_neg=1.1)``. Generated once at import from :data:`~.registry.LOSSES`."""
