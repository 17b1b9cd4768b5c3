"""The multi-step decoding step on the build a GPU runs (``tools/gpu_check``'s ``decode_build``
stage).

    PYTHONPATH=. python -m tools.bench.gpu_decode [--new 24] [--batch 16]

The ``tiny`` preset built as ``precision.transformer_impl: auto`` builds it here: on a GPU with
Transformer Engine its fused norm + linear modules and ``TEGroupedMLP`` (bf16), on CPU the local
spec (fp32). Reported: the layer modules' types, whether the step function covers them
(``unsupported``: None, else why), ``rollout/decode_path`` of an engine with multi-step
decoding, greedy tokens of Megatron's forward at every step against the step function's, eager
and (CUDA) from CUDA graphs, the SDPA kernel the step's attention gets
(:func:`~gspo_megatron.backends.megatron.kernels.decode.attention_backend`), ms per decoding
step of each, and the memory reserved after each rollout (CUDA).

On CPU (``tests/unit/test_bench_smoke.py``) the same code runs the local spec; TE's modules are
read through the adapters tested with stand-ins (``tests/unit/test_decode_adapters.py``).
"""

from __future__ import annotations

import time


def _layer_types(model) -> dict:
    layer = next((lay for lay in model.decoder.layers if hasattr(lay.mlp, "router")),
                 model.decoder.layers[0])
    att = layer.self_attention
    return {"input_layernorm": type(layer.input_layernorm).__name__,
            "linear_qkv": type(att.linear_qkv).__name__,
            "linear_proj": type(att.linear_proj).__name__,
            "experts": type(getattr(layer.mlp, "experts", layer.mlp)).__name__}


def decode_attention_backend(model, batch: int = 16, keys: int = 1000) -> str:
    """The SDPA kernel of one decoding step's attention at this model's head layout (``batch``
    rows, ``keys`` keys, a key mask): :func:`~...kernels.decode.attention_backend`."""
    import torch

    from gspo_megatron.backends.megatron.kernels.decode import DecodeWeights, attention_backend

    w = DecodeWeights.of(model)
    p = next(model.parameters())
    B, Lk = batch, keys
    q = torch.randn(B, w.heads, 1, w.head_dim, dtype=p.dtype, device=p.device)
    k = torch.randn(B, Lk, w.groups, w.head_dim, dtype=p.dtype, device=p.device)
    mask = torch.ones(B, 1, Lk, dtype=torch.bool, device=p.device)
    return attention_backend(w, q, k, k, mask)


def run(batch: int = 16, new: int = 24) -> dict:
    import torch

    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.kernels.decode import unsupported
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.config.model import (ParallelConfig, PrecisionConfig,
                                            model_config_from_preset)
    from gspo_megatron.metrics import wait_for_device

    cuda = torch.cuda.is_available()
    model_cfg = model_config_from_preset("tiny", seq_length=16 + new)
    parallel = ParallelConfig()
    groups = initialize_distributed(parallel, model_cfg, seed=0)
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    try:
        gpt = build_gpt_model(model_cfg, parallel, PrecisionConfig(transformer_impl="auto",
                                                                   bf16=cuda),
                              pre_process=True, post_process=True)
        gpt.eval()
        out["modules"] = _layer_types(gpt)
        out["unsupported"] = unsupported(gpt, groups)
        vocab = min(100, model_cfg.vocab_size)
        prompts = torch.randint(1, vocab, (batch, 16),
                                generator=torch.Generator().manual_seed(0)).tolist()
        paths = {"megatron_forward": dict(decode_steps_per_sync=0),
                 "rounds_eager": dict(decode_cuda_graphs=False),
                 "rounds_graphs": dict(decode_cuda_graphs=True)}
        tokens = {}
        for name, overrides in paths.items():
            try:
                engine = RolloutEngine(gpt, groups, eos_id=0, pad_id=0, vocab_size=vocab,
                                       config=RolloutConfig(max_new_tokens=new, top_k=1,
                                                            ignore_eos=True, max_batch_size=batch,
                                                            **overrides))
                engine.generate(prompts, seed=0)  # warm-up (graphs captured, buffers made)
                wait_for_device()
                start = time.perf_counter()
                samples = engine.generate(prompts, seed=0)
                wait_for_device()
                seconds = time.perf_counter() - start
                tokens[name] = [s.response_ids for s in samples]
                out[name] = {"decode_path": engine.decode_path,
                             "ms_per_step": 1e3 * seconds / new}
                if cuda:
                    out[name]["memory_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
            except Exception as exc:  # noqa: BLE001 - record it and run the other paths
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        ref = tokens.get("megatron_forward")
        out["greedy_equal"] = {name: got == ref for name, got in tokens.items()
                               if name != "megatron_forward"}
        out["attention_backend"] = decode_attention_backend(gpt)
    finally:
        destroy_distributed()
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=24)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.batch, args.new)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
