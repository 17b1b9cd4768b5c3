"""A tiny Hugging Face reward model made on the spot: a 1-layer ``Qwen3ForSequenceClassification``
(one output) with a character-level tokenizer whose chat template is ``<role>content`` per
message."""

from __future__ import annotations

import string

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def tiny_reward_model(directory, seed: int = 0, num_labels: int = 1) -> str:
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForSequenceClassification

    chars = ["[PAD]", "[UNK]", "[EOS]"] + list(string.printable[:95])
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                     eos_token="[EOS]")
    hf_tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(chars), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, num_labels=num_labels, pad_token_id=0,
                         max_position_embeddings=512)
    model = Qwen3ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # (scores spread far enough to tell them apart)
    model.save_pretrained(str(directory))
    hf_tok.save_pretrained(str(directory))
    return str(directory)
