"""The CPU compatibility layer patches only what it lists, and only without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compat is a no-op with CUDA")


def test_patches_are_scoped_to_listed_megatron_modules():
    from gspo_megatron.compat import apply_cpu_compat
    from gspo_megatron.compat.cpu import _PATCHED_MODULES

    assert apply_cpu_compat() is True
    assert apply_cpu_compat() is True  # idempotent

    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.moe.router as router
    import megatron.core.transformer.moe.moe_utils as moe_utils

    assert "transformer.moe.router" in _PATCHED_MODULES
    assert router.torch is not torch and router.torch.cuda.current_device() == torch.device("cpu")
    # tensor factories asked for CUDA allocate on CPU inside patched modules ...
    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    assert moe_utils.te_general_gemm is None
    # ... while the real torch is untouched everywhere else.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.cuda.current_device is not router.torch.cuda.current_device
    # the proxy delegates everything else to torch itself
    assert router.torch.float32 is torch.float32 and router.torch.nn is torch.nn
