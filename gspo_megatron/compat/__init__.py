"""Version and hardware compatibility for megatron-core (see :mod:`gspo_megatron.compat.cpu`)."""

from gspo_megatron.compat.cpu import apply_cpu_compat

__all__ = ["apply_cpu_compat"]
