"""The Megatron-Core backend behind :class:`gspo_megatron.policy.Policy`. Nothing outside
``backends/`` imports megatron (the Hugging Face mapping of Megatron's tensor names,
:mod:`gspo_megatron.hf`, is plain data and torch).

- :mod:`.parallel`, :mod:`.model`, :mod:`.policy`, :mod:`.schedule`, :mod:`.logprobs`,
  :mod:`.checkpoint`: process groups, the ``GPTModel``, the policy (optimizer, updates, log-prob
  passes) and checkpoints.
- :mod:`.engine`: the rollout engine on Megatron's inference stack.
- :mod:`.routing`: MoE route record / replay (R2, R3) and diagnostics.
- :mod:`.kernels`: faster modules for the local layer spec.
- :mod:`.weight_transfer`: the model's weights as pieces of whole tensors (what each trainer rank
  sends, what a rollout replica loads, from any layout to any layout).
"""
