"""A rank's in-flight rollout state as data that ``torch.load(..., weights_only=True)`` reads.

A checkpoint's per-rank state (the rollouts in flight: :data:`gspo_megatron.policy.RANK_STATE_KEY`)
holds a few of our own records (the samples of a step already rolled out, their prompts) beside
tensors, numbers, strings and containers. Pickled as objects, loading it would run whatever a
checkpoint directory from elsewhere holds. Instead :func:`encode` writes each record as a mapping
``{TYPE_KEY: "module:Class", "fields": {...}}`` and :func:`decode` rebuilds only the classes named
in :data:`RECORD_TYPES` (plain-data dataclasses and named tuples, rebuilt field by field: no code
of the checkpoint's choosing runs). Sets, numpy arrays and torch dtypes/devices get their own
tags. Anything else is refused when the checkpoint is written, naming the type.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT", "RECORD_TYPES", "TYPE_KEY", "decode", "encode"]

FORMAT = "gspo-rank-state/1"
"""The ``format`` of a file written by :func:`encode` (its top level: ``{"format", "state"}``)."""

TYPE_KEY = "__gspo_type__"
"""The key that marks an encoded value that is not a plain container."""

RECORD_TYPES = (
    "gspo_megatron.stages:StepSamples",
    "gspo_megatron.policy:RolloutSample",
    "gspo_megatron.data.prompts:PromptExample",
    # The dynamic engine's held requests at a stop signal (engine/dynamic.py held_state): ints.
    "megatron.core.inference.batch_dimensions_utils:InferenceBatchDimensions",
)
"""The records a rank state may hold, rebuilt from their fields on load. A class added here must
be plain data: fields of tensors, numbers, strings, containers or other records."""

_SCALARS = (type(None), bool, int, float, str, bytes)


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(obj: Any) -> Any:
    """``obj`` as tensors, scalars, lists, tuples and dicts (``weights_only``-loadable).
    Raises TypeError naming a value of a type it cannot write."""
    if isinstance(obj, _SCALARS) or torch.is_tensor(obj):
        return obj
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    cls = type(obj)
    if isinstance(obj, tuple) and hasattr(cls, "_fields") or dataclasses.is_dataclass(obj):
        if _name(cls) not in RECORD_TYPES:
            raise TypeError(f"rank state: {_name(cls)} is not in plain_state.RECORD_TYPES")
        names = cls._fields if isinstance(obj, tuple) else [f.name for f in dataclasses.fields(obj)]
        return {TYPE_KEY: _name(cls), "fields": {n: encode(getattr(obj, n)) for n in names}}
    if isinstance(obj, tuple):
        return tuple(encode(v) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return {TYPE_KEY: "set", "items": [encode(v) for v in obj]}
    if isinstance(obj, np.ndarray):
        return {TYPE_KEY: "numpy", "tensor": torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return {TYPE_KEY: "torch.dtype", "name": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {TYPE_KEY: "torch.device", "name": str(obj)}
    raise TypeError(f"rank state: cannot write a {_name(cls)} (plain_state.encode)")


def _record(name: str, fields: dict) -> Any:
    if name not in RECORD_TYPES:
        raise ValueError(f"unknown record type {name!r} (not in plain_state.RECORD_TYPES)")
    module, _, qualname = name.partition(":")
    cls = getattr(importlib.import_module(module), qualname)
    if issubclass(cls, tuple):
        return cls(**fields)
    obj = object.__new__(cls)  # field by field: no __init__ / __post_init__ of a file's choosing
    for key, value in fields.items():
        object.__setattr__(obj, key, value)
    return obj


def decode(obj: Any) -> Any:
    """The value :func:`encode` wrote. Raises ValueError for a tag it does not know."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode(v) for v in obj)
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(TYPE_KEY)
    if tag is None:
        return {k: decode(v) for k, v in obj.items()}
    if tag == "set":
        return set(decode(v) for v in obj["items"])
    if tag == "numpy":
        return obj["tensor"].numpy()
    if tag == "torch.dtype":
        dtype = getattr(torch, obj["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {obj['name']!r}")
        return dtype
    if tag == "torch.device":
        return torch.device(obj["name"])
    return _record(tag, {k: decode(v) for k, v in obj["fields"].items()})
