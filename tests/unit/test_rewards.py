"""Reward registry, robust batch scoring, and the built-in rewards."""

from __future__ import annotations

import math
import sys
import threading
import time
import types

import pytest
import torch

from gspo_megatron.data import PromptExample
from gspo_megatron.rewards import (
    arithmetic_exact,
    compute_rewards,
    extract_boxed,
    extract_final_answer,
    extract_hash_answer,
    format_boxed,
    get_reward_fn,
    is_correct,
    list_rewards,
    math_exact,
    register_reward,
)

# ----------------------------------------------------------------------------------- registry


def test_builtins_registered() -> None:
    names = list_rewards()
    for name in ("arithmetic_exact", "math_verify", "math_exact", "format_boxed"):
        assert name in names
    assert get_reward_fn("arithmetic_exact") is arithmetic_exact


def test_register_and_lookup() -> None:
    @register_reward("test_always_half")
    def half(response: str, answer: str, example: PromptExample | None = None) -> float:
        return 0.5

    assert get_reward_fn("test_always_half") is half
    assert get_reward_fn(half) is half  # callables pass through
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_always_half")(lambda r, a, e=None: 1.0)


def test_unknown_name_lists_registered() -> None:
    with pytest.raises(ValueError) as ei:
        get_reward_fn("no_such_reward")
    assert "arithmetic_exact" in str(ei.value) and "math_verify" in str(ei.value)


def test_dotted_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("user_rewards_mod")

    def length_reward(response: str, answer: str, example: PromptExample | None = None) -> float:
        return float(len(response))

    mod.length_reward = length_reward  # type: ignore[attr-defined]
    mod.not_callable = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_rewards_mod", mod)
    assert get_reward_fn("user_rewards_mod:length_reward") is length_reward
    assert get_reward_fn("user_rewards_mod.length_reward") is length_reward
    assert get_reward_fn("gspo_megatron.rewards.math:math_exact") is math_exact
    with pytest.raises(ValueError, match="has no attribute"):
        get_reward_fn("user_rewards_mod:missing")
    with pytest.raises(ValueError, match="not callable"):
        get_reward_fn("user_rewards_mod:not_callable")
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward_fn("definitely_not_a_module_xyz.fn")


def test_missing_optional_dependency_fails_at_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ImportError, match="pip install math-verify"):
        get_reward_fn("math_verify")


# ----------------------------------------------------------------------------------- compute_rewards


def _flaky(response: str, answer: str, example: PromptExample | None = None) -> object:
    if response == "raise":
        raise RuntimeError("boom")
    if response == "hang":
        time.sleep(6.0)  # (the thread runs on after the batch: a hung call cannot be killed)
        return 1.0
    if response == "str":
        return "1.0"
    if response == "nan":
        return float("nan")
    if response == "inf":
        return math.inf
    if response == "none":
        return None
    if response == "tensor":
        return torch.tensor(1.0)
    if response == "bool":
        return True
    return 1.0 if response == answer else 0.0


def test_compute_rewards_counts_failures_and_never_raises() -> None:
    responses = ["7", "8", "raise", "hang", "str", "nan", "inf", "none", "tensor", "bool"]
    answers = ["7"] * len(responses)
    t0 = time.monotonic()
    rewards, stats = compute_rewards(_flaky, responses, answers, timeout_s=0.2)
    assert time.monotonic() - t0 < 3.0  # the hung call (6 s) did not block the batch (0.2 s
    # timeout; the margin is for a loaded machine: 1.6 s was measured under a load of 40)
    assert rewards.dtype == torch.float32 and rewards.shape == (len(responses),)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert stats["reward/errors"] == 1.0
    assert stats["reward/timeouts"] == 1.0
    assert stats["reward/invalid"] == 4.0  # str, nan, inf, None
    assert stats["reward/accuracy"] == pytest.approx(0.3)
    assert stats["reward/mean"] == pytest.approx(0.3)
    assert stats["reward/hung_threads"] >= 1.0


def test_compute_rewards_without_timeout_and_with_workers() -> None:
    responses, answers = ["1", "2", "raise", "nan"], ["1", "1", "1", "1"]
    rewards, stats = compute_rewards(_flaky, responses, answers, timeout_s=None)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (stats["reward/errors"], stats["reward/invalid"], stats["reward/timeouts"]) == (1.0, 1.0, 0.0)
    rewards2, stats2 = compute_rewards(_flaky, responses * 3, answers * 3, timeout_s=1.0, max_workers=4)
    assert rewards2.tolist() == rewards.tolist() * 3
    assert stats2["reward/errors"] == 3.0


def test_compute_rewards_passes_examples_and_checks_lengths() -> None:
    seen: list[object] = []

    def fn(response: str, answer: str, example: PromptExample | None = None) -> float:
        seen.append(example)
        return 1.0

    ex = PromptExample(prompt="p", answer="a", index=4)
    compute_rewards(fn, ["x"], ["a"], [ex], timeout_s=0.5)
    assert seen == [ex]
    compute_rewards(fn, ["x"], ["a"], timeout_s=0.5)
    assert seen[-1] is None
    with pytest.raises(ValueError, match="lengths must match"):
        compute_rewards(fn, ["x", "y"], ["a"])
    empty, stats = compute_rewards(fn, [], [])
    assert empty.shape == (0,) and stats["reward/accuracy"] == 0.0


def test_is_correct() -> None:
    assert is_correct(1.0) and is_correct(0.9999999) and not is_correct(0.5)
    assert is_correct(0.6, threshold=0.5)


# ----------------------------------------------------------------------------------- built-ins


def test_arithmetic_exact() -> None:
    assert arithmetic_exact("19", "19") == 1.0
    assert arithmetic_exact(" 19 \n", "19") == 1.0
    assert arithmetic_exact("19</s>garbage", "19") == 1.0
    assert arithmetic_exact("190", "19") == 0.0
    assert arithmetic_exact("19 3+4=7", "19") == 0.0
    assert arithmetic_exact("", "19") == 0.0


def test_extraction() -> None:
    assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{ {2} }") == "{2}"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"\boxed 5$") == "5"
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{unbalanced") is None
    assert extract_hash_answer("work\n#### 42") == "42"
    assert extract_hash_answer("#### 1\nmore\n#### 2 ") == "2"
    assert extract_hash_answer("no answer") is None
    assert extract_final_answer("#### 3\n\\boxed{4}") == "4"  # boxed wins
    assert extract_final_answer("#### 3</s>#### 9") == "3"  # cut at EOS marker


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        ("Reasoning...\n#### 42", "42", 1.0),
        ("#### 42", "Natalia sold 48/2 = 24 clips...\n#### 42", 1.0),  # GSM8K solution as answer
        ("#### 1,000", "1000", 1.0),
        (r"\boxed{\dfrac{2}{4}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{43}", "42", 0.0),
        ("42", "42", 0.0),  # no boxed / #### answer -> 0
    ],
)
def test_math_rewards(response: str, answer: str, expected: float) -> None:
    assert math_exact(response, answer) == expected
    pytest.importorskip("math_verify")
    assert get_reward_fn("math_verify")(response, answer) == expected


def test_math_verify_symbolic_and_in_worker_thread() -> None:
    pytest.importorskip("math_verify")
    fn = get_reward_fn("math_verify")
    assert fn(r"\boxed{x^2+2x+1}", "(x+1)^2") == 1.0
    # Off the main thread (math-verify's signal-based timeout can't run there).
    rewards, stats = compute_rewards(fn, [r"\boxed{\frac{1}{2}}", "#### 42", r"\boxed{3}"], ["0.5", "42", "4"], timeout_s=5.0)
    assert rewards.tolist() == [1.0, 1.0, 0.0]
    assert stats["reward/errors"] == 0.0 and stats["reward/accuracy"] == pytest.approx(2 / 3)
    assert threading.current_thread() is threading.main_thread()


def test_format_boxed_and_math_exact_normalisation() -> None:
    assert format_boxed(r"ok \boxed{3}", "x") == 1.0 and format_boxed("3", "x") == 0.0
    assert math_exact(r"\boxed{\text{Paris}}", "paris") == 1.0
    assert math_exact(r"\boxed{50\%}", "0.5") == 1.0
    assert math_exact(r"\boxed{-\frac{3}{4}}", "-0.75") == 1.0
    assert math_exact(r"\boxed{3.}", "3") == 1.0
    assert math_exact(r"\boxed{}", "") == 0.0
