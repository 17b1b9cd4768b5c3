import os
import sys

# Tests import helpers as `tests.helpers...` from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("WANDB_MODE", "disabled")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind():
    """A test module that initialises torch.distributed in the pytest process (a world of one)
    must not hand it to the next module: with the test files spread over workers (pytest-xdist,
    ``make test``) which module comes next differs from run to run, and a test that expects no
    process group (or forks ranks from this process) would see another's."""
    yield
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from gspo_megatron.backends.megatron.parallel import destroy_distributed

            destroy_distributed()
