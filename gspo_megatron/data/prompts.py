"""Prompt datasets: loading (JSONL / JSON / Parquet), validation and deterministic batching.

Supported layouts, as they come:

* **verl** parquet rows: ``{"prompt": [{"role": "user", "content": ...}], "reward_model":
  {"ground_truth": "42", ...}, "data_source": ...}`` -> ``answer_key="reward_model.ground_truth"``.
* **slime** JSONL rows: ``{"prompt": "...", "label": "42"}`` -> ``answer_key="label"``.
* anything else with a prompt (string or list of chat messages) and an answer, with the keys
  given as dotted paths into nested dicts (``"a.b.c"``).

Every row is validated when the file is loaded, before any compute, and each error names the
file and the 1-based line (JSONL) or row (Parquet / JSON array) it comes from.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = [
    "DatasetError",
    "PromptExample",
    "PromptSampler",
    "get_dotted",
    "load_prompt_dataset",
]

_MISSING = object()


class DatasetError(ValueError):
    """A dataset file is malformed; the message names the file and line/row."""


@dataclass
class PromptExample:
    """One RL prompt with its reference answer.

    Attributes:
        prompt: Plain prompt text. For chat examples (``messages`` set) this is the content of the
            last user message, kept for logging and for reward functions.
        answer: Reference answer (ground truth) as a string; ``""`` when the dataset has none.
        index: Position of the example in its dataset (0-based).
        uid: Stable identifier: the row's id field when ``id_key`` was given, else ``str(index)``.
        messages: Chat messages ``[{"role": ..., "content": ...}]`` when the dataset stores the
            prompt as a conversation; the tokenizer's chat template formats them.
        metadata: The row's other top-level fields (``data_source``, ``extra_info``, ...).
        where: Where the example came from, 1-based, as load-time errors say it (``file:line``
            for JSONL, ``file: record N`` for a JSON array, ``file: row N`` for Parquet), so that
            checks made after loading (prompt length) name it too; ``""`` for generated examples.
    """

    prompt: str
    answer: str
    index: int = 0
    uid: str = ""
    messages: list[dict[str, str]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    def __post_init__(self) -> None:
        if not self.uid:
            self.uid = str(self.index)

    @property
    def model_input(self) -> str | list[dict[str, str]]:
        """What to hand to ``Tokenizer.apply_chat_template``: the messages, else the prompt."""
        return self.messages if self.messages is not None else self.prompt


def get_dotted(row: Any, key: str, default: Any = _MISSING) -> Any:
    """Look up ``key`` in ``row``; a dotted key (``"reward_model.ground_truth"``) walks nested dicts.

    An exact top-level match wins over the dotted interpretation (keys may contain dots).
    Raises ``KeyError`` naming the first missing component when no ``default`` is given.
    """
    if isinstance(row, dict) and key in row:
        return row[key]
    node = row
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            if default is not _MISSING:
                return default
            raise KeyError(part)
    return node


def _answer_to_str(value: Any) -> str:
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if not value.is_integer() else str(int(value))
    if hasattr(value, "tolist"):  # numpy arrays / scalars that slipped through
        return _answer_to_str(value.tolist())
    return json.dumps(value, ensure_ascii=False)


def _parse_messages(value: list[Any], where: str, prompt_key: str) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DatasetError(
                f"{where}: field '{prompt_key}' message {i} must be a dict with 'role' and "
                f"'content', got {msg!r:.120}"
            )
        if not isinstance(msg["role"], str) or not isinstance(msg["content"], str):
            raise DatasetError(f"{where}: field '{prompt_key}' message {i}: role and content must be strings")
        messages.append({"role": msg["role"], "content": msg["content"]})
    if not messages or not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: empty prompt (field '{prompt_key}' has no message content)")
    return messages


ANSWER_LAYOUTS = (("reward_model.ground_truth", "verl's layout"), ("label", "slime's layout"),
                  ("answer", None), ("ground_truth", None), ("solution", None))
"""Where the peers' dataset layouts keep the answer: the fields a missing-answer error suggests."""

PROMPT_LAYOUTS = (("prompt", "verl's and slime's layout"), ("question", None),
                  ("problem", None), ("messages", None))
"""Where datasets keep the prompt: the fields a missing-prompt error suggests."""


def _layout_hint(row: dict, layouts: tuple[tuple[str, str | None], ...]) -> str:
    """``"; this row has 'reward_model.ground_truth' (verl's layout)"`` for the first of
    ``layouts`` the row holds, else a line naming the known layouts' fields."""
    for key, name in layouts:
        if get_dotted(row, key, None) is not None:
            return f"; this row has '{key}'" + (f" ({name})" if name else "")
    known = ", ".join(f"{key}" + (f" ({name})" if name else "") for key, name in layouts if name)
    return f" ({known})"


def _row_to_example(
    row: Any,
    where: str,
    index: int,
    prompt_key: str,
    answer_key: str | None,
    id_key: str | None,
) -> PromptExample:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    try:
        raw_prompt = get_dotted(row, prompt_key)
    except KeyError:
        raise DatasetError(
            f"{where}: missing prompt field '{prompt_key}' (row has keys {sorted(row)}); "
            f"set data.prompt_key to the field that holds the prompt"
            f"{_layout_hint(row, PROMPT_LAYOUTS)}"
        ) from None
    messages: list[dict[str, str]] | None = None
    if hasattr(raw_prompt, "tolist") and not isinstance(raw_prompt, str):
        raw_prompt = raw_prompt.tolist()
    if isinstance(raw_prompt, str):
        prompt = raw_prompt
        if not prompt.strip():
            raise DatasetError(f"{where}: empty prompt (field '{prompt_key}')")
    elif isinstance(raw_prompt, list):
        messages = _parse_messages(raw_prompt, where, prompt_key)
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
    else:
        raise DatasetError(
            f"{where}: field '{prompt_key}' must be a string or a list of chat messages, "
            f"got {type(raw_prompt).__name__}"
        )

    answer = ""
    if answer_key is not None:
        try:
            raw_answer = get_dotted(row, answer_key)
        except KeyError:
            raise DatasetError(
                f"{where}: missing answer field '{answer_key}' (row has keys {sorted(row)}); "
                f"set data.answer_key to the field that holds the answer"
                f"{_layout_hint(row, ANSWER_LAYOUTS)}"
            ) from None
        if raw_answer is None:
            raise DatasetError(f"{where}: answer field '{answer_key}' is null")
        answer = _answer_to_str(raw_answer)
        if not answer:
            raise DatasetError(f"{where}: empty answer (field '{answer_key}')")

    uid = ""
    if id_key is not None:
        try:
            uid = str(get_dotted(row, id_key))
        except KeyError:
            raise DatasetError(f"{where}: missing id field '{id_key}'") from None

    top = prompt_key.split(".")[0] if prompt_key not in row else prompt_key
    metadata = {k: v for k, v in row.items() if k != top}
    return PromptExample(prompt=prompt, answer=answer, index=index, uid=uid, messages=messages,
                         metadata=metadata, where=where)


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                           f"{e.start})") from None


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where)
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    if not text.lstrip().startswith("["):
        yield from _iter_jsonl(path)
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path}: record {i}", row


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"Reading Parquet ({path}) needs pyarrow, which is not installed: `pip install pyarrow`"
        ) from None
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises ArrowInvalid etc.
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    rownum = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            rownum += 1
            yield f"{path}: row {rownum}", row


def _iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _iter_parquet(path)
    if suffix == ".json":
        return _iter_json(path)
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    raise DatasetError(f"{path}: unsupported dataset format '{suffix}' (use .jsonl, .json or .parquet)")


def load_prompt_dataset(
    path: str | Path | Sequence[str | Path],
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    id_key: str | None = None,
    max_examples: int | None = None,
) -> list[PromptExample]:
    """Load and validate a prompt dataset from one or more JSONL / JSON / Parquet files.

    Args:
        path: A file or a list of files (concatenated in order).
        prompt_key: Field with the prompt: a string, or a list of chat messages. Dotted keys walk
            nested dicts.
        answer_key: Field with the reference answer (e.g. ``"label"`` for slime,
            ``"reward_model.ground_truth"`` for verl); ``None`` for datasets without answers.
            Numbers are converted to strings; other non-strings are JSON-encoded.
        id_key: Optional field used as the example's ``uid``.
        max_examples: Keep only the first ``max_examples`` examples.

    Returns:
        The examples, ``index`` numbered 0..N-1 in file order.

    Raises:
        FileNotFoundError: A file does not exist.
        DatasetError: Bad JSON, missing or empty fields (message names file and 1-based line/row),
            unsupported format, or no examples at all.
    """
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not paths:
        raise DatasetError("load_prompt_dataset: no dataset path given")
    examples: list[PromptExample] = []
    for p in paths:
        if p.is_dir():
            raise DatasetError(f"{p}: is a directory; give a dataset file (.jsonl, .json or "
                               ".parquet)")
        if not p.is_file():
            raise FileNotFoundError(f"Prompt dataset not found: {p}")
        for where, row in _iter_rows(p):
            if max_examples is not None and len(examples) >= max_examples:
                break
            examples.append(_row_to_example(row, where, len(examples), prompt_key, answer_key, id_key))
    if not examples:
        names = ", ".join(str(p) for p in paths)
        raise DatasetError(f"Prompt dataset {names} contains no examples")
    return examples


class PromptSampler:
    """Yields batches of ``num_prompts`` examples, reshuffled every epoch, resumable exactly.

    The order of epoch ``e`` is a permutation drawn from ``random.Random`` seeded with
    ``(seed, e)``, so it depends only on the seed, the epoch and the dataset size. Each epoch
    yields ``len(dataset) // num_prompts`` full batches; the remainder of an epoch is dropped (a
    different remainder each epoch, since the order changes). ``state_dict()`` captures
    ``(epoch, position)``; a sampler that loads it yields exactly the batches the original would
    have yielded next.
    """

    def __init__(self, examples: Sequence[PromptExample], num_prompts: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts <= 0:
            raise ValueError(f"num_prompts must be positive, got {num_prompts}")
        if len(examples) < num_prompts:
            raise ValueError(
                f"Dataset has {len(examples)} examples, fewer than num_prompts={num_prompts} per batch"
            )
        self.examples = list(examples)
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index of the next batch within the current epoch
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Number of full batches in one epoch."""
        return len(self.examples) // self.num_prompts

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"gspo-prompt-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptExample]:
        """Return the next batch, moving to the next epoch when the current one is exhausted."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        start = self.position * self.num_prompts
        idx = self._order[start : start + self.num_prompts]
        self.position += 1
        return [self.examples[i] for i in idx]

    def __iter__(self) -> Iterator[list[PromptExample]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Resumable state (plain ints, safe to put in a checkpoint)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "dataset_size": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore ``epoch``/``position``; refuses a state saved for a different dataset or batching."""
        for key, mine in (("seed", self.seed), ("num_prompts", self.num_prompts), ("dataset_size", len(self.examples))):
            if key in state and int(state[key]) != mine:
                raise ValueError(
                    f"PromptSampler state has {key}={state[key]} but this sampler has {key}={mine}; "
                    "resuming would not reproduce the original batch order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None

    def epochs_completed(self) -> float:
        """Fractional number of epochs consumed so far (for logging)."""
        return self.epoch + self.position / max(1, self.batches_per_epoch)

