"""A built-in, verifiable arithmetic task that needs no download (demo and tests).

Problems look like ``"12+7="`` with answer ``"19"``: two operands from a configurable range and
an operator from ``ops`` (``+``, ``-``; ``*`` is also accepted). The format is deliberately short
so a tiny model (hidden 64-128, a few layers) can learn it on a CPU in minutes.

Train / held-out split: every problem belongs to exactly one split, decided by a stable hash
(CRC32) of its text, so held-out problems never appear in any training set, whatever the seed or
size asked for. Generation is deterministic given ``seed``.

A second, longer task for studies that need long responses (``data.source: arithmetic_chain``):
``"7+5-3+9+2-6="`` with the answer written out one step at a time, ``"7+5=12,12-3=9,9+9=18,
18+2=20,20-6=14"`` (about 35 characters, one token each with the character tokenizer). The
running value never goes negative. :func:`make_chain_dataset` builds it.

The matching reward is ``arithmetic_exact`` in :mod:`gspo_megatron.rewards.math` (for chains: the
whole worked answer, so every step must be right).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from gspo_megatron.data.prompts import PromptExample

if TYPE_CHECKING:  # pragma: no cover
    from gspo_megatron.tokenizer import Tokenizer

__all__ = [
    "ARITHMETIC_SYMBOLS",
    "SFTSample",
    "arithmetic_split_of",
    "arithmetic_tokenizer_corpus",
    "build_sft_sample",
    "make_chain_dataset",
    "make_arithmetic_dataset",
    "make_arithmetic_splits",
    "sft_samples",
]

#: Every character the task can produce; each must be a single token for the tiny model. The
#: chain task adds the step separator ``,`` (kept out of this tuple: it seeds the demo's tokenizer).
ARITHMETIC_SYMBOLS: tuple[str, ...] = tuple("0123456789+-*=")
CHAIN_SEPARATOR = ","

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ENUMERATE_LIMIT = 2_000_000  # enumerate the problem space up to this size, else rejection-sample


def _problem_text(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}="


def arithmetic_split_of(prompt: str, heldout_fraction: float = 0.1) -> str:
    """``"heldout"`` or ``"train"``: the split a problem text (e.g. ``"3+5="``) belongs to."""
    bucket = zlib.crc32(prompt.encode("utf-8")) % 10_000
    return "heldout" if bucket < round(heldout_fraction * 10_000) else "train"


def _validate(min_operand: int, max_operand: int, ops: Sequence[str], heldout_fraction: float) -> None:
    if min_operand < 0 or max_operand < min_operand:
        raise ValueError(f"Need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
    bad = [op for op in ops if op not in _OPS]
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {list(ops)}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")


def _check_request(split: str, num_examples: int) -> None:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if num_examples <= 0:
        raise ValueError(f"num_examples must be positive, got {num_examples}")


def _valid(a: int, op: str, b: int, allow_negative: bool) -> bool:
    return allow_negative or op != "-" or a >= b


def make_arithmetic_dataset(
    num_examples: int,
    seed: int = 0,
    split: str = "train",
    min_operand: int = 0,
    max_operand: int = 20,
    ops: Sequence[str] = ("+", "-"),
    allow_negative: bool = False,
    heldout_fraction: float = 0.1,
    unique: bool = True,
) -> list[PromptExample]:
    """Generate ``num_examples`` arithmetic problems of one split, deterministically from ``seed``.

    Args:
        num_examples: How many examples.
        seed: RNG seed; the same arguments always give the same list.
        split: ``"train"`` or ``"heldout"`` (disjoint by construction).
        min_operand, max_operand: Inclusive operand range.
        ops: Operators to use, from ``"+"``, ``"-"``, ``"*"``.
        allow_negative: If False, subtraction problems have ``a >= b`` (non-negative answers).
        heldout_fraction: Share of the problem space reserved for the held-out split.
        unique: If True, no problem repeats (raises when the split has fewer than
            ``num_examples`` problems); if False, problems are drawn with replacement.

    Returns:
        ``PromptExample(prompt="12+7=", answer="19", ...)`` items, with ``metadata`` holding
        ``task``, ``a``, ``op``, ``b`` and ``split``.
    """
    _check_request(split, num_examples)
    ops = tuple(ops)
    _validate(min_operand, max_operand, ops, heldout_fraction)
    rng = random.Random(f"gspo-arithmetic:{seed}:{split}")
    span = max_operand - min_operand + 1
    problems: list[tuple[int, str, int]]

    if len(ops) * span * span <= _ENUMERATE_LIMIT:
        pool = [
            (a, op, b)
            for op in ops
            for a in range(min_operand, max_operand + 1)
            for b in range(min_operand, max_operand + 1)
            if _valid(a, op, b, allow_negative)
            and arithmetic_split_of(_problem_text(a, op, b), heldout_fraction) == split
        ]
        if not pool:
            raise ValueError(f"The '{split}' split of this problem space is empty; widen the operand range")
        if unique:
            if num_examples > len(pool):
                raise ValueError(
                    f"Asked for {num_examples} unique '{split}' problems but the split has only "
                    f"{len(pool)}; widen the operand range or pass unique=False"
                )
            problems = rng.sample(pool, num_examples)
        else:
            problems = [rng.choice(pool) for _ in range(num_examples)]
    else:
        problems, seen = [], set()
        max_tries = 50 * num_examples + 1000
        for _ in range(max_tries):
            if len(problems) == num_examples:
                break
            a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
            op = rng.choice(ops)
            if op == "-" and not allow_negative and a < b:
                a, b = b, a
            if arithmetic_split_of(_problem_text(a, op, b), heldout_fraction) != split:
                continue
            if unique and (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            problems.append((a, op, b))
        if len(problems) < num_examples:
            raise ValueError(f"Could not draw {num_examples} unique '{split}' problems")

    return [
        PromptExample(
            prompt=_problem_text(a, op, b),
            answer=str(_OPS[op](a, b)),
            index=i,
            uid=f"arith-{split}-{i}",
            metadata={"task": "arithmetic", "a": a, "op": op, "b": b, "split": split},
        )
        for i, (a, op, b) in enumerate(problems)
    ]


def _chain(operands: Sequence[int], ops: Sequence[str]) -> tuple[str, str]:
    """(prompt, worked answer) of one chain: ``"7+5-3="`` -> ``"7+5=12,12-3=9"``."""
    prompt = str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:])) + "="
    steps, value = [], operands[0]
    for op, b in zip(ops, operands[1:]):
        new = _OPS[op](value, b)
        steps.append(f"{value}{op}{b}={new}")
        value = new
    return prompt, CHAIN_SEPARATOR.join(steps)


def make_chain_dataset(
    num_examples: int,
    seed: int = 0,
    split: str = "train",
    num_operands: int = 6,
    max_operand: int = 9,
    heldout_fraction: float = 0.1,
) -> list[PromptExample]:
    """``num_examples`` unique chain problems of one split (``+``/``-``, operands in
    ``[0, max_operand]``, the running value kept >= 0), deterministic given ``seed``.

    The answer is the worked chain, ``num_operands - 1`` steps joined by ``,``; with single-digit
    operands and 6 of them it averages ~35 characters. Splits are disjoint by the same hash as
    :func:`make_arithmetic_dataset`. Rejection-sampled (the space is ``(2 (max+1))^n``-sized).
    """
    _check_request(split, num_examples)
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    _validate(0, max_operand, ("+", "-"), heldout_fraction)
    rng = random.Random(f"gspo-arithmetic-chain:{seed}:{split}")
    examples: list[PromptExample] = []
    seen: set[str] = set()
    for _ in range(50 * num_examples + 1000):
        if len(examples) == num_examples:
            break
        operands = [rng.randint(0, max_operand) for _ in range(num_operands)]
        ops, value = [], operands[0]
        for b in operands[1:]:
            op = "-" if value >= b and rng.random() < 0.5 else "+"
            ops.append(op)
            value = _OPS[op](value, b)
        prompt, answer = _chain(operands, ops)
        if prompt in seen or arithmetic_split_of(prompt, heldout_fraction) != split:
            continue
        seen.add(prompt)
        examples.append(PromptExample(
            prompt=prompt, answer=answer, index=len(examples), uid=f"chain-{split}-{len(examples)}",
            metadata={"task": "arithmetic_chain", "operands": operands, "ops": ops, "split": split}))
    if len(examples) < num_examples:
        raise ValueError(f"Could not draw {num_examples} unique '{split}' chain problems; "
                         f"raise max_operand or num_operands")
    return examples


def make_arithmetic_splits(
    num_train: int, num_heldout: int, seed: int = 0, **kwargs: object
) -> tuple[list[PromptExample], list[PromptExample]]:
    """``(train, heldout)`` datasets from :func:`make_arithmetic_dataset` with the same options."""
    train = make_arithmetic_dataset(num_train, seed=seed, split="train", **kwargs)  # type: ignore[arg-type]
    heldout = make_arithmetic_dataset(num_heldout, seed=seed, split="heldout", **kwargs)  # type: ignore[arg-type]
    return train, heldout


def arithmetic_tokenizer_corpus(examples: Iterable[PromptExample]) -> list[str]:
    """Text lines (``"12+7=19"``) for training a tokenizer; a first line holds every symbol."""
    return ["".join(ARITHMETIC_SYMBOLS)] + [ex.prompt + ex.answer for ex in examples]


@dataclass
class SFTSample:
    """One supervised warm-up sequence: ``prompt + completion + EOS`` token ids.

    ``loss_mask[i]`` is 1 where token ``i`` belongs to the completion or the EOS (train on it),
    0 for prompt tokens. ``prompt_len`` is the number of prompt tokens.
    """

    input_ids: list[int]
    loss_mask: list[int]
    prompt_len: int


def build_sft_sample(
    tokenizer: "Tokenizer", prompt_input: str | list[dict[str, str]], completion: str, add_bos: bool = False
) -> SFTSample:
    """Tokenize ``apply_chat_template(prompt_input)``, then ``completion`` and EOS.

    The prompt is formatted exactly as generation formats it, so warm-up and RL see the same
    token layout. Pass ``add_bos=True`` only if generation also prepends BOS.
    """
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(prompt_input))
    if add_bos:
        if tokenizer.bos_id is None:
            raise ValueError("add_bos=True but the tokenizer has no BOS token")
        prompt_ids = [tokenizer.bos_id] + prompt_ids
    completion_ids = tokenizer.encode(completion) + [tokenizer.eos_id]
    return SFTSample(
        input_ids=prompt_ids + completion_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(completion_ids),
        prompt_len=len(prompt_ids),
    )


def sft_samples(tokenizer: "Tokenizer", examples: Iterable[PromptExample], add_bos: bool = False) -> list[SFTSample]:
    """:func:`build_sft_sample` for each example (prompt -> answer)."""
    return [build_sft_sample(tokenizer, ex.model_input, ex.answer, add_bos=add_bos) for ex in examples]
