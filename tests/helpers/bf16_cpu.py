"""Megatron's bf16 training path on CPU, for CI: ``python tests/helpers/bf16_cpu.py <gspo-train
arguments>`` runs ``gspo-train`` with ``precision.bf16`` in effect on CPU.

On a GPU, bf16 means bf16 weights and Megatron's ``Float16OptimizerWithFloat16Params``: Adam
steps fp32 *main* copies of the weights and writes them back into the model after every step.
That optimizer asserts CUDA tensors, so on CPU the project trains in fp32 and CI never ran it: a
warm-up whose weights the bf16 optimizer then overwrote with its stale copies was first seen on an
H200 (docs/benchmarks.md section 6). Here the model is built in bf16 on CPU and that optimizer is
let run on CPU tensors: its type check sees CUDA type names and its two scalar buffers
(``_dummy_overflow_buf``, ``_scale_one``; ``found_inf`` under fp16) are made on the CPU. Its
arithmetic is unchanged: Megatron's local multi-tensor fallbacks, the ones CPU fp32 runs use.
"""

from __future__ import annotations

import os
import sys

import torch

_CUDA_TYPE_NAMES = {torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float16: "torch.cuda.HalfTensor", torch.float32: "torch.cuda.FloatTensor"}


class _HostTorch:
    """``torch`` for Megatron's optimizer module, whose ``torch.tensor(..., device='cuda')`` are
    made on the CPU instead."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.tensor(*args, **kwargs)


def apply() -> None:
    """Patch this process (the CLI's only; never the test process)."""
    import megatron.core.optimizer.optimizer as megatron_optimizer

    from gspo_megatron.backends.megatron import model

    model.bf16_runs_here = lambda: True
    megatron_optimizer.torch = _HostTorch()
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return tensor_type(self, *args, **kwargs)

    torch.Tensor.type = cuda_type_name


if __name__ == "__main__":
    # Run as a script, this file's folder leads sys.path, and its megatron.py would shadow
    # megatron-core.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    apply()
    from gspo_megatron.cli import main

    sys.exit(main(sys.argv[1:]))
