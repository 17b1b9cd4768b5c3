"""Everything that adapts megatron-core to this machine, applied once at distributed start-up.

* :mod:`.cpu`: megatron-core 0.16 on CPU (gloo, fp32), scoped to an explicit list of its modules.
* :mod:`.inference`: the static generation loop's CUDA-only spots on CPU; its progress bars.
* :mod:`.paged_attention`: PyTorch SDPA stand-ins for flash-attn's paged-KV kernels, installed into
  Megatron's attention module only when flash-attn is absent (the GPU dynamic inference engine).

:func:`apply_compat` is the single entry point; :func:`check_megatron_version` refuses a
megatron-core these shims were not checked against (``GSPO_ALLOW_UNTESTED_MEGATRON=1`` overrides).
"""

from __future__ import annotations

import logging
import os

from gspo_megatron.compat.cpu import apply_cpu_compat

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON = ("0.16.",)
"""megatron-core release lines the CPU shims and the routing-replay hooks were checked on."""
ALLOW_UNTESTED_ENV = "GSPO_ALLOW_UNTESTED_MEGATRON"


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is not a checked version (override with the environment)."""


def check_megatron_version(version: str | None = None) -> str:
    """Return the megatron-core version, or raise :class:`UnsupportedMegatronError` (one line)
    unless ``GSPO_ALLOW_UNTESTED_MEGATRON=1``, in which case a warning is logged."""
    if version is None:  # from the installed distribution: importing megatron.core costs seconds
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("megatron-core")
        except PackageNotFoundError:
            from megatron.core.package_info import __version__ as version
    if version.startswith(SUPPORTED_MEGATRON):
        return version
    msg = (f"megatron-core {version} is not a checked version (checked: "
           f"{', '.join(v + 'x' for v in SUPPORTED_MEGATRON)}); set {ALLOW_UNTESTED_ENV}=1 to "
           "run anyway")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s", msg)
        return version
    raise UnsupportedMegatronError(msg)


def apply_missing_te_compat() -> bool:
    """megatron-core 0.16.1 bug, on CPU *and* GPU: the MoE router's GEMM tests
    ``te_general_gemm is not None``, a name that module defines only when Transformer Engine
    imports, so without TE every router forward raises NameError. Define it as None (the torch
    path). Found on CPU; it would also have stopped the local spec on an H100. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def apply_compat() -> None:
    """Check the megatron-core version, then apply every shim this machine needs (idempotent)."""
    from gspo_megatron.compat import paged_attention
    from gspo_megatron.compat.inference import apply_inference_compat, silence_static_engine_progress_bar

    check_megatron_version()
    apply_missing_te_compat()
    apply_cpu_compat()
    apply_inference_compat()
    silence_static_engine_progress_bar()
    paged_attention.install()


__all__ = ["ALLOW_UNTESTED_ENV", "SUPPORTED_MEGATRON", "UnsupportedMegatronError",
           "apply_compat", "apply_cpu_compat", "apply_missing_te_compat",
           "check_megatron_version"]
