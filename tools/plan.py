#!/usr/bin/env python3
"""Per-GPU memory of a Megatron layout for a Qwen3-MoE preset or HF config, and layouts that fit.

    python tools/plan.py --model qwen3-30b-a3b --gpus 16 --gpu-memory 80 --tp 2 --ep 8
    python tools/plan.py --model qwen3-235b-a22b --gpus 128 --gpu-memory 80 --suggest
    python tools/plan.py --hf-config path/to/config.json --gpus 8 --tp 1 --ep 8

Exits non-zero, before anything is submitted, when the layout does not divide the GPUs, heads or
experts, or does not fit in memory; it then prints layouts that do.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gspo_megatron.model.config import MODEL_PRESETS, model_config_from_preset  # noqa: E402
from gspo_megatron.planner import GIB, Layout, plan_memory, suggest_layouts  # noqa: E402


def load_model(args):
    if args.hf_config:
        from gspo_megatron.model.hf_config import model_config_from_hf

        return model_config_from_hf(args.hf_config)
    if args.model not in MODEL_PRESETS:
        raise SystemExit(f"plan: unknown model {args.model!r}; presets: {', '.join(sorted(MODEL_PRESETS))}")
    return model_config_from_preset(args.model)


def table(plan) -> str:
    rows = [("parameters / GPU", f"{plan.params_per_gpu:,} (dense {plan.dense_params_per_gpu:,}, "
                                 f"experts {plan.expert_params_per_gpu:,})"),
            ("weights", plan.weights), ("gradients (fp32)", plan.grads),
            ("optimizer (fp32 master + Adam)", plan.optimizer),
            ("activations (estimate)", plan.activations), ("log-prob logits", plan.logits),
            ("routing replay buffer", plan.routing_replay), ("total", plan.total)]
    lines = [f"layout {plan.layout.describe()} DP{plan.dp} on {plan.num_gpus} GPUs"]
    for name, value in rows:
        lines.append(f"  {name:32s} {value if isinstance(value, str) else f'{value / GIB:8.2f} GiB'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="preset name")
    ap.add_argument("--hf-config", help="a Hugging Face Qwen3-MoE config.json instead of a preset")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: TP)")
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-length", type=int, default=None)
    ap.add_argument("--fp32", action="store_true", help="fp32 weights (CPU runs)")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--recompute", choices=["full", "selective", "none"], default="full")
    ap.add_argument("--rollout-tokens", type=int, default=0, help="tokens per rollout batch per rank (replay buffer)")
    ap.add_argument("--routing-replay", action="store_true")
    ap.add_argument("--suggest", action="store_true", help="list layouts that fit instead")
    args = ap.parse_args(argv)

    model = load_model(args)
    kwargs = dict(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                  bf16=not args.fp32, distributed_optimizer=not args.no_distributed_optimizer,
                  recompute=None if args.recompute == "none" else args.recompute,
                  rollout_tokens=args.rollout_tokens, routing_replay=args.routing_replay)
    if args.suggest:
        plans = suggest_layouts(model, args.gpus, args.gpu_memory, **kwargs)
        if not plans:
            print(f"plan: no layout of {args.gpus} GPUs fits in {args.gpu_memory} GiB", file=sys.stderr)
            return 1
        for plan in plans:
            print(table(plan))
        return 0
    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp)
    try:
        plan = plan_memory(model, layout, args.gpus, **kwargs)
    except ValueError as exc:
        print(f"plan: invalid layout {layout.describe()}: {exc}", file=sys.stderr)
        _print_suggestions(model, args, kwargs)
        return 2
    print(table(plan))
    if plan.total > args.gpu_memory * GIB:
        print(f"plan: does not fit: {plan.total / GIB:.1f} GiB > {args.gpu_memory} GiB per GPU",
              file=sys.stderr)
        _print_suggestions(model, args, kwargs)
        return 3
    return 0


def _print_suggestions(model, args, kwargs) -> None:
    plans = suggest_layouts(model, args.gpus, args.gpu_memory, limit=3, **kwargs)
    if plans:
        print("layouts that fit:", file=sys.stderr)
        for p in plans:
            print(f"  {p.layout.describe()} DP{p.dp}: {p.total / GIB:.1f} GiB", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
