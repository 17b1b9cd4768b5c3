"""Count what makes the host wait for the device during a rollout, on CPU: the baseline of issue 48
(a decoding step with at most one host synchronisation on average).

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m tools.bench.host_syncs [--requests 128] [--new-tokens 64]

On CUDA each of these blocks the host until the device has computed the value it reads; on CPU
the same calls run, so they can be counted where CI runs (:class:`HostSyncCounter`):

* scalar reads: ``.item()``, ``int()`` / ``float()`` / ``bool()`` of a tensor, ``if tensor:``
  (``aten::_local_scalar_dense``);
* ops whose output size depends on values: ``nonzero`` (and boolean-mask indexing and
  ``masked_select``, which call it), ``unique``;
* copies to the host: ``Tensor.tolist()``, ``.numpy()``, ``.cpu()`` (counted at the Python call:
  on CPU they dispatch nothing; a ``.cpu()`` of a tensor already on the host is counted too, so
  the figure is an upper bound).

Workload: the tiny preset (2 layers, hidden 64, 4 experts top-2), random weights, the dynamic
engine with every request admitted at once, ``ignore_eos`` so each request writes exactly
``--new-tokens`` tokens (one prefill step, then decoding steps). Reports the count per engine step
and the most frequent call sites.
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "masked_select", "unique")
"""``Tensor`` methods that read values back to the host (or size their output by them)."""


_INHERITED = object()
"""Marks a wrapped attribute the class did not define itself (restored by deleting the wrapper)."""


class _MaskIndexing(TorchDispatchMode):
    """Sees ``aten.index`` / ``index_put_`` with a boolean index (``x[mask]``: its output size is
    the mask's count); ``Tensor.__getitem__`` itself is not wrapped (an inherited slot assigned on
    ``torch.Tensor`` makes every tensor a Python sequence for good)."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("index", "index_put_", "index_put") and len(args) > 1 \
                and any(torch.is_tensor(i) and i.dtype == torch.bool for i in args[1] or ()):
            self.count("mask indexing")
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """Counts host synchronisations (see the module docstring) made from Python inside the
    ``with`` block: ``total`` and ``sites`` (the innermost frame under ``megatron`` /
    ``gspo_megatron``, with what it called). Counted at the Python call (on CPU most of them
    dispatch nothing a dispatch mode would see: ``bool()`` / ``int()`` of a CPU tensor read its
    memory directly), plus ``torch.nonzero`` / ``masked_select`` / ``unique`` and indexing with a
    boolean mask (seen at dispatch); what C++ does inside one op is not seen."""

    def __init__(self):
        self.total = 0
        self.sites: collections.Counter = collections.Counter()
        self._originals: dict = {}

    def _count(self, what: str) -> None:
        self.total += 1
        site = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {what}"
                     for f in reversed(traceback.extract_stack()[:-2])
                     if "megatron" in f.filename), what)
        self.sites[site] += 1

    def _wrap(self, owner, name: str):
        fn = getattr(owner, name)
        # what to put back: the class's own attribute, or nothing (an inherited method stays
        # inherited: deleting the wrapper, not assigning the base's method on torch.Tensor)
        self._originals[(owner, name)] = vars(owner).get(name, _INHERITED) if isinstance(
            owner, type) else fn

        def counted(*args, **kwargs):
            self._count(name)
            return fn(*args, **kwargs)
        setattr(owner, name, counted)

    def __enter__(self) -> "HostSyncCounter":
        for name in READS:
            self._wrap(torch.Tensor, name)
        for name in ("nonzero", "masked_select", "unique"):
            self._wrap(torch, name)
        self._mode = _MaskIndexing(self._count)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for (owner, name), fn in self._originals.items():
            if fn is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
        self._originals.clear()


def measure(requests: int, new_tokens: int, seed: int = 0,
            steps_per_sync: tuple[int, ...] = (0, 16)) -> dict:
    """One rollout of ``requests`` prompts x ``new_tokens`` on the dynamic engine, counted, per
    ``rollout.decode_steps_per_sync`` (0: Megatron's forward and bookkeeping every step;
    16: the multi-step rounds, the default)."""
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.parallel import initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig, RolloutConfig
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset

    vocab = 24
    model = model_config_from_preset("tiny", seq_length=16 + new_tokens)
    groups = initialize_distributed(ParallelConfig(), model, seed=seed)
    policy = build_policy(model, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab - 1, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 12, (requests,), generator=gen)]
    out = {}
    for k in steps_per_sync:
        engine = RolloutEngine(policy.model, groups, eos_id=vocab - 1, pad_id=0,
                               vocab_size=vocab,
                               config=RolloutConfig(engine="dynamic", max_new_tokens=new_tokens,
                                                    ignore_eos=True, max_batch_size=requests,
                                                    decode_steps_per_sync=k))
        engine.generate(prompts, seed=seed)  # warm-up: allocations, first-call caches
        with HostSyncCounter() as counter:
            samples = engine.generate(prompts, seed=seed + 1)
        steps = engine.dynamic.steps
        assert all(len(s.response_ids) == new_tokens for s in samples)
        out[k] = {"requests": requests, "new_tokens": new_tokens, "engine_steps": steps,
                  "host_syncs": counter.total, "per_step": counter.total / steps,
                  "top_sites": counter.sites.most_common(12)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for k, r in measure(args.requests, args.new_tokens).items():
        print(f"decode_steps_per_sync={k}: {r['requests']} requests x {r['new_tokens']} new "
              f"tokens: {r['engine_steps']} engine steps, {r['host_syncs']} host "
              f"synchronisations, {r['per_step']:.2f} per step")
        for site, n in r["top_sites"]:
            print(f"  {n:6d}  {site}")


if __name__ == "__main__":
    main()
