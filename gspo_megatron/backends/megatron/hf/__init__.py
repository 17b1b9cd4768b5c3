"""Hugging Face Qwen3-MoE <-> Megatron-Core: the config (:mod:`.config`) and the weight names and
layouts (:mod:`.weights`), both ways."""
