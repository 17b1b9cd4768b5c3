"""Numerical kernels that sit between the model and the algorithm."""

from gspo_megatron.ops.logprobs import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs"]
