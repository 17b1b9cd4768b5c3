"""Training state off the GPU while this rank rolls out (``trainer.offload``).

A colocated rank holds, beside the bf16 weights the rollout reads, the optimizer's Adam moments,
DDP's fp32 gradient buffers and (bf16 training) the optimizer's fp32 main copy of the weights:
16 of the 18 bytes a parameter, none of which a rollout touches. :class:`StateOffload` copies
the chosen part to host memory (pinned on CUDA, so both copies run at PCIe speed) and frees its
device storage with ``untyped_storage().resize_(0)``; :meth:`StateOffload.reload` resizes each
storage back and copies the bytes in. The tensors themselves are never replaced: every view of a
storage (a parameter's ``main_grad`` inside DDP's flat buffer, the optimizer's ``param.grad``,
a bucket's slice) sees the restored bytes through the same storage object, which is how slime
(torch_memory_saver) and verl (``offload_megatron_optimizer`` / ``offload_megatron_grad``) do it.

Where Megatron keeps the state (megatron-core 0.16):

* Adam's moments: ``optimizer.state[p]`` of the torch optimizer inside each of Megatron's
  optimizers (``ChainedOptimizer.chained_optimizers``: dense and expert-parallel parameters);
  keyed by the fp32 main parameters (the shards of them under the distributed optimizer).
* Gradients: each DDP chunk's ``buffers`` and ``expert_parallel_buffers``
  (``_ParamAndGradBuffer.grad_data``, one flat fp32 tensor each; ``param.main_grad`` and the
  buckets are views of it).
* The fp32 main copy: ``Float16OptimizerWithFloat16Params.fp32_from_float16_groups`` or the
  distributed optimizer's ``shard_fp32_from_float16_groups``. With fp32 training
  (``FP32Optimizer``) the optimizer steps the weights themselves; they stay.

A storage shared with a model parameter (or DDP's parameter buffer) is never freed, whatever
the setting: the rollout reads the weights.

On CPU the same calls run (host memory to a separate host buffer and back), so CI proves the
round trip is exact and that nothing reads the state while it is away (a freed storage has no
bytes: a read there would fault).
"""

from __future__ import annotations

import torch

from gspo_megatron.config.schema import OFFLOAD_PARTS


def _optimizers(optimizer) -> list:
    """Megatron's optimizers behind ``optimizer`` (a ``ChainedOptimizer`` or one of them)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor of the torch optimizers' per-parameter state (Adam's ``exp_avg``,
    ``exp_avg_sq``, and ``step`` where it is a tensor)."""
    out = []
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (getattr(inner, "state", {}) or {}).values():
            out += [v for v in state.values() if torch.is_tensor(v)]
    return out


def grad_buffer_tensors(model: list) -> list[torch.Tensor]:
    """DDP's flat gradient buffers of each chunk (dense and expert-parallel)."""
    return [b.grad_data for chunk in model
            for b in (*getattr(chunk, "buffers", ()), *getattr(chunk, "expert_parallel_buffers", ()))
            if getattr(b, "grad_data", None) is not None]


def main_param_tensors(optimizer) -> list[torch.Tensor]:
    """The fp32 main copy of bf16 weights (none for fp32 training: the weights are stepped)."""
    out = []
    for opt in _optimizers(optimizer):
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(opt, name, None) or ():
                out += [p for p in group if torch.is_tensor(p)]
    return out


def _key(storage: torch.UntypedStorage) -> tuple:
    return storage.device, storage.data_ptr()


class StateOffload:
    """The storages behind ``setting``'s parts (:data:`OFFLOAD_PARTS`) of a policy's training
    state (``model``: its DDP chunks; ``optimizer``: Megatron's), moved to host memory by
    :meth:`offload` and back by :meth:`reload`. The host buffers are allocated once and reused
    every step. ``moved_bytes``: device bytes freed by the last offload."""

    def __init__(self, setting: str):
        if setting not in OFFLOAD_PARTS:
            raise ValueError(f"trainer.offload must be one of {', '.join(OFFLOAD_PARTS)}, got "
                             f"{setting!r}")
        self.setting = setting
        self.model: list = []
        self.optimizer = None
        self._host: dict[tuple, torch.Tensor] = {}
        self._away: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []
        self.moved_bytes = 0

    @property
    def active(self) -> bool:
        """Whether anything is off the device now."""
        return bool(self._away)

    def _storages(self) -> list[torch.UntypedStorage]:
        """The distinct live storages to move, found afresh each time (the optimizer creates
        Adam's state at its first step, and a checkpoint load may replace it), less any that
        holds weights."""
        parts = OFFLOAD_PARTS[self.setting]
        tensors = []
        if "optimizer" in parts:
            tensors += optimizer_state_tensors(self.optimizer)
        if "grads" in parts:
            tensors += grad_buffer_tensors(self.model)
        if "main" in parts:
            tensors += main_param_tensors(self.optimizer)
        weights = {_key(p.untyped_storage()) for chunk in self.model for p in chunk.parameters()}
        weights |= {_key(b.param_data.untyped_storage()) for chunk in self.model
                    for b in (*getattr(chunk, "buffers", ()),
                              *getattr(chunk, "expert_parallel_buffers", ()))
                    if getattr(b, "param_data", None) is not None}
        seen, out = set(), []
        for t in tensors:
            s = t.untyped_storage()
            key = _key(s)
            if s.nbytes() == 0 or key in seen or key in weights:
                continue
            seen.add(key)
            out.append(s)
        return out

    @staticmethod
    def _bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor over the whole of ``storage``."""
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))

    def offload(self, model: list, optimizer) -> int:
        """Copy the state to host memory and free its device storage; returns the bytes freed.
        Nothing may read or write the moved tensors until :meth:`reload`."""
        if self.active:
            raise RuntimeError("internal: training state offloaded twice")
        self.model, self.optimizer = model, optimizer
        pinned = torch.cuda.is_available()
        storages = self._storages()
        for s in storages:
            n = s.nbytes()
            host = self._host.get((_key(s), n))
            if host is None:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            host.copy_(self._bytes(s, n), non_blocking=pinned)
            self._away.append((s, n, host))
        if pinned:  # the copies must land before the storage is handed back to the allocator
            torch.cuda.synchronize()
        for s, _, _ in self._away:
            s.resize_(0)
        self.moved_bytes = sum(n for _, n, _ in self._away)
        return self.moved_bytes

    def reload(self) -> None:
        """Give each storage its bytes back (new device memory, the same storage objects, so
        every tensor and view of it is valid again) and copy the state in."""
        pinned = torch.cuda.is_available()
        host_buffers = {}
        for s, n, host in self._away:
            s.resize_(n)
            self._bytes(s, n).copy_(host, non_blocking=pinned)
            host_buffers[(_key(s), n)] = host
        if pinned:
            torch.cuda.synchronize()
        # Keyed by the restored address: the next offload of the same storage reuses its buffer.
        self._host = host_buffers
        self._away = []
