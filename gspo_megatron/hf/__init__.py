"""Hugging Face Qwen3-MoE <-> Megatron-Core, both ways, as plain data and torch (no Megatron
import): the config (:mod:`.config`) and the tensor names and layouts (:mod:`.weights`) that the
converters (``gspo-convert-hf``, ``gspo-export-hf``) and the parity tests read."""
