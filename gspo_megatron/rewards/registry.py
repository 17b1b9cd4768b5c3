"""Reward-function registry and a batch scorer that never crashes the run.

A reward function has the signature::

    def my_reward(response: str, answer: str, example: PromptExample | None = None) -> float

``response`` is the decoded generated text (special tokens skipped), ``answer`` the example's
reference answer, ``example`` the full :class:`~gspo_megatron.data.PromptExample` (metadata,
messages) when available. It returns a finite float; by convention 1.0 means fully correct.

Register one with ``@register_reward("name")``, or point the config at any importable function
with a dotted path (``"my_pkg.my_module:my_reward"`` or ``"my_pkg.my_module.my_reward"``).

:func:`compute_rewards` scores a batch: an exception, a timeout or a non-numeric / non-finite
return gives reward 0 for that response and is counted in the stats; the run goes on.

Where a call runs (the rule, stated here once, applied in :func:`compute_rewards`):

* **inline**, in the caller's thread, for rewards registered ``cheap=True`` (exact-match string
  checks: bounded and ~microseconds; a thread or a process per call would cost 100x the call) and
  when no timeout is asked for;
* in a **pool of worker processes** (:class:`~gspo_megatron.rewards.workers.RewardWorkers`,
  ``reward.num_workers``) when one is given: calls run in parallel across cores and a call past
  its timeout is stopped by killing its worker, which is replaced;
* otherwise in **one daemon thread per call**, waited on with ``join(timeout)``. Python cannot
  kill a thread: a call that never returns keeps its thread (and a share of the GIL) alive until
  the process exits; such threads are counted in ``reward/hung_threads``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from gspo_megatron.rewards import math as builtin_rewards  # noqa: F401  (registers the built-ins)
from gspo_megatron.rewards.base import (REGISTERED_REWARDS, REWARD_REQUIREMENTS, CORRECT_THRESHOLD, Outcome, RewardFn,
                                        RewardRunner, is_cheap, is_correct, register_reward,
                                        to_float, warmup_call)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from gspo_megatron.data.prompts import PromptExample

__all__ = [
    "CORRECT_THRESHOLD",
    "RewardFn",
    "compute_rewards",
    "get_reward_fn",
    "is_cheap",
    "is_correct",
    "list_rewards",
    "register_reward",
    "warmup_call",
]

logger = logging.getLogger(__name__)

_HUNG: list[threading.Thread] = []  # timed-out threads, kept to report how many are still alive


def list_rewards() -> list[str]:
    """Names of all registered reward functions."""
    return sorted(REGISTERED_REWARDS)


def _import_user_module(path: str, module_name: str, search_dirs: Sequence[str] = (),
                        what: str = "Reward"):
    """Import the user's reward module, from ``sys.path``, else the current directory, else
    ``search_dirs`` (the recipe's directory): a ``rewards.py`` next to the recipe is found without
    setting ``PYTHONPATH`` (the ``gspo-train`` console script's ``sys.path`` does not hold the
    working directory, ``python -m`` does), from wherever the command runs.

    Every failure is one line naming the module and, for a syntax error, ``file:line``; an
    exception raised while the module runs is reported with its type and message only."""
    added = []
    top = module_name.split(".")[0]
    if top not in sys.modules and importlib.util.find_spec(top) is None:
        for d in (os.getcwd(), *(os.path.abspath(d) for d in search_dirs)):
            if d not in sys.path and d not in added:
                added.append(d)
        sys.path.extend(added)  # after everything else: never shadows an installed package
    try:
        return importlib.import_module(module_name)
    except SyntaxError as e:
        raise ValueError(f"{what} '{path}': {e.filename}:{e.lineno}: syntax error in module "
                         f"'{module_name}': {e.msg}") from None
    except ImportError as e:
        raise ValueError(f"{what} '{path}': cannot import module '{module_name}': {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while being imported
        raise ValueError(f"{what} '{path}': importing module '{module_name}' raised "
                         f"{type(e).__name__}: {e}") from None
    finally:
        for d in added:
            sys.path.remove(d)


def import_dotted(path: str, search_dirs: Sequence[str] = (), what: str = "Reward") -> Any:
    """The object ``package.module:attr`` (or ``package.module.attr``) names, its module looked up
    as :func:`get_reward_fn` says; every failure one ``ValueError`` line starting
    ``{what} '{path}'`` (a reward function, an environment class)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} '{path}' is not 'package.module:function' or 'package.module.function'")
    module = _import_user_module(path, module_name, search_dirs, what)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} '{path}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} '{path}' is not callable ({type(obj).__name__})")
    return obj


def get_reward_fn(name: str | Callable[..., float],
                  search_dirs: Sequence[str] = ()) -> Callable[..., float]:
    """Resolve a reward: a registered name, a dotted path to a function, or a callable (as is).
    A dotted path's module is looked up on ``sys.path``, then in the current directory, then in
    ``search_dirs`` (the recipe's directory).

    Raises:
        ValueError: Unknown name (lists the registered ones) or a dotted path that cannot be
            imported.
        ImportError: The reward needs an optional package that is not installed.
    """
    if callable(name):
        return name
    if name in REGISTERED_REWARDS:
        if name in REWARD_REQUIREMENTS:
            module, package = REWARD_REQUIREMENTS[name]
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"Reward '{name}' needs the '{package}' package: `pip install {package}`")
        return REGISTERED_REWARDS[name]
    if "." in name or ":" in name:
        return import_dotted(name, search_dirs)
    raise ValueError(
        f"Unknown reward '{name}'. Registered rewards: {', '.join(sorted(REGISTERED_REWARDS))}; "
        "or give a dotted path 'package.module:function'"
    )


class _Call:
    """One reward call run in a daemon thread; result or exception kept on the object."""

    __slots__ = ("done", "error", "result", "thread")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name="gspo-reward")

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - report everything, never crash the run
            self.error = e
        self.done = True


def _run_inline(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list["Outcome"]:
    outcomes: list[Outcome] = []
    for args in calls:
        try:
            outcomes.append((fn(*args), None, False))
        except Exception as e:  # noqa: BLE001 - never crash the run
            outcomes.append((None, f"{type(e).__name__}: {e}", False))
    return outcomes


def _run_in_threads(fn: Callable[..., Any], calls: list[tuple[Any, ...]], timeout_s: float,
                    max_workers: int, hung: list[threading.Thread]) -> list["Outcome"]:
    """Calls in groups of ``max_workers`` daemon threads; a call past ``timeout_s`` is abandoned
    (its thread is appended to ``hung``: it cannot be stopped)."""
    outcomes: list[Outcome] = []
    step = max(1, int(max_workers))
    for lo in range(0, len(calls), step):
        group = [_Call(fn, args) for args in calls[lo:lo + step]]
        starts = []
        for call in group:
            starts.append(time.monotonic())
            call.thread.start()
        for start, call in zip(starts, group):
            call.thread.join(max(0.0, start + timeout_s - time.monotonic()))
            if not call.done:
                hung.append(call.thread)
                outcomes.append((None, None, True))
            elif call.error is not None:
                outcomes.append((None, f"{type(call.error).__name__}: {call.error}", False))
            else:
                outcomes.append((call.result, None, False))
    return outcomes


def compute_rewards(
    fn: Callable[..., float],
    responses: Sequence[str],
    answers: Sequence[str],
    examples: Sequence["PromptExample | None"] | None = None,
    timeout_s: float | None = 10.0,
    max_workers: int = 1,
    correct_threshold: float = CORRECT_THRESHOLD,
    workers: RewardRunner | None = None,
) -> tuple["torch.Tensor", dict[str, float]]:
    """Score ``responses`` against ``answers`` with ``fn``, never raising for a bad call.

    Args:
        fn: Reward function (see the module docstring for the signature).
        responses, answers: Same length N.
        examples: Optional examples (length N), passed as the third argument.
        timeout_s: Wall-clock limit per call; ``None`` or ``<= 0`` calls ``fn`` directly in this
            thread with no limit (and exceptions are still caught).
        max_workers: Thread path only: calls run concurrently in groups of this size (helps
            I/O-bound rewards, e.g. remote judges).
        correct_threshold: Reward at or above which a response counts as correct.
        workers: A started pool of reward processes for ``fn`` (the module docstring says when it
            is used); its own ``timeout_s`` applies.

    Returns:
        ``(rewards, stats)``: a float32 tensor ``[N]`` and a dict with ``reward/mean``,
        ``reward/std``, ``reward/accuracy``, ``reward/errors``, ``reward/timeouts``,
        ``reward/invalid`` and ``reward/hung_threads``.
    """
    import torch

    n = len(responses)
    if len(answers) != n or (examples is not None and len(examples) != n):
        raise ValueError(
            f"compute_rewards: {n} responses, {len(answers)} answers, "
            f"{'no' if examples is None else len(examples)} examples; lengths must match"
        )
    calls = [(responses[i], answers[i], None if examples is None else examples[i]) for i in range(n)]
    if is_cheap(fn) or timeout_s is None or timeout_s <= 0:
        outcomes = _run_inline(fn, calls)
    elif workers is not None:
        outcomes = workers.run(calls)
        timeout_s = workers.timeout_s
    else:
        outcomes = _run_in_threads(fn, calls, timeout_s, max_workers, _HUNG)

    rewards = [0.0] * n
    errors = timeouts = invalid = 0
    first_problem: str | None = None
    for i, (value, error, timed_out) in enumerate(outcomes):
        if timed_out:
            timeouts += 1
            first_problem = first_problem or f"response {i}: timed out after {timeout_s}s"
        elif error is not None:
            errors += 1
            first_problem = first_problem or f"response {i}: {error}"
        else:
            out = to_float(value)
            if out is None:
                invalid += 1
                first_problem = first_problem or f"response {i}: non-numeric or non-finite reward {value!r:.80}"
            else:
                rewards[i] = out

    _HUNG[:] = [t for t in _HUNG if t.is_alive()]
    if first_problem is not None:
        logger.warning(
            "Reward function %s: %d errors, %d timeouts, %d invalid of %d (scored 0). First: %s",
            getattr(fn, "__name__", fn), errors, timeouts, invalid, n, first_problem,
        )
    tensor = torch.tensor(rewards, dtype=torch.float32)
    stats = {
        "reward/mean": float(tensor.mean()) if n else 0.0,
        "reward/std": float(tensor.std(unbiased=False)) if n else 0.0,
        "reward/accuracy": (sum(is_correct(r, correct_threshold) for r in rewards) / n) if n else 0.0,
        "reward/errors": float(errors),
        "reward/timeouts": float(timeouts),
        "reward/invalid": float(invalid),
        "reward/hung_threads": float(len(_HUNG)),
    }
    return tensor, stats
