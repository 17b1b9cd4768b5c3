"""Per-GPU memory of a parallel layout, before anything is launched.

Counts are exact for the parameters (they follow how Megatron-Core shards each tensor: TP splits the
attention, dense MLP, embedding and LM head; EP x ETP split the experts; norms and routers are
replicated; PP splits the layers, with the embedding on the first stage and the head on the last).
Activations are an estimate (Korthikanti et al. 2022, "Reducing Activation Recomputation", with the
MoE dispatch added); the estimate is labelled as such in the output.

Bytes per parameter, Megatron's mixed precision with ``grad_reduce_in_fp32``:
    weights  2 (bf16) or 4 (fp32)
    grads    4 (fp32 main_grad buffer)
    optimizer 12 (fp32 master copy + Adam m and v), divided by the data-parallel size with the
             distributed optimizer (ZeRO-1)

Activations and log-prob logits are those of one microbatch. Padded (the default): ``b =
micro_batch_size`` sequences, each right-padded to ``s = seq_length`` tokens at worst, so ``s * b``
tokens and an ``s x s`` attention-score matrix per sequence. Packed (``max_tokens_per_microbatch =
T``, Megatron's ``thd``): one row of at most ``T`` tokens (tail pad included) holding whole
sequences of at most ``s`` tokens each; see :func:`plan_memory`.

Routing replay (R2/R3) keeps the routes of a rollout batch in host memory (``RouteStore``: expert
ids on the CPU, 1 byte each up to 256 experts, 2 beyond): :func:`route_bytes_per_token` per token
for the whole model, and :attr:`MemoryPlan.routing_replay` for one copy of a rank's rollout batch
(its pipeline stage's MoE layers, its sequence-parallel shard of the positions). R2 keeps one copy
(the old-policy pass's); R3 up to four during a step (the rollout engine's per sample, not
sequence-sharded, and the aligned store, the routes replayed and the routers' natural choice).
Host memory, so not part of the per-GPU :attr:`MemoryPlan.total`.

Under ``rollout.placement: separate`` the weights go to the rollout ranks after every optimizer
step from host memory (:mod:`gspo_megatron.rollouts.weight_channel`): each trainer rank keeps its
main-replica shard for each version not yet received (at most ``max_staleness + 1``), each
rollout rank one bucket (:func:`plan_weight_transfer`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from gspo_megatron.config.model import ModelConfig, ParallelConfig
from gspo_megatron.config.schema import OFFLOAD_PARTS
from gspo_megatron.config.validation import parallel_layout_errors
from gspo_megatron.kv_budget import kv_budget_bytes, kv_bytes_per_token, kv_element_bytes
from gspo_megatron.params import count_parameters

GIB = 1024 ** 3

HEADROOM = 0.1
"""The share of a GPU's memory a plan should leave free (allocator fragmentation, NCCL and CUDA
context, the estimate's error: a peak measured 1.086x the plan on an H200): a layout above it
but within the memory is reported as fitting, with its headroom stated."""


@dataclass
class Layout:
    """A parallel layout on ``num_gpus`` GPUs (data parallel is what is left)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor parallel; None = TP (Megatron's default)."""
    cp: int = 1

    def __post_init__(self):
        if self.etp is None:
            self.etp = self.tp

    def describe(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} ETP{self.etp} CP{self.cp}"


@dataclass
class MemoryPlan:
    """Per-GPU memory of the busiest pipeline stage, in bytes, and the parameters behind it."""

    layout: Layout
    num_gpus: int
    dp: int
    params_per_gpu: int
    """Parameters held by the busiest rank (dense part + its share of experts)."""
    dense_params_per_gpu: int
    expert_params_per_gpu: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    """Estimate for one microbatch in flight per pipeline stage (x PP for 1F1B warm-up)."""
    routing_replay: int
    """Host bytes of one copy of a rollout batch's routes on this rank (R2/R3; not in ``total``):
    ``rollout_tokens`` x this stage's MoE layers x top-k x bytes per id, over TP (sequence
    parallel shards the positions)."""
    logits: int
    """fp32 chunk of the log-prob kernel plus the bf16 logits of one microbatch."""
    route_bytes_per_token: int = 0
    """Host bytes of one token's routes, whole model (:func:`route_bytes_per_token`)."""
    rollout_tokens: int = 0
    """Tokens of one rollout batch on this rank (the routes of :attr:`routing_replay`)."""
    routing_replay_on: bool = False
    """Whether routes are kept at all (``routing.replay`` r2 or r3)."""
    kv_cache: int = 0
    """The rollout engine's paged KV cache on this GPU (``rollout.dynamic_buffer_size_gb``, or
    ``max_batch_size`` requests of ``seq_length`` tokens; :mod:`gspo_megatron.kv_budget`)."""
    kv_cache_in_training: bool = False
    """The KV cache stays allocated through training (``rollout.partial_keep_kv``: the engine
    holds the requests a partial rollout carried over)."""
    micro_batch_size: int = 1
    """Sequences per padded microbatch (not used when packing)."""
    seq_length: int = 0
    """Longest sequence ``s``: a padded microbatch's row length, a packed sequence's bound."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of a packed microbatch (``trainer.max_tokens_per_microbatch``); None: padded
    microbatches of ``micro_batch_size`` x ``seq_length``."""
    offload: str = "none"
    """``trainer.offload``: what of :attr:`state` leaves the GPU while this rank rolls out."""
    offloaded: int = 0
    """Bytes of :attr:`state` in host memory during rollouts (``trainer.offload``: Adam's
    moments, 8 of the optimizer's 12 bytes a parameter; the gradients; with ``all`` the fp32
    main copy, the other 4, under bf16). Back on the GPU for the training passes."""

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of one microbatch, padding included: the budget when packing, else ``s * b``."""
        if self.max_tokens_per_microbatch is not None:
            return self.max_tokens_per_microbatch
        return self.seq_length * self.micro_batch_size

    def describe_microbatch(self) -> str:
        """``2 x 5120 tokens, padded`` or ``16,384 tokens, packed (sequences <= 5,120)``."""
        if self.max_tokens_per_microbatch is None:
            return f"{self.micro_batch_size} x {self.seq_length:,} tokens, padded"
        return (f"{self.max_tokens_per_microbatch:,} tokens, packed "
                f"(sequences <= {self.seq_length:,})")

    @property
    def state(self) -> int:
        """Bytes held through the whole run: weights, gradient buffers, optimizer states."""
        return self.weights + self.grads + self.optimizer

    @property
    def training_peak(self) -> int:
        """Old-log-prob pass and updates: the state plus activations and log-prob logits (the KV
        cache is released meanwhile, unless :attr:`kv_cache_in_training`)."""
        held = self.kv_cache if self.kv_cache_in_training else 0
        return self.state + self.activations + self.logits + held

    @property
    def rollout_state(self) -> int:
        """What of :attr:`state` stays on the GPU during rollouts (all of it without
        ``trainer.offload``)."""
        return self.state - self.offloaded

    @property
    def rollout_peak(self) -> int:
        """Rollout: the state left on the GPU plus the KV cache (training activations are gone
        by then)."""
        return self.rollout_state + self.kv_cache

    @property
    def total(self) -> int:
        """Per-GPU peak: the larger of the two phases (the routes of :attr:`routing_replay` live on
        the host)."""
        return max(self.training_peak, self.rollout_peak)


def route_id_bytes(num_experts: int) -> int:
    """Bytes per stored expert id (``routing.stats.route_dtype``): uint8 up to 256 experts,
    uint16 up to 65,536, else int32."""
    return 1 if num_experts <= 256 else 2 if num_experts <= 65536 else 4


def route_bytes_per_token(model: ModelConfig) -> int:
    """Host bytes of one token's routes for the whole model: top-k ids per MoE layer
    (Qwen3-30B-A3B: 8 x 1 B x 48 layers = 384 B)."""
    return model.moe_router_topk * route_id_bytes(model.num_moe_experts) * sum(model.layer_is_moe())


def params_per_rank(model: ModelConfig, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of pipeline ``stage`` under ``layout`` (exact)."""
    c = count_parameters(model)
    h, d = model.hidden_size, model.head_dim()
    q, kv = model.num_attention_heads, model.num_query_groups
    layers_per_stage = model.num_layers // layout.pp
    layer_ids = range(stage * layers_per_stage, (stage + 1) * layers_per_stage)
    is_moe = model.layer_is_moe()
    dense = 0
    expert = 0
    for i in layer_ids:
        dense += (h * (q + 2 * kv) * d + q * d * h) // layout.tp + 2 * d + 2 * h  # attn + norms
        if is_moe[i]:
            dense += model.num_moe_experts * h  # router, replicated
            expert += (model.num_moe_experts // layout.ep) * 3 * h * model.moe_ffn_hidden_size // layout.etp
        else:
            dense += 3 * h * model.ffn_hidden_size // layout.tp
    if stage == 0:
        dense += c.embedding // layout.tp
    if stage == layout.pp - 1:
        dense += c.output_layer // layout.tp + h  # LM head + final norm
    return dense, expert


def plan_memory(model: ModelConfig, layout: Layout, num_gpus: int, *, micro_batch_size: int = 1,
                seq_length: int | None = None, bf16: bool = True, distributed_optimizer: bool = True,
                recompute: str | None = "full", rollout_tokens: int = 0,
                routing_replay: bool = False, kv_cache_bytes: int | None = None,
                rollout_requests: int = 0, keep_kv: bool = False,
                max_tokens_per_microbatch: int | None = None,
                offload: str = "none", kv_cache_dtype: str = "auto") -> MemoryPlan:
    """Memory of the busiest rank. Raises ``ValueError`` naming the field if the layout breaks
    the trainer's rule (:func:`~gspo_megatron.config.validation.parallel_layout_errors`: the
    same message) or ``max_tokens_per_microbatch`` is below 1.

    ``offload`` (``trainer.offload``): the state moved to host memory during rollouts
    (:attr:`MemoryPlan.offloaded`).

    The rollout's KV cache: ``kv_cache_bytes`` if given, else ``rollout_requests`` requests of
    ``seq_length`` tokens in paged blocks (0 requests: none); ``keep_kv``: it stays allocated
    through training too (``rollout.partial_keep_kv``); ``kv_cache_dtype``
    (``rollout.kv_cache_dtype``): ``fp8`` counts 1 byte an element and a 4-byte scale per token
    and head.

    One microbatch's activations and logits, with ``s = seq_length``, ``b = micro_batch_size``,
    ``h`` the hidden size, ``a`` the attention heads, ``k`` the router's top-k, ``f`` the expert FFN
    size, ``V`` the vocabulary shard (over TP) and ``N`` the tokens of the microbatch (padding
    included): ``N = s * b`` padded, ``N = T = max_tokens_per_microbatch`` packed (one row of
    whole sequences, tail pad included; the trainer's packer never exceeds ``T``).

    - per layer, linear in the tokens: ``34 h`` bytes a token (Korthikanti et al.'s 11 h for
      attention, 19 h for the MLP, 4 h for the two norms) over TP x CP (sequence and context
      parallel shard the positions), and the MoE dispatch, ``k (2 h + 6 f)`` bytes a token over
      CP x ETP (the ``k`` routed copies of each token and their expert-FFN intermediates);
    - per layer, the attention scores and softmax: ``5 a`` bytes per query-key pair over TP x CP.
      Padded, each of the ``b`` rows is an ``s x s`` matrix: ``s * s * b`` pairs. Packed, the
      ``thd`` kernel keeps sequences apart, so the pairs are ``sum_i len_i^2`` over the row's
      sequences; with ``len_i <= min(s, T)`` and ``sum_i len_i <= T`` this is at most
      ``max_i len_i * sum_i len_i <= T * min(s, T)`` (reached when ``s`` divides ``T``: ``T / s``
      sequences of ``s`` tokens), the bound used. With ``T = s * b`` every term equals the padded
      one, so a budget of ``s * b`` plans exactly the padded microbatch; a smaller budget costs
      proportionally less (the attention term quadratically once ``T < s``);
    - the log-prob logits: the bf16 logits of the microbatch, ``2 V`` bytes a token over CP, plus
      the fp32 chunk of the log-prob kernel, ``4 V`` bytes for ``min(1024, N)`` tokens.

    Recompute ``full`` keeps each layer's input (``2 h`` bytes a token) and one layer's full set;
    ``selective`` drops the attention scores; 1F1B keeps up to PP microbatches in flight."""
    if max_tokens_per_microbatch is not None and max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be at least 1, got "
                         f"{max_tokens_per_microbatch}")
    parallel = ParallelConfig(tensor_model_parallel_size=layout.tp,
                              pipeline_model_parallel_size=layout.pp,
                              expert_model_parallel_size=layout.ep,
                              expert_tensor_parallel_size=layout.etp,
                              context_parallel_size=layout.cp,
                              sequence_parallel=layout.tp > 1)
    model.validate()
    dp, errors = parallel_layout_errors(parallel, model, num_gpus)
    if errors:
        raise ValueError("; ".join(errors))
    if offload not in OFFLOAD_PARTS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOAD_PARTS)}, got {offload!r}")
    expert_dp = num_gpus // (layout.pp * layout.ep * layout.etp)
    s = seq_length or model.seq_length
    b = micro_batch_size
    h = model.hidden_size
    stages = [params_per_rank(model, layout, st) for st in range(layout.pp)]
    dense, expert = max(stages, key=sum)
    wbytes = 2 if bf16 else 4
    opt_dense = 12 * dense / (dp * layout.cp if distributed_optimizer else 1)
    opt_expert = 12 * expert / (expert_dp if distributed_optimizer else 1)

    # Activations of one layer for one microbatch (bytes), sequence/context sharded. n: the
    # microbatch's tokens; pairs: query-key pairs of its attention scores (see the docstring).
    if max_tokens_per_microbatch is None:
        n, pairs = s * b, s * s * b
    else:
        n = max_tokens_per_microbatch
        pairs = n * min(s, n)  # sum_i len_i^2 <= max_i len_i * sum_i len_i
    tokens = n / (layout.tp * layout.cp)
    attn = tokens * h * 34 + 5 * model.num_attention_heads * pairs / (layout.tp * layout.cp)
    moe = n / layout.cp * model.moe_router_topk * (2 * h + 6 * model.moe_ffn_hidden_size) / layout.etp
    per_layer = attn + moe
    layers = model.num_layers // layout.pp
    if recompute == "full":  # keep each layer's input; recompute one layer at a time
        acts = layers * tokens * h * 2 + per_layer
    elif recompute == "selective":  # attention core recomputed
        acts = layers * (tokens * h * 34 + moe)
    else:
        acts = layers * per_layer
    acts *= layout.pp  # 1F1B keeps up to PP microbatches in flight on the first stage

    # One copy of the rollout batch's routes on this rank, in host memory (whether or not
    # routing_replay is on: it is what turning it on costs); SP shards the positions over TP.
    moe_layers_here = sum(model.layer_is_moe()) // layout.pp
    replay = (rollout_tokens * moe_layers_here * model.moe_router_topk
              * route_id_bytes(model.num_moe_experts) // (layout.tp if parallel.sequence_parallel else 1))
    if kv_cache_bytes is None:
        kv_cache_bytes = kv_budget_bytes(rollout_requests, s, kv_bytes_per_token(
            model.num_layers, model.num_query_groups, model.kv_channels, layout.tp, layout.pp,
            *kv_element_bytes(kv_cache_dtype, wbytes))) if rollout_requests else 0
    vocab_shard = model.padded_vocab_size() // layout.tp
    logits = n / layout.cp * vocab_shard * 2 + min(1024, n) * vocab_shard * 4
    # The optimizer's 12 bytes a parameter: Adam's m and v (8), the fp32 main copy (4), which
    # under fp32 training is the weights themselves (the rollout reads them: never moved).
    grads = int((dense + expert) * 4)
    moves = OFFLOAD_PARTS[offload]
    offloaded = (int((opt_dense + opt_expert) * 8 / 12) * ("optimizer" in moves)
                 + grads * ("grads" in moves)
                 + int((opt_dense + opt_expert) * 4 / 12) * ("main" in moves and bf16))
    return MemoryPlan(
        layout=layout, num_gpus=num_gpus, dp=dp,
        params_per_gpu=dense + expert, dense_params_per_gpu=dense, expert_params_per_gpu=expert,
        weights=int((dense + expert) * wbytes), grads=grads,
        optimizer=int(opt_dense + opt_expert), activations=int(acts),
        routing_replay=int(replay), logits=int(logits),
        route_bytes_per_token=route_bytes_per_token(model), rollout_tokens=int(rollout_tokens),
        routing_replay_on=bool(routing_replay), kv_cache=int(kv_cache_bytes),
        kv_cache_in_training=bool(keep_kv and kv_cache_bytes),
        micro_batch_size=b, seq_length=s, max_tokens_per_microbatch=max_tokens_per_microbatch,
        offload=offload, offloaded=offloaded,
    )


@dataclass
class ReplicaPlan:
    """A rollout rank of ``rollout.placement: separate``: the whole model on one GPU, built frozen
    (no gradient buffer, no optimizer), and the rollout engine's KV cache."""

    weights: int
    kv_cache: int

    @property
    def peak(self) -> int:
        return self.weights + self.kv_cache


def plan_rollout_replica(model: ModelConfig, *, bf16: bool = True, seq_length: int | None = None,
                         kv_cache_bytes: int | None = None,
                         rollout_requests: int = 0, kv_cache_dtype: str = "auto") -> ReplicaPlan:
    """Memory of a rollout rank (``rollout.placement: separate``): one full replica per rank
    (Qwen3-30B-A3B in bf16: 57 GiB of weights), its KV cache as :func:`plan_memory` sizes it."""
    plan = plan_memory(model, Layout(), 1, bf16=bf16, seq_length=seq_length,
                       kv_cache_bytes=kv_cache_bytes, rollout_requests=rollout_requests,
                       kv_cache_dtype=kv_cache_dtype)
    return ReplicaPlan(weights=plan.weights, kv_cache=plan.kv_cache)


@dataclass
class TransferPlan:
    """Host memory per rank while the weights go to the rollout ranks (``rollout.placement:
    separate``; :mod:`gspo_megatron.rollouts.weight_channel`)."""

    shard: int
    """Bytes of the busiest trainer rank's main-replica pieces: the rank of the busiest pipeline
    stage at position 0 of its TP, DP and expert-DP groups holds its TP shard of the attention,
    dense MLPs and embeddings, the norms and routers TP replicates, and its EP x ETP share of
    the experts (:func:`params_per_rank`), in the weights' dtype: :attr:`MemoryPlan.weights`."""
    pending: int
    """Versions a trainer rank keeps at most: ``max_staleness + 1`` (each received before the
    rollout that needs it)."""
    bucket: int
    """``rollout.weight_bucket_mb`` in bytes: the most a rollout rank holds."""

    @property
    def trainer(self) -> int:
        """Host bytes of the busiest trainer rank's snapshots (pinned on CUDA)."""
        return self.shard * self.pending

    @property
    def rollout(self) -> int:
        """Host bytes of a rollout rank's receiving buffer, at most (one bucket)."""
        return self.bucket


def plan_weight_transfer(plan: MemoryPlan, max_staleness: int, bucket_bytes: int
                         ) -> TransferPlan:
    """:class:`TransferPlan` of a trainer layout's ``plan`` (bytes exact for the shard; the
    snapshot adds at most 15 bytes of alignment a piece)."""
    return TransferPlan(shard=plan.weights, pending=max_staleness + 1, bucket=bucket_bytes)


def candidate_layouts(model: ModelConfig, num_gpus: int, gpus_per_node: int = 8,
                      accept: Callable[[Layout], bool] | None = None) -> list[Layout]:
    """Every layout the trainer accepts on ``num_gpus`` GPUs (TP within a node, ETP 1, CP 1):
    :func:`~gspo_megatron.config.validation.parallel_layout_errors` finds nothing, and
    ``accept`` (``gspo-plan --config``: the recipe's own checks of a layout,
    :func:`~gspo_megatron.config.validation.layout_errors`) says yes."""
    powers = [1, 2, 4, 8, 16, 32, 64, 128]
    out = []
    for tp, pp, ep in itertools.product(powers, powers, powers):
        if tp > gpus_per_node:
            continue
        layout = Layout(tp=tp, pp=pp, ep=ep, etp=1)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                  sequence_parallel=tp > 1)
        if parallel_layout_errors(parallel, model, num_gpus)[1]:
            continue
        if accept is not None and not accept(layout):
            continue
        out.append(layout)
    return out


def headroom(plan: MemoryPlan, gpu_memory_gib: float) -> float:
    """The share of the GPU's memory the plan's peak leaves free (negative: it does not fit)."""
    return 1.0 - plan.total / (gpu_memory_gib * GIB)


def suggest_layouts(model: ModelConfig, num_gpus: int, gpu_memory_gib: float, limit: int = 5,
                    accept: Callable[[Layout], bool] | None = None,
                    **plan_kwargs) -> list[MemoryPlan]:
    """Layouts of :func:`candidate_layouts` whose peak fits in ``gpu_memory_gib``: those that
    leave :data:`HEADROOM` free first, then those that fit with less (never dropped: the caller
    states each one's :func:`headroom`); within each, least model parallelism first."""
    fits = []
    for layout in candidate_layouts(model, num_gpus, accept=accept):
        plan = plan_memory(model, layout, num_gpus, **plan_kwargs)
        if plan.total <= gpu_memory_gib * GIB:
            fits.append(plan)
    fits.sort(key=lambda p: (headroom(p, gpu_memory_gib) < HEADROOM,
                             p.layout.tp * p.layout.pp, p.layout.pp, p.total))
    return fits[:limit]


CLUSTER_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""The GPU counts :func:`smallest_cluster` tries."""


def smallest_cluster(model: ModelConfig, gpu_memory_gib: float, layout: Layout | None = None,
                     accept_for: Callable[[int], Callable[[Layout], bool]] | None = None,
                     min_headroom: float = 0.0, **plan_kwargs) -> MemoryPlan | None:
    """The plan on the fewest GPUs of :data:`CLUSTER_SIZES` that fits ``gpu_memory_gib`` and
    leaves at least ``min_headroom`` of it free: with ``layout`` that layout only, else the
    first of :func:`suggest_layouts`. ``accept_for(n)``: the trainer's check of a layout on
    ``n`` GPUs. None: none up to 1,024 GPUs."""
    for gpus in CLUSTER_SIZES:
        accept = accept_for(gpus) if accept_for is not None else None
        if layout is None:
            plans = [p for p in suggest_layouts(model, gpus, gpu_memory_gib, limit=1,
                                                accept=accept, **plan_kwargs)
                     if headroom(p, gpu_memory_gib) >= min_headroom]
            if plans:
                return plans[0]
            continue
        try:
            plan = plan_memory(model, layout, gpus, **plan_kwargs)
        except ValueError:
            continue
        if headroom(plan, gpu_memory_gib) >= min_headroom and (accept is None or accept(layout)):
            return plan
    return None


MAX_RESPONSE_SEARCHED = 1 << 20
"""The longest response :func:`longest_response` tries (1,048,576 tokens)."""


@dataclass
class ResponseLimit:
    """The longest response a layout holds, per phase (:func:`longest_response`)."""

    training: int
    """Longest response (tokens) whose training peak fits; 0: not even one token."""
    rollout: int
    """Longest response whose rollout peak fits (KV cache of the engine's requests)."""
    training_plan: MemoryPlan | None
    """The plan at :attr:`training` (None when 0)."""
    rollout_plan: MemoryPlan | None
    """The plan at :attr:`rollout` (None when 0)."""

    @property
    def both(self) -> int:
        """Longest response that can be rolled out and trained on."""
        return min(self.training, self.rollout)


def plan_for_response(model: ModelConfig, layout: Layout, num_gpus: int, response: int,
                      prompt_length: int, **plan_kwargs) -> MemoryPlan:
    """:func:`plan_memory` with sequences of ``prompt_length + response`` tokens: the padded
    row (or a packed sequence's bound) and each KV-cache request that long; a packed token
    budget below one such sequence grows to hold it (the trainer refuses a smaller one)."""
    s = prompt_length + response
    kwargs = dict(plan_kwargs, seq_length=s)
    if kwargs.get("max_tokens_per_microbatch") is not None:
        kwargs["max_tokens_per_microbatch"] = max(kwargs["max_tokens_per_microbatch"], s)
    return plan_memory(model, layout, num_gpus, **kwargs)


def longest_response(model: ModelConfig, layout: Layout, num_gpus: int, gpu_memory_bytes: float,
                     prompt_length: int, **plan_kwargs) -> ResponseLimit:
    """The longest response (up to :data:`MAX_RESPONSE_SEARCHED`) whose training peak, and whose
    rollout peak, fit ``gpu_memory_bytes`` (:func:`plan_for_response`; both peaks grow with the
    length, so a binary search each). With a fixed KV budget (``kv_cache_bytes``) the rollout
    limit is the longest request that budget holds."""
    def fits(response: int, phase: str) -> bool:
        plan = plan_for_response(model, layout, num_gpus, response, prompt_length, **plan_kwargs)
        if phase == "rollout" and plan_kwargs.get("kv_cache_bytes") is not None:
            per_token = kv_bytes_per_token(model.num_layers, model.num_query_groups,
                                           model.kv_channels, layout.tp, layout.pp,
                                           *kv_element_bytes(
                                               plan_kwargs.get("kv_cache_dtype", "auto"),
                                               2 if plan_kwargs.get("bf16", True) else 4))
            one = kv_budget_bytes(1, prompt_length + response, per_token)
            return one <= plan.kv_cache and plan.rollout_peak <= gpu_memory_bytes
        peak = plan.training_peak if phase == "training" else plan.rollout_peak
        return peak <= gpu_memory_bytes

    limits, plans = {}, {}
    for phase in ("training", "rollout"):
        lo, hi = 0, MAX_RESPONSE_SEARCHED  # fits(lo) holds (0: vacuously), find the largest
        if fits(hi, phase):
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, phase) else (lo, mid)
        limits[phase] = lo
        plans[phase] = (plan_for_response(model, layout, num_gpus, lo, prompt_length, **plan_kwargs)
                        if lo else None)
    return ResponseLimit(limits["training"], limits["rollout"], plans["training"], plans["rollout"])
