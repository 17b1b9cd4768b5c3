"""The CPU compatibility layer patches only what it lists, and only without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compat is a no-op with CUDA")


def test_patches_are_scoped_to_listed_megatron_modules():
    from gspo_megatron.compat import apply_cpu_compat, apply_missing_te_compat
    from gspo_megatron.compat.cpu import _PATCHED_MODULES

    apply_missing_te_compat()
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


def _uneven_collectives(rank, world_size):
    """Megatron's uneven gather / reduce-scatter (expert-TP x EP dispatch) through the proxy."""
    from gspo_megatron.compat.cpu import _DistributedOnCpu

    proxy = _DistributedOnCpu()
    rows = [3, 5]  # rank r holds rows[r] rows of width 2
    mine = torch.full((rows[rank], 2), float(rank + 1))
    gathered = [torch.empty(n, 2) for n in rows]
    proxy.all_gather(gathered, mine)
    # reduce-scatter: every rank sends rows[r] rows to rank r; rank r gets the sum over senders
    send = [torch.full((n, 2), float(10 * (rank + 1) + r)) for r, n in enumerate(rows)]
    out = torch.empty(rows[rank], 2)
    proxy.reduce_scatter(out, send)
    return [g.tolist() for g in gathered], out.tolist()


@pytest.mark.slow
def test_uneven_all_gather_and_reduce_scatter_on_gloo():
    """Failure 9: gloo refuses list all_gather / reduce_scatter with unequal sizes; the proxy pads
    to the largest size and trims, giving exactly the unpadded result."""
    from tests.helpers.dist import run_gloo

    for rank, (gathered, reduced) in enumerate(run_gloo(_uneven_collectives, 2)):
        assert gathered == [[[1.0, 1.0]] * 3, [[2.0, 2.0]] * 5]
        n = [3, 5][rank]
        assert reduced == [[float(10 + rank + 20 + rank)] * 2] * n
