"""One small tokenizer interface, with SentencePiece and Hugging Face implementations.

* :class:`SentencePieceTokenizer` loads a ``.model`` file; :func:`train_sentencepiece` trains one
  in-process (deterministic) so a run can ship its own tokenizer (the built-in arithmetic task
  uses a character-level vocabulary where every digit and operator is one token).
* :class:`HFTokenizer` wraps ``transformers.AutoTokenizer`` (imported lazily; ``transformers`` is
  optional) and formats chat prompts with the model's own chat template.

Every tokenizer can ``save(dir)``; :func:`load_tokenizer` reads it back from that directory, and
:func:`build_tokenizer` builds one from a kind and a path.
"""

from __future__ import annotations

import io
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_CONFIG_NAME",
    "Tokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "train_sentencepiece",
]

#: File written by ``Tokenizer.save`` next to the tokenizer's own files.
TOKENIZER_CONFIG_NAME = "gspo_tokenizer.json"

PromptInput = str | list[dict[str, str]]


class Tokenizer(ABC):
    """What the rest of gspo_megatron needs from a tokenizer.

    ``encode`` never adds BOS/EOS; callers add ``bos_id``/``eos_id`` explicitly where they want
    them. ``apply_chat_template`` turns a prompt (plain string or chat messages) into the text the
    model continues during generation.
    """

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (the model's embedding may be padded beyond this)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id; generation stops on it."""

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Padding id (always defined; may equal ``eos_id``)."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None when the tokenizer has none."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside ``[0, vocab_size)`` (embedding padding) are dropped."""

    @abstractmethod
    def apply_chat_template(self, prompt: PromptInput) -> str:
        """Format a prompt for generation (adds the assistant turn opener for chat templates)."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the tokenizer to ``directory`` so :func:`load_tokenizer` can restore it."""

    def encode_prompt(self, prompt: PromptInput) -> list[int]:
        """``encode(apply_chat_template(prompt))``."""
        return self.encode(self.apply_chat_template(prompt))

    def continuation(self, messages: list[dict[str, str]]) -> str:
        """The text that follows an assistant turn ended by its EOS to hand it ``messages`` (an
        environment's tool or user messages) and open the next assistant turn: what the chat
        format puts between the two turns (a multi-turn rollout appends it as tokens,
        :mod:`gspo_megatron.envs.turns`). Without a chat template: ``"\n" + role: content``
        lines + ``"\nassistant: "``, as :meth:`apply_chat_template` lays a conversation out."""
        return "\n" + _simple_chat_format(messages)

    def _valid_ids(self, ids: Sequence[int]) -> list[int]:
        n = self.vocab_size
        return [int(i) for i in ids if 0 <= int(i) < n]


def _simple_chat_format(messages: list[dict[str, str]]) -> str:
    """Fallback chat format for tokenizers without a template: ``role: content`` lines."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant: "


def _write_config(directory: Path, config: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (``.model`` file or serialized proto bytes).

    Plain-string prompts are used as they are; chat messages are joined as ``role: content``
    lines followed by ``"assistant: "`` (a tiny model trained on plain prompts should be given
    plain prompts).
    """

    MODEL_FILE = "tokenizer.model"

    def __init__(self, model_path: str | Path | None = None, model_proto: bytes | None = None) -> None:
        try:
            import sentencepiece as spm
        except ImportError:  # pragma: no cover - sentencepiece is a core dependency
            raise ImportError("SentencePieceTokenizer needs sentencepiece: `pip install sentencepiece`") from None
        if (model_path is None) == (model_proto is None):
            raise ValueError("Give exactly one of model_path or model_proto")
        if model_path is not None:
            path = Path(model_path)
            if not path.is_file():
                raise FileNotFoundError(f"SentencePiece model not found: {path}")
            model_proto = path.read_bytes()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except RuntimeError as e:  # a protobuf parse error that names no file
            where = str(model_path) if model_path is not None else "model_proto"
            raise ValueError(f"{where}: not a SentencePiece model ({str(e).strip()})") from None
        self._proto = bytes(model_proto)  # type: ignore[arg-type]
        if self._sp.eos_id() < 0:
            raise ValueError("SentencePiece model has no EOS piece (train it with eos_id >= 0)")

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        pad = int(self._sp.pad_id())
        return pad if pad >= 0 else self.eos_id

    @property
    def bos_id(self) -> int | None:
        bos = int(self._sp.bos_id())
        return bos if bos >= 0 else None

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._valid_ids(ids)
        if skip_special_tokens:
            return str(self._sp.decode(ids))
        return "".join(self._sp.id_to_piece(i) if self._sp.is_control(i) else self._sp.decode([i]) for i in ids)

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of one id."""
        return str(self._sp.id_to_piece(int(token_id)))

    def apply_chat_template(self, prompt: PromptInput) -> str:
        if isinstance(prompt, str):
            return prompt
        return _simple_chat_format(prompt)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / self.MODEL_FILE).write_bytes(self._proto)
        _write_config(directory, {"kind": "sentencepiece", "model_file": self.MODEL_FILE})


def train_sentencepiece(
    corpus_lines: Iterable[str],
    output_dir: str | Path | None = None,
    vocab_size: int = 64,
    model_type: str = "char",
    atomic_symbols: Sequence[str] = (),
    byte_fallback: bool = False,
    **trainer_kwargs: Any,
) -> SentencePieceTokenizer:
    """Train a SentencePiece tokenizer in-process, deterministically, and optionally save it.

    Ids: ``<pad>`` = 0, ``<unk>`` = 1, ``<s>`` = 2, ``</s>`` = 3. Text is not normalised (no NFKC,
    whitespace kept as is, no dummy prefix), so ``decode(encode(s)) == s`` for any ``s`` made of
    characters seen in training, and ``split_digits`` keeps every digit a separate token.

    Args:
        corpus_lines: Training text, one sentence per item.
        output_dir: If given, the tokenizer is saved there (``tokenizer.model`` + config).
        vocab_size: Upper bound for ``"char"`` (the vocabulary is the character set); the exact
            size for ``"bpe"``/``"unigram"``.
        model_type: ``"char"`` (recommended for tiny models), ``"bpe"`` or ``"unigram"``.
        atomic_symbols: Strings that must each be exactly one token (e.g. digits and ``+-=``).
            For ``"char"`` single characters become required characters; otherwise they are
            passed as user-defined symbols, which are never merged.
        byte_fallback: Encode unseen characters as byte tokens instead of ``<unk>``.
        **trainer_kwargs: Passed to ``SentencePieceTrainer.train`` (override the defaults).
    """
    import sentencepiece as spm

    lines = [line for line in corpus_lines if line]
    if not lines:
        raise ValueError("train_sentencepiece: empty corpus")
    single = [s for s in atomic_symbols if len(s) == 1]
    multi = [s for s in atomic_symbols if len(s) > 1]
    kwargs: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        byte_fallback=byte_fallback,
        num_threads=1,
        minloglevel=2,
        hard_vocab_limit=model_type != "char",
        shuffle_input_sentence=False,
    )
    if model_type == "char":
        if single:
            kwargs["required_chars"] = "".join(dict.fromkeys(single))
        if multi:
            kwargs["user_defined_symbols"] = multi
    elif atomic_symbols:
        kwargs["user_defined_symbols"] = list(dict.fromkeys(atomic_symbols))
    kwargs.update(trainer_kwargs)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, **kwargs)
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training failed ({model_type}, vocab_size={vocab_size}): {e}") from e
    tok = SentencePieceTokenizer(model_proto=buf.getvalue())
    if output_dir is not None:
        tok.save(output_dir)
    return tok


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer (``transformers.AutoTokenizer``), e.g. Qwen3's.

    Args:
        path: Local directory (or hub name, where the hub is reachable) of the tokenizer.
        chat_template_kwargs: Extra variables for the chat template (``tokenizer.
            chat_template_kwargs``; Qwen3: ``{"enable_thinking": False}`` drops the ``<think>``
            block), as transformers' ``apply_chat_template(..., **kwargs)`` takes them.
        enable_thinking: Shorthand for ``chat_template_kwargs={"enable_thinking": ...}`` when
            not None (what tokenizers saved before ``chat_template_kwargs`` existed wrote).
        chat_template_for_plain_prompts: Wrap plain-string prompts as one user message and apply
            the chat template (default). If False, plain strings are used as they are.
        trust_remote_code: Passed to ``from_pretrained``.
    """

    def __init__(
        self,
        path: str | Path,
        chat_template_kwargs: dict[str, Any] | None = None,
        enable_thinking: bool | None = None,
        chat_template_for_plain_prompts: bool = True,
        trust_remote_code: bool = False,
        **from_pretrained_kwargs: Any,
    ) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                "HFTokenizer needs the transformers package, which is not installed: "
                "`pip install transformers`"
            ) from None
        text = str(path)
        if not os.path.exists(os.path.expanduser(text)) and _looks_like_local_path(text):
            raise FileNotFoundError(f"tokenizer directory not found: {text}")
        try:
            self._tok = AutoTokenizer.from_pretrained(
                text, trust_remote_code=trust_remote_code, **from_pretrained_kwargs
            )
        except (OSError, ValueError) as e:  # not a tokenizer dir, or a Hub id that cannot load
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = "directory" if os.path.isdir(text) else "Hugging Face Hub id"
            raise ValueError(f"tokenizer {text!r} ({where}): cannot load a Hugging Face "
                             f"tokenizer: {first}") from None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            self.chat_template_kwargs.setdefault("enable_thinking", enable_thinking)
        self.chat_template_for_plain_prompts = chat_template_for_plain_prompts
        self.trust_remote_code = trust_remote_code
        if self._tok.eos_token_id is None:
            raise ValueError(f"Tokenizer at {path} has no EOS token")

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped ``transformers`` tokenizer."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return int(bos) if bos is not None else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(self._valid_ids(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, prompt: PromptInput) -> str:
        has_template = getattr(self._tok, "chat_template", None) is not None
        if isinstance(prompt, str):
            if not (self.chat_template_for_plain_prompts and has_template):
                return prompt
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = prompt
        if not has_template:
            return _simple_chat_format(messages)
        return str(self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **self.chat_template_kwargs))

    def continuation(self, messages: list[dict[str, str]]) -> str:
        """The chat template's text between an assistant turn's EOS and the next assistant
        turn, ``messages`` in between (:meth:`Tokenizer.continuation`): the template rendered
        over a placeholder conversation with and without ``messages``, the difference after the
        placeholder assistant reply and its EOS (Qwen3: ``"\n<|im_start|>user\n
        <tool_response>\n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n"``)."""
        if getattr(self._tok, "chat_template", None) is None:
            return super().continuation(messages)
        mark = "\x00gspo-turn\x00"
        head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
        text = str(self._tok.apply_chat_template(head + list(messages), tokenize=False,
                                                 add_generation_prompt=True,
                                                 **self.chat_template_kwargs))
        tail = text[text.index(mark) + len(mark):]
        eos = self._tok.eos_token or ""
        return tail[len(eos):] if eos and tail.startswith(eos) else tail

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self._tok.save_pretrained(str(directory))
        _write_config(
            directory,
            {
                "kind": "hf",
                "chat_template_kwargs": self.chat_template_kwargs,
                "chat_template_for_plain_prompts": self.chat_template_for_plain_prompts,
                "trust_remote_code": self.trust_remote_code,
            },
        )


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Restore a tokenizer written by ``Tokenizer.save(directory)``."""
    directory = Path(directory)
    cfg_path = directory / TOKENIZER_CONFIG_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(f"No {TOKENIZER_CONFIG_NAME} in {directory}; was it written by Tokenizer.save?")
    cfg = json.loads(cfg_path.read_text())
    kind = cfg.pop("kind", None)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(directory / cfg.get("model_file", SentencePieceTokenizer.MODEL_FILE))
    if kind == "hf":
        return HFTokenizer(directory, **cfg)
    raise ValueError(f"{cfg_path}: unknown tokenizer kind {kind!r}")


def _looks_like_local_path(text: str) -> bool:
    """A path a user means as local (absolute, ``./``, ``../``, ``~``, a trailing slash, or more
    than one ``/``), as opposed to a Hub id such as ``Qwen/Qwen3-30B-A3B``."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or text.endswith("/")
            or text.count("/") > 1)


def build_tokenizer(kind: str, path: str | Path, **kwargs: Any) -> Tokenizer:
    """Build a tokenizer.

    Args:
        kind: ``"sentencepiece"`` / ``"sp"`` (``path`` is a ``.model`` file or a saved directory),
            ``"hf"`` / ``"huggingface"`` (``path`` is a tokenizer directory), or ``"auto"`` (a
            directory with ``gspo_tokenizer.json`` -> :func:`load_tokenizer`; a ``.model`` file ->
            SentencePiece; anything else -> Hugging Face).
        path: Where the tokenizer is.
        **kwargs: Passed to :class:`HFTokenizer` (e.g. ``chat_template_kwargs``).
    """
    p = Path(path)
    kind = kind.lower()
    if kind == "auto":
        if p.is_dir() and (p / TOKENIZER_CONFIG_NAME).is_file():
            if kwargs:
                cfg = json.loads((p / TOKENIZER_CONFIG_NAME).read_text())
                if cfg.get("kind") == "hf":
                    return HFTokenizer(p, **{**{k: v for k, v in cfg.items() if k != "kind"}, **kwargs})
            return load_tokenizer(p)
        kind = "sentencepiece" if p.suffix == ".model" else "hf"
    if kind in ("sentencepiece", "sp"):
        if kwargs:
            raise TypeError(f"SentencePieceTokenizer takes no options, got {sorted(kwargs)}")
        if p.is_dir():
            return SentencePieceTokenizer(p / SentencePieceTokenizer.MODEL_FILE)
        return SentencePieceTokenizer(p)
    if kind in ("hf", "huggingface", "transformers"):
        return HFTokenizer(p, **kwargs)
    raise ValueError(f"Unknown tokenizer kind {kind!r}; use 'sentencepiece', 'hf' or 'auto'")
