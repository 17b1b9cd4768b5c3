"""Prompt datasets, batching, and the built-in arithmetic task."""

from gspo_megatron.data.arithmetic import (
    ARITHMETIC_SYMBOLS,
    SFTSample,
    arithmetic_split_of,
    arithmetic_tokenizer_corpus,
    build_sft_sample,
    make_arithmetic_dataset,
    make_arithmetic_splits,
    make_chain_dataset,
    sft_samples,
)
from gspo_megatron.data.prompts import (
    DatasetError,
    PromptExample,
    PromptSampler,
    get_dotted,
    load_prompt_dataset,
)

__all__ = [
    "ARITHMETIC_SYMBOLS",
    "DatasetError",
    "PromptExample",
    "PromptSampler",
    "SFTSample",
    "arithmetic_split_of",
    "arithmetic_tokenizer_corpus",
    "build_sft_sample",
    "get_dotted",
    "load_prompt_dataset",
    "make_arithmetic_dataset",
    "make_arithmetic_splits",
    "make_chain_dataset",
    "sft_samples",
]
