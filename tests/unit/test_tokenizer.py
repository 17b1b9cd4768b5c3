"""SentencePiece training/round trip/save-load, the factory, and the optional HF wrapper."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.data import (
    ARITHMETIC_SYMBOLS,
    arithmetic_tokenizer_corpus,
    build_sft_sample,
    make_arithmetic_dataset,
    sft_samples,
)
from gspo_megatron.tokenizer import (
    TOKENIZER_CONFIG_NAME,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    train_sentencepiece,
)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return arithmetic_tokenizer_corpus(make_arithmetic_dataset(300, seed=0))


@pytest.fixture(scope="module")
def sp_tok(corpus: list[str]) -> SentencePieceTokenizer:
    return train_sentencepiece(corpus, vocab_size=64, model_type="char", atomic_symbols=ARITHMETIC_SYMBOLS)


def test_char_tokenizer_roundtrip_and_single_token_symbols(sp_tok: SentencePieceTokenizer) -> None:
    assert isinstance(sp_tok, Tokenizer)
    for text in ["12+7=19", "0-0=0", "20-13=7", "3*4=12", "1+1=2"]:
        ids = sp_tok.encode(text)
        assert sp_tok.decode(ids) == text
        assert len(ids) == len(text)  # one token per character
    for sym in ARITHMETIC_SYMBOLS:
        ids = sp_tok.encode(sym)
        assert len(ids) == 1 and sp_tok.id_to_piece(ids[0]) == sym
    assert sp_tok.encode("12") == [sp_tok.encode("1")[0], sp_tok.encode("2")[0]]


def test_special_ids(sp_tok: SentencePieceTokenizer) -> None:
    assert (sp_tok.pad_id, sp_tok.bos_id, sp_tok.eos_id) == (0, 2, 3)
    assert len({sp_tok.pad_id, sp_tok.bos_id, sp_tok.eos_id}) == 3
    assert sp_tok.vocab_size <= 64
    ids = sp_tok.encode("3+5=") + [sp_tok.eos_id, sp_tok.pad_id]
    assert sp_tok.decode(ids) == "3+5="  # special tokens skipped
    assert sp_tok.decode(ids, skip_special_tokens=False) == "3+5=</s><pad>"
    assert sp_tok.decode(sp_tok.encode("8") + [sp_tok.vocab_size + 5]) == "8"  # embedding padding ids dropped


def test_training_is_deterministic(corpus: list[str], sp_tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    again = train_sentencepiece(corpus, vocab_size=64, model_type="char", atomic_symbols=ARITHMETIC_SYMBOLS)
    sp_tok.save(tmp_path / "a")
    again.save(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == (tmp_path / "b" / "tokenizer.model").read_bytes()


def test_save_load_and_factory(sp_tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    sp_tok.save(tmp_path / "tok")
    assert (tmp_path / "tok" / TOKENIZER_CONFIG_NAME).is_file()
    for loaded in (
        load_tokenizer(tmp_path / "tok"),
        build_tokenizer("auto", tmp_path / "tok"),
        build_tokenizer("sentencepiece", tmp_path / "tok"),
        build_tokenizer("sp", tmp_path / "tok" / "tokenizer.model"),
        build_tokenizer("auto", tmp_path / "tok" / "tokenizer.model"),
    ):
        assert isinstance(loaded, SentencePieceTokenizer)
        assert loaded.vocab_size == sp_tok.vocab_size and loaded.eos_id == sp_tok.eos_id
        assert loaded.encode("19-4=15") == sp_tok.encode("19-4=15")
    with pytest.raises(ValueError, match="Unknown tokenizer kind"):
        build_tokenizer("tiktoken", tmp_path / "tok")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        SentencePieceTokenizer(tmp_path / "missing.model")


def test_trained_on_disk_when_output_dir_given(corpus: list[str], tmp_path: Path) -> None:
    tok = train_sentencepiece(corpus, tmp_path / "run" / "tokenizer", vocab_size=64, atomic_symbols=ARITHMETIC_SYMBOLS)
    assert load_tokenizer(tmp_path / "run" / "tokenizer").encode("7+8=") == tok.encode("7+8=")


def test_bpe_keeps_atomic_symbols_single(tmp_path: Path) -> None:
    lines = ["the cat sat on the mat", "the answer is 12+30=42", "12+30=42 and 12+30=42"] * 20
    tok = train_sentencepiece(lines, vocab_size=60, model_type="bpe", atomic_symbols=ARITHMETIC_SYMBOLS)
    ids = tok.encode("12+30=42")
    assert len(ids) == len("12+30=42")
    assert tok.decode(tok.encode("the cat sat on 12+30=42")) == "the cat sat on 12+30=42"


def test_chat_template_and_sft_sample(sp_tok: SentencePieceTokenizer) -> None:
    assert sp_tok.apply_chat_template("3+5=") == "3+5="
    msgs = [{"role": "user", "content": "hi"}]
    assert sp_tok.apply_chat_template(msgs) == "user: hi\nassistant: "
    sample = build_sft_sample(sp_tok, "3+5=", "8")
    assert sample.input_ids == sp_tok.encode("3+5=8") + [sp_tok.eos_id]
    assert sample.loss_mask == [0, 0, 0, 0, 1, 1] and sample.prompt_len == 4
    with_bos = build_sft_sample(sp_tok, "3+5=", "8", add_bos=True)
    assert with_bos.input_ids[0] == sp_tok.bos_id and with_bos.prompt_len == 5
    samples = sft_samples(sp_tok, make_arithmetic_dataset(5, seed=2))
    assert all(s.input_ids[-1] == sp_tok.eos_id and sum(s.loss_mask) >= 2 for s in samples)


def test_empty_corpus_rejected() -> None:
    with pytest.raises(ValueError, match="empty corpus"):
        train_sentencepiece([], vocab_size=32)


def test_hf_tokenizer_missing_transformers_message(tmp_path: Path) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install transformers"):
            build_tokenizer("hf", tmp_path)
    else:
        pytest.skip("transformers is installed")


def _tiny_hf_tokenizer(directory: Path):
    """A tiny local HF tokenizer (no download) whose chat template reads ``enable_thinking``;
    returns the transformers tokenizer saved in ``directory``."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.decoders import Fuse
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *list("0123456789+-="), "u", "a"])}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = Split("", "isolated")
    raw.decoder = Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}a{% endif %}{% if enable_thinking is defined and not enable_thinking %}={% endif %}"
    )
    fast.save_pretrained(directory)
    return fast


def test_hf_tokenizer_with_local_files(tmp_path: Path, sp_tok: SentencePieceTokenizer) -> None:
    """Builds a tiny local HF tokenizer (no download) and checks the wrapper's behaviour."""
    from gspo_megatron.tokenizer import HFTokenizer

    _tiny_hf_tokenizer(tmp_path / "hf")
    tok = build_tokenizer("hf", tmp_path / "hf")
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 1 and tok.pad_id == 0 and tok.bos_id is None
    assert tok.decode(tok.encode("12+3=")) == "12+3="
    assert tok.apply_chat_template("1+2=") == "u1+2=a"
    no_think = HFTokenizer(tmp_path / "hf", enable_thinking=False)
    assert no_think.apply_chat_template([{"role": "user", "content": "1"}]) == "u1a="
    tok.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").apply_chat_template("1+2=") == "u1+2=a"


def test_recipe_chat_template_kwargs_shape_the_prompt_tokens(tmp_path: Path) -> None:
    """``tokenizer.chat_template_kwargs`` in a recipe (and as an override) reaches the chat
    template: the run's prompt tokens are what transformers' ``apply_chat_template`` gives with
    the same arguments, in the prompt-length check too, and the saved tokenizer keeps them."""
    from gspo_megatron.cli import load_data
    from gspo_megatron.config import load_config

    fast = _tiny_hf_tokenizer(tmp_path / "hf")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"tokenizer:\n  kind: hf\n  path: {tmp_path / 'hf'}\n"
                      "  chat_template_kwargs: {enable_thinking: false}\n"
                      f"data:\n  source: file\n  train_path: {tmp_path / 'train.jsonl'}\n"
                      "  max_prompt_length: 7\n")
    messages = [{"role": "user", "content": "1+2="}]

    def expected(**kwargs):
        return list(fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                             return_dict=False, **kwargs))

    cfg = load_config(str(recipe), [])
    assert cfg.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    tokenizer, train, _ = load_data(cfg)
    ids = tokenizer.encode(tokenizer.apply_chat_template(train[0].model_input))
    assert ids == expected(enable_thinking=False) and ids != expected()  # "u1+2=a=" vs "u1+2=a"
    tokenizer.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.encode(again.apply_chat_template("1+2=")) == expected(enable_thinking=False)
    # an override replaces the recipe's mapping
    cfg = load_config(str(recipe), ["--tokenizer.chat_template_kwargs={enable_thinking: true}"])
    tokenizer, train, _ = load_data(cfg)
    assert tokenizer.encode(tokenizer.apply_chat_template("1+2=")) == expected(enable_thinking=True)
    # the prompt-length check counts the template's tokens: 7 with the kwarg, over a limit of 6
    with pytest.raises(ValueError, match="prompt has 7 tokens, more than data.max_prompt_length=6"):
        load_data(load_config(str(recipe), ["--tokenizer.chat_template_kwargs={enable_thinking: false}",
                                            "--data.max_prompt_length=6"]))
