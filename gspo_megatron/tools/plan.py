"""Per-GPU memory of a Megatron layout for a Qwen3-MoE model, and layouts that fit.

    gspo-plan --model qwen3-30b-a3b --gpus 16 --gpu-memory 80 --tp 2 --ep 8
    gspo-plan --model qwen3-235b-a22b --gpus 128 --gpu-memory 80 --suggest
    gspo-plan --hf-config path/to/config.json --gpus 8 --tp 1 --ep 8
    gspo-plan --model qwen3-30b-a3b --gpus 16 --tp 2 --ep 8 --max-tokens-per-microbatch 16384
    gspo-plan --gpus 32 --config examples/configs/qwen3_30b_a3b_gspo.yaml \
        --parallel.expert_model_parallel_size=16

With ``--config RECIPE`` (alias ``--recipe``) the model, layout, precision, micro-batch size or
token budget, sequence length and routing replay come from the recipe plus
``--section.field=value`` overrides, read exactly as gspo-train reads them; the launch scripts pass
the trainer's own arguments, so the layout checked is the one that runs. ``--print-layout`` (for
scripts) prints ``TP PP EP ETP CP`` as five integers on stdout before the checks, and the report on
stderr.

A recipe with ``rollout.placement: separate`` is planned on the GPUs left after
``rollout.ranks``; each rollout rank's full replica and KV cache are checked on one GPU, and the
host memory of the weight transfer is printed per rank: the busiest trainer rank's main-replica
shard times the ``rollout.max_staleness + 1`` versions it may keep, a rollout rank's one bucket of
``rollout.weight_bucket_mb``.

``--max-response`` reports the longest response the layout can roll out (the KV cache of the
engine's requests, each ``--prompt-length`` + response tokens) and train on (activations and
logits of a microbatch holding such sequences; a packed budget grows to hold one), each phase's
peak separately; ``--responses 8192,16384,32768`` the two peaks at those lengths.

``--max-tokens-per-microbatch N`` (a recipe's ``trainer.max_tokens_per_microbatch``) plans
padding-free training: packed microbatches of at most N tokens, one row each, instead of
``--micro-batch-size`` sequences padded to ``--seq-length``; the report's ``microbatch`` row says
which (``planner.plan_memory`` has the formulae).

Exits non-zero, before anything is submitted, when the layout does not divide the GPUs, heads or
experts (2), does not fit in memory (3), or the recipe does not load or the token budget is below
1 (2); for a layout that does not divide or fit, it then prints layouts that do fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

from gspo_megatron.config.model import MODEL_PRESETS, model_config_from_preset
from gspo_megatron.params import count_parameters
from gspo_megatron.planner import (CLUSTER_SIZES, GIB, HEADROOM, MAX_RESPONSE_SEARCHED, Layout,
                                   headroom, longest_response, plan_for_response, plan_memory,
                                   plan_rollout_replica, plan_weight_transfer, smallest_cluster,
                                   suggest_layouts)

MIB = 1024 ** 2

# Flag-mode settings and their defaults. The parser leaves them None so that --config mode can tell
# which were given: there the recipe sets them, and a flag would silently disagree with it.
FLAG_DEFAULTS = dict(tp=1, pp=1, ep=1, etp=None, cp=1, micro_batch_size=1, seq_length=None,
                     fp32=False, no_distributed_optimizer=False, recompute="full",
                     rollout_tokens=0, routing_replay=False, rollout_requests=0,
                     max_tokens_per_microbatch=None, offload="none")
# What changes each of them (and the model flags) in --config mode instead.
RECIPE_OVERRIDES = dict(
    model="--model.preset=NAME", hf_config="the recipe's model section",
    tp="--parallel.tensor_model_parallel_size=N", pp="--parallel.pipeline_model_parallel_size=N",
    ep="--parallel.expert_model_parallel_size=N", etp="--parallel.expert_tensor_parallel_size=N",
    cp="--parallel.context_parallel_size=N", micro_batch_size="--trainer.micro_batch_size=N",
    seq_length="--model.seq_length=N", fp32="--precision.bf16=false",
    no_distributed_optimizer="--optim.use_distributed_optimizer=false",
    recompute="--precision.recompute_granularity=...",
    rollout_tokens="--rollout.prompts_per_step / --rollout.group_size / --rollout.max_new_tokens",
    routing_replay="--routing.replay=r2 or r3",
    rollout_requests="--rollout.max_batch_size=N / --rollout.dynamic_buffer_size_gb=G",
    max_tokens_per_microbatch="--trainer.max_tokens_per_microbatch=N",
    offload="--trainer.offload=...")


def format_count(n: int) -> str:
    """Three significant digits with a K/M/B/T suffix: 30532122624 -> '30.5B', 140160 -> '140K'."""
    if n < 1000:
        return str(n)
    for scale, suffix in ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        text = f"{n / scale:.3g}"
        if float(text) < 1000 or suffix == "T":  # 999,999 is '1M', not '1e+03K'
            return text + suffix


def parameter_line(name: str, model) -> str:
    """``qwen3-30b-a3b: 30.5B parameters, 3.35B active per token`` (top-k experts per token)."""
    c = count_parameters(model)
    return f"{name}: {format_count(c.total)} parameters, {format_count(c.active)} active per token"


def table(plan) -> str:
    rows = [("parameters / GPU", f"{plan.params_per_gpu:,} (dense {plan.dense_params_per_gpu:,}, "
                                 f"experts {plan.expert_params_per_gpu:,})"),
            ("microbatch", plan.describe_microbatch()),
            ("weights", plan.weights), ("gradients (fp32)", plan.grads),
            ("optimizer (fp32 master + Adam)", plan.optimizer),
            ("activations (estimate)", plan.activations), ("log-prob logits", plan.logits),
            ("rollout KV cache (paged)" + (", held in training" if plan.kv_cache_in_training
                                           else ""), plan.kv_cache)]
    if plan.offload != "none":
        rows.append((f"offloaded ({plan.offload})", plan.offloaded))
    rows += [("training peak", plan.training_peak), ("rollout peak", plan.rollout_peak),
            ("total (larger peak)", plan.total)]
    lines = [f"layout {plan.layout.describe()} DP{plan.dp} on {plan.num_gpus} GPUs"]
    for name, value in rows:
        lines.append(f"  {name:32s} {value if isinstance(value, str) else f'{value / GIB:8.2f} GiB'}")
    lines += route_lines(plan)
    return "\n".join(lines)


def route_lines(plan) -> list[str]:
    """Host memory of routing replay (R2/R3), outside the per-GPU total: the routes of a token
    (whole model) and one copy of a rank's rollout batch (R2 keeps one, R3 up to four)."""
    if not plan.route_bytes_per_token:
        return []
    state = "on" if plan.routing_replay_on else "off"
    lines = [f"  {'routes per token (host, R2/R3)':32s} {plan.route_bytes_per_token:8,} B "
             f"(routing replay {state})"]
    if plan.rollout_tokens:
        lines.append(f"  {'routes of a rollout batch':32s} {plan.routing_replay / MIB:8.2f} MiB per "
                     f"rank per copy ({plan.rollout_tokens:,} tokens; host)")
    return lines


def from_flags(args):
    """(name, ModelConfig, Layout, plan_memory kwargs) from --model / --hf-config and the flags."""
    for key, default in FLAG_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.hf_config:
        from gspo_megatron.hf.config import model_config_from_hf

        name, model = args.hf_config, model_config_from_hf(args.hf_config)
    else:
        name = args.model or "qwen3-30b-a3b"
        if name not in MODEL_PRESETS:
            raise SystemExit(f"plan: unknown model {name!r}; presets: {', '.join(sorted(MODEL_PRESETS))}")
        model = model_config_from_preset(name)
    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp)
    kwargs = dict(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                  bf16=not args.fp32, distributed_optimizer=not args.no_distributed_optimizer,
                  recompute=None if args.recompute == "none" else args.recompute,
                  rollout_tokens=args.rollout_tokens, routing_replay=args.routing_replay,
                  rollout_requests=args.rollout_requests,
                  max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                  offload=args.offload)
    return name, model, layout, kwargs


def from_recipe(args, overrides: list[str]):
    """The same four from a recipe and gspo-train's ``--section.field=value`` overrides."""
    from gspo_megatron.config import token_budget
    from gspo_megatron.config.loader import load_config, parse_cli

    given = [k for k in RECIPE_OVERRIDES if getattr(args, k) is not None]
    if given:
        raise SystemExit("plan: with --config the recipe sets " + ", ".join(
            f"--{k.replace('_', '-')} (override: {RECIPE_OVERRIDES[k]})" for k in given))
    path, overrides = parse_cli(["--config", args.config, *overrides])
    cfg = load_config(path, overrides)
    p, r = cfg.parallel, cfg.rollout
    layout = Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                    ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                    cp=p.context_parallel_size)
    kwargs = dict(micro_batch_size=cfg.trainer.micro_batch_size, seq_length=cfg.model.seq_length,
                  max_tokens_per_microbatch=token_budget(cfg),
                  bf16=cfg.precision.bf16, distributed_optimizer=cfg.optim.use_distributed_optimizer,
                  recompute=cfg.precision.recompute_granularity,
                  # Routes recorded for one rollout batch per DP rank: prompts x G sequences of at
                  # most max_prompt_length + max_new_tokens tokens (an upper bound: responses stop
                  # at EOS, the batch is padded to its longest).
                  rollout_tokens=(r.prompts_per_step * r.group_size
                                  * (cfg.data.max_prompt_length + r.max_new_tokens)),
                  routing_replay=cfg.routing.replay != "none",
                  # The KV cache exists during rollouts only (released for the training passes).
                  kv_cache_bytes=(None if r.dynamic_buffer_size_gb is None or r.engine == "static"
                                  else int(r.dynamic_buffer_size_gb * GIB)),
                  rollout_requests=0 if r.engine == "static" else r.max_batch_size,
                  # ... unless the engine holds partial rollouts' requests through training
                  # (colocated: with placement separate the rollout GPUs hold them)
                  keep_kv=(r.partial_rollouts and r.partial_keep_kv
                           and r.placement != "separate"),
                  prompt_length=cfg.data.max_prompt_length,
                  offload=cfg.trainer.offload,
                  kv_cache_dtype=r.kv_cache_dtype,
                  rollout_ranks=r.ranks if r.placement == "separate" else 0,
                  transfer=(r.max_staleness, r.weight_bucket_bytes()),
                  decode=r,
                  accept_for=functools.partial(recipe_accepts, cfg),
                  layout_check=functools.partial(recipe_layout_errors, cfg))
    return cfg.model.preset, cfg.model, layout, kwargs


def recipe_layout_errors(cfg, trainer_gpus: int, layout: Layout) -> list[str]:
    """gspo-train's objections to ``layout`` for ``cfg`` on ``trainer_gpus`` training GPUs
    (:func:`~gspo_megatron.config.validation.layout_errors` with the layout swapped in)."""
    from gspo_megatron.config.validation import layout_errors

    world = trainer_gpus + (cfg.rollout.ranks if cfg.rollout.placement == "separate" else 0)
    parallel = dataclasses.replace(
        cfg.parallel, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, context_parallel_size=layout.cp,
        sequence_parallel=cfg.parallel.sequence_parallel or layout.tp > 1)
    return layout_errors(dataclasses.replace(cfg, parallel=parallel), world)[1]


def recipe_accepts(cfg, trainer_gpus: int):
    """``accept(layout)`` for the planner: no :func:`recipe_layout_errors`; what
    ``gspo-plan --config`` suggests is what ``gspo-train`` accepts."""
    return lambda layout: not recipe_layout_errors(cfg, trainer_gpus, layout)


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: arguments argparse does not know are recipe overrides, never prefixes.
    ap = argparse.ArgumentParser(prog="gspo-plan", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset name (default qwen3-30b-a3b)")
    ap.add_argument("--hf-config", help="a Hugging Face Qwen3-MoE config.json instead of a preset")
    ap.add_argument("--config", "--recipe", dest="config", metavar="RECIPE",
                    help="a gspo-train recipe; --section.field=value overrides may follow")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--ep", type=int)
    ap.add_argument("--etp", type=int, help="expert tensor parallel (default: TP)")
    ap.add_argument("--cp", type=int)
    ap.add_argument("--micro-batch-size", type=int)
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--fp32", action="store_true", default=None, help="fp32 weights (CPU runs)")
    ap.add_argument("--no-distributed-optimizer", action="store_true", default=None)
    ap.add_argument("--recompute", choices=["full", "selective", "none"], help="default: full")
    ap.add_argument("--rollout-tokens", type=int, help="tokens per rollout batch per rank (routes kept on the host for R2/R3)")
    ap.add_argument("--routing-replay", action="store_true", default=None)
    ap.add_argument("--rollout-requests", type=int,
                    help="requests the rollout engine decodes at once: its paged KV cache holds "
                         "that many of --seq-length tokens (the rollout peak; default 0: none)")
    ap.add_argument("--max-tokens-per-microbatch", type=int, metavar="N",
                    help="packed (padding-free) microbatches of at most N tokens, one row each "
                         "(trainer.max_tokens_per_microbatch); default: --micro-batch-size "
                         "sequences padded to --seq-length")
    ap.add_argument("--offload", choices=["none", "optimizer", "optimizer+grads", "all"],
                    help="trainer.offload: training state moved to host memory while rolling "
                         "out (default none)")
    ap.add_argument("--max-response", action="store_true",
                    help="the longest response this layout can roll out and train on (each "
                         "phase's limit and peak), sequences of --prompt-length + response")
    ap.add_argument("--responses", metavar="R1,R2,...",
                    help="training and rollout peaks at these response lengths, e.g. "
                         "8192,16384,32768")
    ap.add_argument("--prompt-length", type=int, metavar="P",
                    help="prompt tokens for --max-response / --responses (default: the recipe's "
                         "data.max_prompt_length, else 1024)")
    ap.add_argument("--suggest", action="store_true", help="list layouts that fit instead")
    ap.add_argument("--print-layout", action="store_true",
                    help="print 'TP PP EP ETP CP' on stdout before the checks; report on stderr")
    return ap


# What from_flags / from_recipe return beside plan_memory's arguments, with their defaults.
SIDE_KEYS = {"prompt_length": None, "rollout_ranks": 0, "transfer": None, "decode": None,
             "accept_for": None, "layout_check": None}


def split_plan_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """``(plan_memory's keyword arguments, the rest)`` of a reading of the flags or a recipe
    (:data:`SIDE_KEYS`: prompt length, separate rollout ranks, weight transfer, the decode
    section, the layout rule's callables)."""
    plan = {k: v for k, v in kwargs.items() if k not in SIDE_KEYS}
    return plan, {k: kwargs.get(k, default) for k, default in SIDE_KEYS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    if args.max_tokens_per_microbatch is not None and args.max_tokens_per_microbatch < 1:
        print(f"plan: --max-tokens-per-microbatch must be a positive number of tokens, got "
              f"{args.max_tokens_per_microbatch}", file=sys.stderr)
        return 2
    if args.config is None:
        if extra:
            ap.error(f"unrecognized arguments: {' '.join(extra)} (overrides need --config RECIPE)")
        name, model, layout, kwargs = from_flags(args)
    else:
        from gspo_megatron.config.loader import ConfigError

        try:
            name, model, layout, kwargs = from_recipe(args, extra)
        except ConfigError as exc:
            print(f"plan: {exc}", file=sys.stderr)
            return 2
    kwargs, side = split_plan_kwargs(kwargs)
    prompt_length, rollout_ranks, transfer = (side["prompt_length"], side["rollout_ranks"],
                                              side["transfer"])
    decode = side["decode"]  # the recipe's rollout section (the fast decoder's peak)
    accept_for, layout_check = side["accept_for"], side["layout_check"]
    if args.prompt_length is not None:
        prompt_length = args.prompt_length
    prompt_length = 1024 if prompt_length is None else prompt_length
    responses = []
    if args.responses:
        try:
            responses = [int(x) for x in args.responses.split(",")]
        except ValueError:
            responses = [0]
        if any(r < 1 for r in responses):
            print(f"plan: --responses must be positive token counts separated by commas, got "
                  f"{args.responses!r}", file=sys.stderr)
            return 2
    if prompt_length < 1:
        print(f"plan: --prompt-length must be at least 1, got {prompt_length}", file=sys.stderr)
        return 2
    out = sys.stdout
    if args.print_layout:
        # Printed before the checks, so a caller that overrides the verdict still learns the layout.
        print(layout.tp, layout.pp, layout.ep, layout.etp, layout.cp, flush=True)
        out = sys.stderr
    print(parameter_line(name, model), file=out)
    gpus = args.gpus - rollout_ranks  # rollout.placement: separate: the trainer's GPUs
    if rollout_ranks:
        if gpus < 1:
            print(f"plan: rollout.ranks={rollout_ranks} with rollout.placement='separate' leaves "
                  f"no GPU to train on (--gpus {args.gpus})", file=sys.stderr)
            return 2
        print(f"rollout.placement separate: {gpus} trainer GPUs (below) + {rollout_ranks} rollout "
              f"GPUs", file=out)
        args.gpus = gpus
    accept = accept_for(args.gpus) if accept_for is not None else None
    if args.suggest:
        plans = suggest_layouts(model, args.gpus, args.gpu_memory, accept=accept, **kwargs)
        if not plans:
            print(f"plan: no layout of {args.gpus} GPUs fits in {args.gpu_memory} GiB", file=sys.stderr)
            _print_smallest_cluster(model, args, kwargs, accept_for, None, sys.stderr)
            return 1
        for plan in plans:
            print(table(plan), file=out)
            print(f"  {'headroom':32s} {_headroom_text(plan, args.gpu_memory)}", file=out)
        return 0
    if args.max_response or responses:
        try:
            return _response_report(model, layout, args, kwargs, prompt_length, responses, out)
        except ValueError as exc:
            print(f"plan: invalid layout {layout.describe()}: {exc}", file=sys.stderr)
            return 2
    problems = layout_check(args.gpus, layout) if layout_check is not None else []
    try:
        plan = plan_memory(model, layout, args.gpus, **kwargs)
        if problems:
            raise ValueError("; ".join(problems))
    except ValueError as exc:
        print(f"plan: invalid layout {layout.describe()}: {exc}", file=sys.stderr)
        _print_suggestions(model, args, kwargs, accept)
        _print_smallest_cluster(model, args, kwargs, accept_for, layout, sys.stderr)
        return 2
    print(table(plan), file=out)
    if decode is not None:
        _decode_report(model, layout, decode, plan, args, out)
    if plan.total > args.gpu_memory * GIB:
        print(f"plan: does not fit: {plan.total / GIB:.1f} GiB > {args.gpu_memory} GiB per GPU",
              file=sys.stderr)
        _print_suggestions(model, args, kwargs, accept)
        _print_smallest_cluster(model, args, kwargs, accept_for, layout, sys.stderr)
        return 3
    if not rollout_ranks:
        print(f"plan: fits: {_headroom_text(plan, args.gpu_memory)}", file=out)
        return 0
    return _rollout_ranks_report(model, plan, rollout_ranks, args, kwargs, out, *transfer)


def _decode_report(model, layout, rollout, plan, args, out) -> None:
    """The fast decoder's memory per phase (:mod:`gspo_megatron.decode_plan`), after the table."""
    from gspo_megatron.decode_plan import decode_lines, recipe_decode_peak

    peak = recipe_decode_peak(model, layout, rollout, args.gpu_memory * GIB - plan.rollout_peak)
    if peak is not None:
        print("\n".join(decode_lines(peak)), file=out)
        print(f"  {'rollout peak with the decoder':32s} {(plan.rollout_peak + peak.peak) / GIB:8.2f} "
              f"GiB", file=out)


def _rollout_ranks_report(model, plan, rollout_ranks: int, args, kwargs, out,
                          max_staleness: int, bucket_bytes: int) -> int:
    """``rollout.placement: separate`` (one rollout rank per trainer data-parallel rank: the
    trainer's layout check, :func:`recipe_layout_errors`, refused others): each a full replica
    on one GPU that must fit with its KV cache (3 when not); the host memory of the weight
    transfer on each side."""
    replica = plan_rollout_replica(model, bf16=kwargs["bf16"], seq_length=kwargs["seq_length"],
                                   kv_cache_bytes=kwargs.get("kv_cache_bytes"),
                                   rollout_requests=kwargs["rollout_requests"],
                                   kv_cache_dtype=kwargs.get("kv_cache_dtype", "auto"))
    print(f"rollout rank (x{rollout_ranks}, one full replica on 1 GPU, frozen: no gradients, no "
          f"optimizer)", file=out)
    for label, value in (("weights", replica.weights), ("rollout KV cache (paged)", replica.kv_cache),
                         ("rollout peak", replica.peak)):
        print(f"  {label:32s} {value / GIB:8.2f} GiB", file=out)
    moved = plan_weight_transfer(plan, max_staleness, bucket_bytes)
    print(f"weight transfer, host memory per rank (rollout.max_staleness {max_staleness}: up to "
          f"{moved.pending} versions pending; buckets of {bucket_bytes / MIB:g} MiB)", file=out)
    print(f"  {'trainer rank (busiest)':32s} {moved.trainer / GIB:8.2f} GiB ({moved.pending} x "
          f"its main-replica shard, {moved.shard / GIB:.2f} GiB; pinned on CUDA)", file=out)
    print(f"  {'rollout rank':32s} {moved.rollout / GIB:8.2f} GiB (one bucket, at most)", file=out)
    if replica.peak > args.gpu_memory * GIB:
        print(f"plan: a rollout rank does not fit: {replica.peak / GIB:.1f} GiB > "
              f"{args.gpu_memory} GiB per GPU (rollout.placement: separate holds the whole model "
              f"on each rollout GPU; lower rollout.max_batch_size / dynamic_buffer_size_gb, or "
              f"use rollout.placement: colocated)", file=sys.stderr)
        return 3
    return 0


def _response_report(model, layout, args, kwargs, prompt_length: int, responses: list[int],
                     out) -> int:
    """``--responses``: each length's training and rollout peaks; ``--max-response``: the longest
    response each phase holds. Exit 3 when not even a one-token response fits."""
    memory = args.gpu_memory * GIB
    print(f"layout {layout.describe()} on {args.gpus} GPUs of {args.gpu_memory:g} GiB, prompts of "
          f"{prompt_length:,} tokens", file=out)
    for response in responses:
        plan = plan_for_response(model, layout, args.gpus, response, prompt_length, **kwargs)
        verdict = "fits" if plan.total <= memory else "does not fit"
        print(f"  response {response:>9,}: training peak {plan.training_peak / GIB:7.2f} GiB, "
              f"rollout peak {plan.rollout_peak / GIB:7.2f} GiB ({plan.describe_microbatch()}): "
              f"{verdict}", file=out)
    if not args.max_response:
        return 0
    limit = longest_response(model, layout, args.gpus, memory, prompt_length, **kwargs)
    for phase, tokens, plan in (("training", limit.training, limit.training_plan),
                                ("rollout", limit.rollout, limit.rollout_plan)):
        peak = (f"{(plan.training_peak if phase == 'training' else plan.rollout_peak) / GIB:.2f} "
                f"GiB peak" if plan else "nothing fits")
        cap = "+" if tokens == MAX_RESPONSE_SEARCHED else ""
        print(f"  longest response, {phase:8s} {tokens:>9,}{cap} tokens ({peak})", file=out)
    print(f"  longest response, both     {limit.both:>9,} tokens", file=out)
    return 0 if limit.both else 3


def _headroom_text(plan, gpu_memory: float) -> str:
    """``74.8 GiB peak (training) of 80 GiB per GPU, 5.2 GiB (6 %) free; below the 10 %
    headroom``: the verdict's figures."""
    phase = "training" if plan.training_peak >= plan.rollout_peak else "rollout"
    free = gpu_memory * GIB - plan.total
    share = headroom(plan, gpu_memory)
    text = (f"{plan.total / GIB:.1f} GiB peak ({phase}) of {gpu_memory:g} GiB per GPU, "
            f"{free / GIB:.1f} GiB ({share:.0%}) free")
    if share < HEADROOM:
        text += f"; below the {HEADROOM:.0%} headroom a plan should leave"
    return text


def _print_suggestions(model, args, kwargs, accept=None) -> None:
    plans = suggest_layouts(model, args.gpus, args.gpu_memory, limit=3, accept=accept, **kwargs)
    if plans:
        print("layouts that fit (each passes gspo-train's checks):", file=sys.stderr)
        for p in plans:
            print(f"  {p.layout.describe()} DP{p.dp}: {_headroom_text(p, args.gpu_memory)}",
                  file=sys.stderr)


def _print_smallest_cluster(model, args, kwargs, accept_for, layout, out) -> None:
    """The fewest GPUs the recipe's layout fits on (and leaves the headroom on), then the
    fewest with any layout the trainer accepts when that is fewer (``gspo-plan --config``)."""
    if accept_for is None:
        return
    shown = None
    for what, fixed in (("as shipped", layout), ("any layout", None)):
        if what == "as shipped" and fixed is None:
            continue
        plans = [smallest_cluster(model, args.gpu_memory, layout=fixed, accept_for=accept_for,
                                  min_headroom=h, **kwargs) for h in (0.0, HEADROOM)]
        key = tuple((p.num_gpus, p.layout.describe()) if p else None for p in plans)
        if key == shown:
            continue
        shown = key
        first, roomy = plans
        if first is None:
            print(f"smallest cluster ({what}): none up to {CLUSTER_SIZES[-1]} GPUs of "
                  f"{args.gpu_memory:g} GiB", file=out)
            continue
        text = (f"smallest cluster ({what}): {first.num_gpus} GPUs, {first.layout.describe()} "
                f"DP{first.dp}: {_headroom_text(first, args.gpu_memory)}")
        if roomy is not None and roomy is not first and roomy.num_gpus != first.num_gpus:
            text += (f"; with the {HEADROOM:.0%} headroom: {roomy.num_gpus} GPUs, "
                     f"{roomy.layout.describe()} DP{roomy.dp} ({headroom(roomy, args.gpu_memory):.0%} free)")
        print(text, file=out)


if __name__ == "__main__":
    sys.exit(main())
