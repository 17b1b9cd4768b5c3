"""Log-prob passes and policy updates through Megatron's forward-backward schedules.

Both functions run Megatron's own schedule (``get_forward_backward_func``: no pipelining, or 1F1B
under PP), so microbatching, pipeline P2P, DDP grad sync and ``finalize_model_grads`` are Megatron's.
Log-probs come from vocab-parallel logits (:func:`~gspo_megatron.backends.megatron.logprobs.vocab_parallel_logprobs`)
on the last pipeline stage; what is minimised is an :class:`~gspo_megatron.algorithms.Objective`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import Objective
from gspo_megatron.backends.megatron.logprobs import vocab_parallel_logprobs
from gspo_megatron.distributed import ParallelGroups, all_gather_, all_reduce_, compute_device
from gspo_megatron.layout import ContextShard, PackedRows, in_batch_order, pack_into_microbatches
from gspo_megatron.policy import PolicyBatch


@dataclass
class ScoringConfig:
    """How the trainer turns logits into log-probs."""

    temperature: float = 1.0
    """The rollout's sampling temperature; logits are divided by it before the softmax."""
    vocab_size: int | None = None
    """The tokenizer's real vocabulary; padded vocabulary entries are excluded."""
    logprob_chunk_size: int = 1024
    """Tokens per fp32 chunk in the log-prob kernel (bounds its memory)."""
    batch_invariant: bool = False
    """``precision.batch_invariant``: the log-probs by
    :func:`~.kernels.batch_invariant.token_logprobs` (the rollout sampler's function; TP = 1)."""


@dataclass(frozen=True)
class Microbatching:
    """How a pass cuts a batch into the microbatches the model sees."""

    micro_batch_size: int = 1
    """Sequences per microbatch when not packing (each right-padded to the batch's length)."""
    max_tokens: int | None = None
    """Packing: sequences concatenated (``thd``, no padding between them) into microbatches of at
    most this many tokens (``trainer.max_tokens_per_microbatch``); None: padded microbatches of
    ``micro_batch_size`` sequences."""
    pad_to_multiple_of: int = 1
    """A packed row's length is rounded up to this (TP under sequence parallelism, x 2 CP under
    context parallelism)."""
    segment_multiple: int = 1
    """Each packed sequence's segment is rounded up to this (2 x CP: every context-parallel rank
    holds two chunks of every sequence)."""


def make_microbatches(batch: PolicyBatch, batching: "Microbatching | int",
                      groups: ParallelGroups) -> list[PolicyBatch]:
    """The microbatches of ``batch`` in the order the schedule runs them, each carrying the
    batch rows it holds (``rows``). Padded: consecutive chunks of ``micro_batch_size`` rows.
    Packed: :func:`~gspo_megatron.layout.pack_into_microbatches` bins under the token budget,
    as many on every data-parallel rank (one MAX all-reduce of the count: their expert
    all-to-alls pair up microbatch by microbatch); each microbatch keeps the ``[n, T]`` rows of
    its sequences and its :class:`~gspo_megatron.layout.PackedRows`."""
    if isinstance(batching, int):
        batching = Microbatching(micro_batch_size=batching)
    if batching.max_tokens is None:
        size = batching.micro_batch_size
        chunks = batch.split(size)
        for i, mb in enumerate(chunks):
            mb.rows = torch.arange(i * size, i * size + mb.size)
        return chunks
    if batch.layout is None:
        raise ValueError("packing needs the batch's TokenLayout (make_policy_batch sets it)")
    lengths = batch.layout.lengths.tolist()

    def bins(minimum: int) -> list[list[int]]:
        return pack_into_microbatches(lengths, batching.max_tokens, batching.pad_to_multiple_of,
                                      min_microbatches=minimum,
                                      segment_multiple=batching.segment_multiple)

    plan = bins(1)
    if groups.dp_size > 1:
        count = int(all_reduce_(torch.tensor([len(plan)], dtype=torch.float64,
                                             device=compute_device()),
                                groups.dp_group, op=dist.ReduceOp.MAX))
        if count > len(plan):
            plan = bins(count)
    out = []
    for seqs in plan:
        rows = torch.tensor(seqs, dtype=torch.long)
        mb = batch.select(rows)
        mb.rows = rows
        mb.packing = PackedRows.of(batch.layout.lengths[rows], batching.pad_to_multiple_of,
                                   batching.segment_multiple)
        out.append(mb)
    return out


def shard_for_context(micro: list[PolicyBatch], groups: ParallelGroups) -> list[PolicyBatch]:
    """Under context parallelism, each microbatch cut to this rank's share of its rows, or of its
    packed row (:meth:`PolicyBatch.context_parallel`); unchanged at CP = 1."""
    if groups.cp_size == 1:
        return micro
    shard = ContextShard(groups.cp_rank, groups.cp_size)
    return [mb.context_parallel(shard) for mb in micro]


def packed_seq_params(packing: PackedRows, device: torch.device,
                      context: ContextShard | None = None):
    """Megatron's ``PackedSeqParams`` (``thd``) of a packed microbatch: ``cu_seqlens_*`` the
    whole row's (Megatron and TE cut them per CP rank themselves), ``*_padded`` with the
    segments' pads. Carries ``rope_positions``, ``[S_local]`` each token's position within its
    sequence for this rank's tokens (the local kernel's rotary lookup)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = packing.cu_seqlens().to(device)
    real = cu if packing.segment_multiple == 1 else packing.cu_seqlens_real().to(device)
    longest = packing.max_seqlen()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                             cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    positions = packing.position_ids(device)[0]
    params.rope_positions = (positions if context is None
                             else positions[packing.context_index(context).to(device)])
    return params


def _model_inputs(mb: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(tokens, position_ids, extra kwargs)`` of a microbatch for ``GPTModel.forward``:
    ``[b, T]`` rows, or for a packed microbatch the ``[1, S]`` row (``[1, S / cp]``: this
    context-parallel rank's positions of it) with its ``PackedSeqParams`` and the pads' MoE
    ``padding_mask``."""
    p = mb.packing
    if p is None:
        return mb.tokens, mb.position_ids(), {}
    device = mb.tokens.device
    tokens, positions, pads = p.pack(mb.tokens), p.position_ids(device), p.padding_mask(device)
    if mb.context is not None:
        index = p.context_index(mb.context).to(device)
        tokens, positions = tokens[:, index], positions[:, index]
        pads = pads[:, index] if pads is not None else None
    return tokens, positions, {"packed_seq_params": packed_seq_params(p, device, mb.context),
                               "padding_mask": pads}


def _labels_logprobs(mb: PolicyBatch, logits: torch.Tensor, invariant: bool = False, **kwargs):
    """``vocab_parallel_logprobs`` of the microbatch's labels, as ``[b, T]`` (a packed
    microbatch's ``[1, S]`` values unpacked into its rows; under context parallelism this rank's
    positions, zeros at the others'); ``invariant``: :func:`_invariant_logprobs`."""
    scorer = _invariant_logprobs if invariant else vocab_parallel_logprobs
    p = mb.packing
    if p is None:
        return scorer(logits, mb.labels, **kwargs)
    labels = p.pack(mb.labels)
    if mb.context is not None:
        labels = labels[:, p.context_index(mb.context).to(labels.device)]
    lp, ent = scorer(logits, labels, **kwargs)
    t = mb.seq_length
    unpack = (partial(p.unpack, seq_length=t) if mb.context is None
              else partial(p.unpack_context, shard=mb.context, seq_length=t))
    return unpack(lp), (unpack(ent) if ent is not None else None)


def _invariant_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float,
                        tp_group, vocab_size: int | None, compute_entropy: bool, chunk_size: int):
    """``vocab_parallel_logprobs``' result at TP = 1 by
    :func:`~.kernels.batch_invariant.token_logprobs` (``precision.batch_invariant``):
    ``logits [..., V]``, ``target [...]`` -> ``(logprobs [...], entropy [...] or None)``."""
    del tp_group, chunk_size  # (TP = 1: the config refuses the mode otherwise)
    from gspo_megatron.backends.megatron.kernels.batch_invariant import token_logprobs

    lp, ent = token_logprobs(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                             vocab_size, temperature, compute_entropy)
    return lp.view(target.shape), (ent.view(target.shape) if ent is not None else None)


def _run_schedule(policy_model: list, microbatches: list[PolicyBatch], forward_only: bool,
                  loss_fn: Callable[[PolicyBatch, torch.Tensor], tuple],
                  routing=None) -> list[dict]:
    """Run Megatron's forward(-backward) schedule over ``microbatches``; returns the per-microbatch
    dicts that ``loss_fn`` reported (on the last pipeline stage; empty elsewhere).

    ``routing`` (optional): MoE routing hooks (:mod:`gspo_megatron.routing`), called as
    ``before_forward(i, mb)`` / ``after_forward(i, mb)`` around microbatch ``i``'s model forward
    (forward steps run in microbatch order on every stage, also under 1F1B) and ``finish()`` once
    the schedule is done (also on error)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    counter = iter(range(len(microbatches)))

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        tokens, positions, extra = _model_inputs(mb)
        if routing is None:
            output = model(tokens, positions, attention_mask=None, **extra)
        else:
            i = next(counter)
            routing.before_forward(i, mb)
            output = model(tokens, positions, attention_mask=None, **extra)
            routing.after_forward(i, mb)
        return output, partial(loss_fn, mb)

    packed, context = microbatches[0].packing, microbatches[0].context
    # A packed microbatch is one row of its own length (the pipeline's P2P shapes then vary:
    # ``variable_seq_lengths``, set on the model config when packing under PP). Megatron divides
    # the length by CP itself: the full row's (a padded shard holds T / cp of it).
    seq_length = microbatches[0].seq_length if packed is None else packed.total
    if context is not None and packed is None:
        seq_length *= context.size
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=policy_model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=microbatches[0].size if packed is None else 1,
            decoder_seq_length=seq_length,
            forward_only=forward_only,
        )
    finally:
        if routing is not None:
            routing.finish()


def module_list(model: torch.nn.Module, key: str, pick) -> list:
    """``[x for m in model.modules() for x in pick(m)]``, computed on the first call for ``key``
    and kept in the model's ``__dict__`` (a plain attribute, not a submodule): the module tree
    does not change once the model is built, and the walk costs ~0.1-0.3 ms on the tiny model
    (the rollout's per-call context managers made three of them per generate)."""
    lists = model.__dict__.setdefault("_gspo_module_lists", {})
    if key not in lists:
        lists[key] = [x for m in model.modules() for x in pick(m)]
    return lists[key]


def set_training(policy_model: list, mode: bool) -> None:
    """``chunk.train(mode)`` for every chunk: the ``training`` flag of each of its modules. When
    no module overrides ``nn.Module.train`` (none of Megatron's or ours does) the flag is written
    straight into each module's ``__dict__`` over a module list cached per chunk, which is what
    ``nn.Module.train`` ends up doing, without its recursive ``children()`` walk and the
    ``nn.Module.__setattr__`` checks per module (~0.3 ms per call on the tiny model, twice per
    old-log-prob pass). Both lists come from :func:`module_list` (made once per chunk)."""
    for chunk in policy_model:
        if module_list(chunk, "custom_train", lambda m: [m] if type(m).train
                       is not torch.nn.Module.train else []):
            chunk.train(mode)
        else:
            for m in module_list(chunk, "all", lambda m: [m]):
                m.__dict__["training"] = mode


def _to_device(batch: PolicyBatch, device: torch.device) -> PolicyBatch:
    import dataclasses

    return dataclasses.replace(batch, **{k: v.to(device) for k, v in batch.tensors().items()})


@torch.no_grad()
def compute_logprobs(
    policy_model: list,
    batch: PolicyBatch,
    batching: "Microbatching | int",
    scoring: ScoringConfig,
    groups: ParallelGroups,
    with_entropy: bool = False,
    routing=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Log-probs of ``batch.labels`` under ``policy_model`` (one forward, no grad).

    ``routing``: optional MoE routing hooks (record or replay routes; see :func:`_run_schedule`),
    applied to the microbatches of :func:`make_microbatches` in order.

    Returns ``(logprobs [B, T], entropy [B, T] or None)`` on the last pipeline stage, ``(None, None)``
    on the others (only the last stage computes the loss, so only it needs them).
    """
    set_training(policy_model, False)

    def score(mb: PolicyBatch, logits: torch.Tensor):
        lp, ent = _labels_logprobs(
            mb, logits, scoring.batch_invariant, temperature=scoring.temperature,
            tp_group=groups.tp_group, vocab_size=scoring.vocab_size, compute_entropy=with_entropy,
            chunk_size=scoring.logprob_chunk_size)
        return torch.zeros((), device=logits.device), {"logprobs": lp, "entropy": ent}

    device = next(policy_model[0].parameters()).device
    micro = shard_for_context(
        [_to_device(mb, device) for mb in make_microbatches(batch, batching, groups)], groups)
    try:
        outputs = _run_schedule(policy_model, micro, forward_only=True, loss_fn=score,
                                routing=routing)
    finally:
        set_training(policy_model, True)
    if not groups.is_last_stage:
        return None, None
    rows = [mb.rows for mb in micro]  # packed microbatches hold rows out of the batch's order
    logprobs = _whole_rows(in_batch_order([o["logprobs"] for o in outputs], rows), micro, groups)
    entropy = (_whole_rows(in_batch_order([o["entropy"] for o in outputs], rows), micro, groups)
               if with_entropy else None)
    return logprobs, entropy


def _whole_rows(values: torch.Tensor, micro: list[PolicyBatch], groups: ParallelGroups
                ) -> torch.Tensor:
    """``[B, T]`` float32 on the CPU: a context-parallel rank's ``[B, T / cp]`` shares gathered
    from every CP rank and put back in position order (one all-gather); packed microbatches'
    ``[B, T]`` rows, zeros where another CP rank holds the position, summed over the CP group
    (exact: one rank holds each); as is at CP = 1."""
    context = micro[0].context
    if context is None:
        return values.float().cpu()
    if micro[0].packing is not None:
        return all_reduce_(values.float(), groups.cp_group).cpu()
    return context.unshard(all_gather_(values.float(), groups.cp_group)).cpu()


def run_objective(
    policy_model: list,
    batch: PolicyBatch,
    batching: "Microbatching | int",
    objective: Objective,
    scoring: ScoringConfig,
    groups: ParallelGroups,
    routing=None,
    microbatches: list[PolicyBatch] | None = None,
) -> dict[str, float]:
    """Forward and backward of ``objective`` over one minibatch (grads accumulate in DDP buffers,
    finalised by Megatron; the caller zeroes grads before and steps the optimizer after).

    Normalisation: Megatron's schedule divides each microbatch loss by the number of microbatches M
    and DDP averages grads over the data(-context)-parallel ranks. We want the gradient of
    ``sum over the minibatch / N_global`` instead (``N_global``: the objective's count summed over
    data-parallel ranks), so each microbatch returns ``objective(..., N_global) * M * DP``; the two
    scalings cancel exactly.

    ``routing``: optional MoE routing hooks, e.g. R2 replay of the old policy's routes (see
    :func:`_run_schedule`), applied to the microbatches of :func:`make_microbatches` in order
    (``microbatches``: already made).

    Returns metrics averaged over microbatches and data-parallel ranks (0 keys on non-last stages).
    """
    local = objective.local_count(batch)
    normalizer = float(all_reduce_(local.to(compute_device()), groups.dp_group))
    device = next(policy_model[0].parameters()).device
    if microbatches is None:
        microbatches = make_microbatches(batch, batching, groups)
    micro = shard_for_context([_to_device(mb, device) for mb in microbatches], groups)
    scale = len(micro) * groups.dp_size  # (Megatron's schedule multiplies by CP itself)
    cp_group = groups.cp_group if groups.cp_size > 1 else None

    def loss_fn(mb: PolicyBatch, logits: torch.Tensor):
        lp, ent = _labels_logprobs(
            mb, logits, scoring.batch_invariant, temperature=objective.temperature,
            tp_group=groups.tp_group, vocab_size=scoring.vocab_size,
            compute_entropy=objective.needs_entropy,
            chunk_size=scoring.logprob_chunk_size)
        loss, metrics = objective(lp, ent, mb, normalizer, cp_group=cp_group)
        return loss * scale, metrics

    outputs = _run_schedule(policy_model, micro, forward_only=False, loss_fn=loss_fn,
                            routing=routing)
    return reduce_metrics(outputs, groups)


def reduce_metrics(outputs: list[dict], groups: ParallelGroups) -> dict[str, float]:
    """Mean over microbatches, then over data-parallel ranks; min/max keys keep their extreme.

    ``loss/*`` keys are sums: each microbatch carries its share of the minibatch loss (it was divided
    by the global normaliser), so the minibatch loss is their sum over microbatches and DP ranks.
    """
    if not outputs:
        return {}
    keys = sorted(outputs[0])
    if len(outputs) == 1 and groups.dp_size == 1:
        # One microbatch on one rank: the sum, mean, min and max of a single value are that
        # value exactly, so one stack and one host transfer give every metric (the per-key
        # stack/reduce/float below costs ~25 x 3 dispatches per update on the RL objective).
        values = torch.stack([outputs[0][k].float().reshape(()) for k in keys]).tolist()
        return dict(zip(keys, values))
    out: dict[str, float] = {}
    for key in keys:
        vals = torch.stack([o[key].float().reshape(()) for o in outputs])
        if key.startswith("loss/"):
            v = vals.sum()
        elif key.endswith("min"):
            v = vals.min()
        elif key.endswith("max"):
            v = vals.max()
        else:
            v = vals.mean()
        out[key] = v
    if groups.dp_size > 1:
        for key, v in out.items():
            t = v.clone().double()
            if key.endswith("min") or key.endswith("max"):
                all_reduce_(t, groups.dp_group,
                            dist.ReduceOp.MIN if key.endswith("min") else dist.ReduceOp.MAX)
            else:
                all_reduce_(t, groups.dp_group)
                if not key.startswith("loss/"):
                    t /= groups.dp_size
            out[key] = t
    return {k: float(v) for k, v in out.items()}
