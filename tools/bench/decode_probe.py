"""What the fast decoder does on this machine (``tools/gpu_check``'s ``decode_probe`` stage).

    PYTHONPATH=. python -m tools.bench.decode_probe [--size smoke|quick|full] [--tiny]

The model of ``examples/configs/gpu_qwen3_slice_rl.yaml`` (``--tiny``: the tiny preset in fp32)
decoding ``batch`` random prompts, greedy, through the multi-step rounds, with CUDA graphs and
without, ``RL_STEPS`` calls each with a weight update between them (as the RL loop does).
Reported (:func:`probe`):

- ``decode_path``: ``rounds`` (the step function) or ``megatron`` (its forward at every step),
  the experts replicated or not, ``rollout/decode_graphs`` and the captures;
- ``attention_backend``: the SDPA kernel the decode attention gets at these shapes
  (:func:`tools.bench.gpu_decode.decode_attention_backend`: ``math`` means fp32 scores);
- ``sync_warnings_per_round``: ``torch.cuda.set_sync_debug_mode("warn")`` over the rounds (the
  round's two planned host reads, and anything else that waits for the device);
- ``reserved_after_capture``: ``torch.cuda.memory_reserved()`` after each graph capture, and
  ``reserved_after_call`` after each RL step's rollout (flat: nothing outlives a rollout);
- ``ms_per_step`` against ``weights_read_ms`` (the weights' bytes over the measured copy
  bandwidth: the step's memory-bound floor);
- ``graph_tokens_equal`` / ``graph_requests_differ``: greedy tokens with graphs against the eager
  step's, and the log-probs before each request's first difference (:func:`compare_greedy`).

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


def probe(make_engine, prompts: list[list[int]], update=None, params=()) -> dict:
    """The figures of the module's docstring. ``make_engine(cuda_graphs)``: a
    :class:`~gspo_megatron.backends.megatron.engine.rollout.RolloutEngine` (greedy) with
    ``rollout.decode_cuda_graphs`` as given; ``update()``: a weight update between RL steps
    (in place, as the optimizer's) of ``params``, the model's parameters, which are restored
    before the graphs' run and at the end: both runs' first rollouts see the same weights
    (else the graphs' tokens would be compared with the eager ones at other weights)."""
    import torch

    from tools.bench.gpu_decode import decode_attention_backend

    out: dict = {}
    tokens = {}
    saved = [p.detach().clone() for p in params]

    @torch.no_grad()
    def restore():
        for p, s in zip(params, saved):
            p.copy_(s)

    for graphs in (False, True):
        restore()
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
                tokens[key] = samples
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
            out["attention_backend"] = decode_attention_backend(model, len(prompts), 1024)
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            out["weights_read_ms"] = 1e3 * weight_bytes / copy_bandwidth(device)
        del engine, fast
    restore()
    out.update({f"graph_{k}": v for k, v in compare_greedy(tokens["eager"],
                                                           tokens["graphs"]).items()})
    return out


def compare_greedy(eager: list, graphs: list) -> dict:
    """Greedy samples of one path (``eager``) against another's (``graphs``): ``tokens_equal``,
    the requests whose tokens differ, and the largest log-prob difference over each request's
    tokens before its first difference (in bf16 a graph's padded rows change the GEMMs' row
    counts, hence their rounding: a near-tie of random weights' logits can flip an argmax, after
    which the two continuations are different sequences and not comparable)."""
    differ, worst = 0, 0.0
    for a, b in zip(eager, graphs):
        n = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y),
                 min(len(a.response_ids), len(b.response_ids)))
        differ += a.response_ids != b.response_ids
        worst = max([worst] + [abs(x - y) for x, y in zip(a.response_logprobs[:n],
                                                         b.response_logprobs[:n])])
    return {"tokens_equal": differ == 0, "requests_differ": differ, "requests": len(eager),
            "logprob_max_abs_diff_before_first_differ": worst}


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
        out = probe(make_engine, prompts, update, list(gpt.parameters()))
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
