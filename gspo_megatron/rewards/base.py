"""The reward function's contract, shared by the registry, the built-in rewards and the worker
processes (a leaf module: it imports none of them).

A reward function has the signature ``fn(response, answer, example=None) -> float``; it is
registered by name with :func:`register_reward` (which also says whether it is cheap enough to run
inline and how a new worker warms it up), and what one call produced is an :data:`Outcome`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from gspo_megatron.data.prompts import PromptExample

Outcome = tuple[Any, "str | None", bool]
"""``(value, error, timed_out)`` of one call: the function's return value converted to a float
(None when it returned something else: ``error`` is then None and the value is invalid), the
exception as ``"Type: message"``, or a timeout."""


class RewardRunner(Protocol):
    """Runs reward calls somewhere else (:class:`~gspo_megatron.rewards.workers.RewardWorkers`)."""

    timeout_s: float

    def run(self, calls: Sequence[tuple[Any, ...]]) -> list[Outcome]:
        """One :data:`Outcome` per ``(response, answer, example)`` call, in order."""


class RewardFn(Protocol):
    """``fn(response, answer, example=None) -> float``."""

    def __call__(self, response: str, answer: str, example: "PromptExample | None" = None) -> float: ...


REGISTERED_REWARDS: dict[str, Callable[..., float]] = {}
REWARD_REQUIREMENTS: dict[str, tuple[str, str]] = {}  # name -> (module to import, pip package)

#: Rewards at or above this count as correct (``reward/accuracy``).
CORRECT_THRESHOLD = 1.0


def register_reward(name: str, requires: tuple[str, str] | None = None, cheap: bool = False,
                    warmup: tuple[str, str] | None = None,
                    ) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Decorator registering a reward function under ``name``.

    Args:
        name: Registry name (used in configs).
        requires: Optional ``(module, pip_package)``: :func:`get_reward_fn` checks the module is
            importable and otherwise fails at lookup, before any compute, saying what to install.
        cheap: The function always returns quickly (a string comparison, no parsing that can
            blow up): it runs inline, with no timeout, thread or worker process.
        warmup: ``(response, answer)`` for one untimed call in each new reward worker (a reward
            whose first call imports or builds something slow).
    """

    def deco(fn: Callable[..., float]) -> Callable[..., float]:
        if name in REGISTERED_REWARDS and REGISTERED_REWARDS[name] is not fn:
            raise ValueError(f"Reward '{name}' is already registered ({REGISTERED_REWARDS[name]!r})")
        REGISTERED_REWARDS[name] = fn
        if requires is not None:
            REWARD_REQUIREMENTS[name] = requires
        if cheap:
            fn.reward_is_cheap = True  # type: ignore[attr-defined]
        if warmup is not None:
            fn.reward_warmup = warmup  # type: ignore[attr-defined]
        return fn

    return deco


def warmup_call(fn: Callable[..., float]) -> tuple[str, str] | None:
    """``(response, answer)`` ``fn`` is called with once in each new worker, before it takes real
    calls (``register_reward(warmup=...)``), else None."""
    return getattr(fn, "reward_warmup", None)


def is_cheap(fn: Callable[..., float]) -> bool:
    """Whether ``fn`` was registered ``cheap=True`` (it runs inline)."""
    return bool(getattr(fn, "reward_is_cheap", False))


def is_correct(reward: float, threshold: float = CORRECT_THRESHOLD) -> bool:
    """Whether a reward counts as a correct answer (``reward >= threshold``, with 1e-6 slack)."""
    return reward >= threshold - 1e-6


def to_float(value: Any) -> float | None:
    """A finite float, or None for anything else (strings, None, NaN, inf, multi-element)."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if hasattr(value, "numel") and hasattr(value, "item"):  # a tensor (torch is not imported
        if value.numel() != 1:                              # in reward worker processes)
            return None
        value = value.item()
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


