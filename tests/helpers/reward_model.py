"""A tiny Hugging Face reward model made on the spot: a 1-layer ``Qwen3ForSequenceClassification``
(one output) with a character-level tokenizer whose chat template is ``<role>content`` per
message."""

from __future__ import annotations

import string

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'tool' %}{{- '<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen3's chat template's layout of user, assistant and tool messages (without its system and
thinking rules)."""


def char_tokenizer(chat_template: str = CHAT_TEMPLATE, eos: str = "[EOS]"):
    """A character-level ``PreTrainedTokenizerFast`` (``[PAD]`` 0, ``[UNK]`` 1, ``eos`` 2)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["[PAD]", "[UNK]", eos] + list(string.printable[:95]) + ["\n"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                     eos_token=eos)
    hf_tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]} if eos == "<|im_end|>"
                              else {})
    hf_tok.chat_template = chat_template
    return hf_tok


def tiny_reward_model(directory, seed: int = 0, num_labels: int = 1) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    hf_tok = char_tokenizer()
    chars = list(range(len(hf_tok)))
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
