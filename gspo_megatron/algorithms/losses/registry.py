"""The registered policy losses: ``loss.variant`` picks one by name.

The one table of the registry. A loss is a module of this package with a ``LOSS``
(:class:`~.base.LossSpec`); adding one is that module, its line here and its test.
"""

from __future__ import annotations

from types import MappingProxyType

from . import cispo, gmpo, gpg, grpo, gspo, gspo_token, sapo
from .base import LossSpec

__all__ = ["LOSSES", "get_loss"]

LOSSES: "MappingProxyType[str, LossSpec]" = MappingProxyType({spec.name: spec for spec in (
    gspo.LOSS,
    gspo_token.LOSS,
    grpo.LOSS,
    sapo.LOSS,
    cispo.LOSS,
    gmpo.LOSS,
    gpg.LOSS,
)})
"""``{variant: LossSpec}`` in the order ``gspo-train --help`` lists them; read-only."""


def get_loss(variant: str) -> LossSpec:
    """The registered loss ``variant`` (KeyError naming the choices otherwise)."""
    try:
        return LOSSES[variant]
    except KeyError:
        raise KeyError(f"unknown loss variant {variant!r}; registered: {list(LOSSES)}") from None
