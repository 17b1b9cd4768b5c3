"""What the fast decoder does on this machine (``tools/gpu_check``'s ``decode_probe`` stage).

    PYTHONPATH=. python -m tools.bench.decode_probe [--size smoke|quick|full] [--tiny]

The model of ``examples/configs/gpu_qwen3_slice_rl.yaml`` (``--tiny``: the tiny preset in fp32)
decoding ``batch`` random prompts, greedy, through the multi-step rounds, with CUDA graphs and
without, ``RL_STEPS`` calls each with a weight update between them (as the RL loop does).
Reported (:func:`probe`):

- ``decode_path``: ``rounds`` (the step function) or ``megatron`` (its forward at every step),
  the experts replicated or not, ``rollout/decode_graphs`` and the captures;
- ``attention_backend``: the SDPA backend torch picks for the decode attention's shapes (a mask
  and grouped query heads: ``MATH`` means K/V repeated and fp32 scores);
- ``sync_warnings_per_round``: ``torch.cuda.set_sync_debug_mode("warn")`` over the rounds (the
  round's two planned host reads, and anything else that waits for the device);
- ``reserved_after_capture``: ``torch.cuda.memory_reserved()`` after each graph capture, and
  ``reserved_after_call`` after each RL step's rollout (flat: nothing outlives a rollout);
- ``ms_per_step`` against ``weights_read_ms`` (the weights' bytes over the measured copy
  bandwidth: the step's memory-bound floor);
- ``graph_tokens_equal``: greedy tokens with graphs equal the eager step's.

On CPU the same code runs (no graphs, no sync debug mode: those fields are None); the unit test
``tests/unit/test_decode_probe.py`` runs :func:`probe` there.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

RL_STEPS = 3
SIZES = {"smoke": (8, 16), "quick": (32, 64), "full": (128, 128)}
"""size -> (requests, new tokens each)."""


def attention_backend(heads: int, groups: int, head_dim: int, batch: int, keys: int, dtype,
                      device) -> str:
    """The SDPA backend torch picks for one decoding step's attention as
    :func:`~gspo_megatron.backends.megatron.kernels.decode._attend` calls it (a boolean mask,
    ``enable_gqa`` with grouped query heads); ``unknown`` where torch cannot say."""
    import torch

    q = torch.zeros(batch, heads, 1, head_dim, dtype=dtype, device=device)
    k = torch.zeros(batch, groups, keys, head_dim, dtype=dtype, device=device)
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool, device=device)
    try:
        choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False, None,
                                         enable_gqa=heads != groups)
        return torch.nn.attention.SDPBackend(choice).name
    except Exception as exc:  # noqa: BLE001 - private API: record why
        return f"unknown ({type(exc).__name__})"


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy (read + write), 64 MiB on CPU, 1 GiB on CUDA."""
    import torch

    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    sync()
    return 2 * 5 * n / (time.perf_counter() - t)


def _sync_counted_rounds(fast, counts: list[int]):
    """``fast.run`` (one round) under ``set_sync_debug_mode("warn")``, the warnings of each
    round appended to ``counts``; the original ``run`` returned to restore it."""
    import torch

    run = fast.run

    def counted(*args, **kwargs):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return run(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                counts.append(sum("synchroniz" in str(w.message) for w in seen))
    fast.run = counted
    return run


def probe(make_engine, prompts: list[list[int]], update=None) -> dict:
    """The figures of the module's docstring. ``make_engine(cuda_graphs)``: a
    :class:`~gspo_megatron.backends.megatron.engine.rollout.RolloutEngine` (greedy) with
    ``rollout.decode_cuda_graphs`` as given; ``update()``: a weight update between RL steps
    (in place, as the optimizer's)."""
    import torch

    out: dict = {}
    tokens = {}
    for graphs in (False, True):
        engine = make_engine(graphs)
        fast = engine.dynamic.fast if engine.dynamic is not None else None
        model = engine.sampling_model
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        key = "graphs" if graphs else "eager"
        rec: dict = {"decode_path": "rounds" if fast is not None else "megatron"}
        counts: list[int] = []
        if fast is not None and cuda:
            _sync_counted_rounds(fast, counts)
        reserved, times, steps = [], [], []
        for step in range(RL_STEPS):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            samples = engine.generate(prompts, seed=step)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            steps.append(engine.dynamic.steps if engine.dynamic is not None else
                         max(len(s.response_ids) for s in samples))
            reserved.append(torch.cuda.memory_reserved() if cuda else None)
            if step == 0:
                tokens[key] = [s.response_ids for s in samples]
            if update is not None and step < RL_STEPS - 1:
                update()
        rec["ms_per_step"] = [1e3 * t / max(s, 1) for t, s in zip(times, steps)]
        rec["reserved_after_call"] = reserved
        rec["sync_warnings_per_round"] = (sum(counts) / len(counts) if counts else None)
        if fast is not None:
            rec["replicated"] = fast.replicated
            rec.update(fast.metrics())
            rec["reserved_after_capture"] = (list(fast.graphs.reserved_after_capture)
                                             if fast.graphs is not None else None)
        out[key] = rec
        if not graphs:
            c = model.config
            out["attention_backend"] = attention_backend(
                c.num_attention_heads, c.num_query_groups, c.kv_channels, len(prompts), 1024,
                c.params_dtype, device)
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            out["weights_read_ms"] = 1e3 * weight_bytes / copy_bandwidth(device)
        del engine, fast
    out["graph_tokens_equal"] = tokens["graphs"] == tokens["eager"]
    return out


def run(size: str = "full", tiny: bool = False) -> dict:
    import torch

    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config import RolloutConfig
    from tools.bench.gpu_rollout import slice_setup

    batch, new = SIZES[size]
    cfg, model_cfg, vocab, precision = slice_setup(new, tiny)
    groups = initialize_distributed(cfg.parallel, model_cfg, seed=0)
    try:
        gpt = build_gpt_model(model_cfg, cfg.parallel, precision, pre_process=True,
                              post_process=True)
        rc = RolloutConfig(max_new_tokens=new, max_batch_size=batch, top_k=1,
                           dynamic_buffer_size_gb=0.05 if tiny else 4.0)
        prompts = torch.randint(1, vocab, (batch, 16),
                                generator=torch.Generator().manual_seed(0)).tolist()

        def make_engine(graphs: bool):
            return RolloutEngine(gpt, groups, eos_id=0, pad_id=0, vocab_size=vocab,
                                 config=dataclasses.replace(rc, decode_cuda_graphs=graphs))

        @torch.no_grad()
        def update():  # an optimizer step's in-place write
            for p in gpt.parameters():
                p.mul_(1.0 - 1e-3)
        out = probe(make_engine, prompts, update)
    finally:
        destroy_distributed()
    out.update(model="tiny" if tiny else "qwen3-30b-a3b x 2 layers", batch=batch, new_tokens=new,
               device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    return out


def main(argv: list[str] | None = None) -> int:
    from tools.bench.gpu_rollout import sized_cli

    return sized_cli(__doc__, SIZES, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
