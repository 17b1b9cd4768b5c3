"""The rollout engine's sampling copy: the live policy in another dtype (``rollout.precision``),
sharing its process groups, refreshed from the live weights before every generate."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist


def _shared_objects_memo(model) -> dict[int, Any]:
    """``copy.deepcopy`` memo entries that keep ``model``'s process groups shared: every
    ``ProcessGroup`` (cannot be copied: it is a live communicator) and ``ProcessGroupCollection``
    reachable from a module's attributes (through lists, dicts and plain objects such as token
    dispatchers), mapped to itself; and tensors a training forward left in such attributes (part
    of an autograd graph, which ``deepcopy`` refuses) mapped to detached views. Walks non-parameter
    attributes only; ~2 ms on the tiny model."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    shared = (dist.ProcessGroup, ProcessGroupCollection)
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [v for m in model.modules() for k, v in vars(m).items()
             if k not in ("_parameters", "_buffers", "_modules")]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:  # a forward's leftover (e.g. a dispatcher's probs)
                memo[id(obj)] = obj.detach()  # deepcopy refuses non-leaf tensors
        elif isinstance(obj, shared):
            memo[id(obj)] = obj
            if isinstance(obj, ProcessGroupCollection):
                stack.extend(vars(obj).values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif not isinstance(obj, (torch.Tensor, torch.nn.Module, type, str, bytes)) \
                and not callable(obj) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return memo


class SamplingCopy:
    """A copy of the live policy ``GPTModel`` in ``dtype`` for the rollout engine to sample from.

    Built by ``copy.deepcopy`` of the live module with a memo that (a) maps every parameter to a
    new ``dtype`` parameter (no fp32 transient, no grad, no DDP attributes such as ``main_grad``),
    (b) keeps process groups shared (:func:`_shared_objects_memo`), so TP/EP/PP ranks hold their
    own shards and talk over the same communicators, (c) gives the copy its own shallow copy of
    the ``TransformerConfig`` with ``params_dtype``/``bf16`` set (the live config is untouched)
    and (d) drops the routers' ``router_replay`` objects (the copy routes freely; record routes
    with forward hooks on :attr:`model`). No RNG is drawn (nothing is re-initialised).

    Attributes:
        model: the copied ``GPTModel`` (eval mode, ``requires_grad=False``).
        module: what the engine runs: ``Float16Module(model)`` for bf16/fp16 (casts the first
            stage's float inputs down and the last stage's logits ``[B, T, V/TP]`` up to fp32),
            else ``model``.
        last_refresh_s: wall time of the latest :meth:`refresh`.

    Cost: the copy's parameters (bf16: half the live fp32 bytes); a refresh is one cast-copy per
    parameter (``torch._foreach_copy_``), done before every generate because in-place writes
    through ``.data`` (optimizers, checkpoint loads) do not bump a tensor's version counter, so
    "weights unchanged" cannot be known cheaply and safely.
    """

    def __init__(self, live, dtype: torch.dtype):
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.moe.router import TopKRouter

        self.live, self.dtype = live, dtype
        config = copy.copy(live.config)
        config.params_dtype = config.pipeline_dtype = dtype
        config.bf16, config.fp16 = dtype == torch.bfloat16, dtype == torch.float16
        memo = _shared_objects_memo(live)
        memo[id(live.config)] = config
        for p in live.parameters():
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for m in live.modules():
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None:
                memo[id(m.router_replay)] = None
        self.model = copy.deepcopy(live, memo).eval()
        for m in self.model.modules():  # hooks installed on the live module stay there
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
        self.module = (Float16Module(config, self.model).eval()
                       if config.bf16 or config.fp16 else self.model)
        names = [n for n, _ in live.named_parameters()]
        if names != [n for n, _ in self.model.named_parameters()]:
            raise RuntimeError("internal: the sampling copy's parameters differ from the live model's")
        self._dst = list(self.model.parameters())
        self._src = list(live.parameters())
        self._bufs = [(d, s) for (_, d), (_, s) in zip(self.model.named_buffers(),
                                                       live.named_buffers())
                      if s.is_floating_point()]  # e.g. a router's expert bias
        self.last_refresh_s = 0.0
        self.on_refresh: list = []
        """Called after each refresh's copy, in order (e.g. FP8 weights:
        :class:`~..rollout_numerics.Fp8Weights`); their time counts in ``last_refresh_s``."""

    @torch.no_grad()
    def refresh(self) -> float:
        """Copy (and cast) the live weights into the copy; returns the seconds it took."""
        start = time.perf_counter()
        torch._foreach_copy_(self._dst, self._src)
        for d, s in self._bufs:
            d.copy_(s)
        for hook in self.on_refresh:
            hook()
        self.last_refresh_s = time.perf_counter() - start
        return self.last_refresh_s


def copy_dtype(precision: str, model) -> torch.dtype | None:
    """The dtype of the copy ``rollout.precision`` asks for; None (sample from the live module)
    for ``auto`` or the live parameters' own dtype; ``fp8``: always a bf16 copy (it holds the
    dequantized FP8 weights)."""
    if precision == "auto":
        return None
    if precision == "fp8":  # FP8 weights dequantized into a bf16 copy (..rollout_numerics)
        return torch.bfloat16
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"rollout.precision must be 'auto', 'fp32', 'bf16' or 'fp8', got "
                         f"{precision!r}")
    dtype = dtypes[precision]
    return None if dtype == next(model.parameters()).dtype else dtype
