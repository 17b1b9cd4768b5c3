"""Log-prob passes and policy updates through Megatron's forward-backward schedules.

Both functions run Megatron's own schedule (``get_forward_backward_func``: no pipelining, or 1F1B
under PP), so microbatching, pipeline P2P, DDP grad sync and ``finalize_model_grads`` are Megatron's.
Log-probs come from vocab-parallel logits (:func:`gspo_megatron.ops.vocab_parallel_logprobs`) on the
last pipeline stage; the loss is :func:`gspo_megatron.algorithms.policy_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import PolicyLossConfig, policy_loss
from gspo_megatron.ops import vocab_parallel_logprobs
from gspo_megatron.parallel import ParallelGroups
from gspo_megatron.parallel import device as compute_device
from gspo_megatron.training.batch import PolicyBatch
from gspo_megatron.training.faults import maybe_corrupt


@dataclass
class ScoringConfig:
    """How the trainer turns logits into log-probs."""

    temperature: float = 1.0
    """The rollout's sampling temperature; logits are divided by it before the softmax."""
    vocab_size: int | None = None
    """The tokenizer's real vocabulary; padded vocabulary entries are excluded."""
    logprob_chunk_size: int = 1024
    """Tokens per fp32 chunk in the log-prob kernel (bounds its memory)."""


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
        if routing is None:
            output = model(mb.tokens, mb.position_ids(), attention_mask=None)
        else:
            i = next(counter)
            routing.before_forward(i, mb)
            output = model(mb.tokens, mb.position_ids(), attention_mask=None)
            routing.after_forward(i, mb)
        return output, partial(loss_fn, mb)

    seq_length = microbatches[0].seq_length
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=policy_model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=microbatches[0].size,
            decoder_seq_length=seq_length,
            forward_only=forward_only,
        )
    finally:
        if routing is not None:
            routing.finish()


def _to_device(batch: PolicyBatch, device: torch.device) -> PolicyBatch:
    import dataclasses

    return dataclasses.replace(batch, **{
        f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
        if getattr(batch, f.name) is not None
    })


@torch.no_grad()
def compute_logprobs(
    policy_model: list,
    batch: PolicyBatch,
    micro_batch_size: int,
    scoring: ScoringConfig,
    groups: ParallelGroups,
    with_entropy: bool = False,
    routing=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Log-probs of ``batch.labels`` under ``policy_model`` (one forward, no grad).

    ``routing``: optional MoE routing hooks (record or replay routes; see :func:`_run_schedule`),
    applied to the microbatches ``batch.split(micro_batch_size)`` in order.

    Returns ``(logprobs [B, T], entropy [B, T] or None)`` on the last pipeline stage, ``(None, None)``
    on the others (only the last stage computes the loss, so only it needs them).
    """
    for chunk in policy_model:
        chunk.eval()

    def score(mb: PolicyBatch, logits: torch.Tensor):
        lp, ent = vocab_parallel_logprobs(
            logits, mb.labels, temperature=scoring.temperature, tp_group=groups.tp_group,
            vocab_size=scoring.vocab_size, compute_entropy=with_entropy,
            chunk_size=scoring.logprob_chunk_size)
        return torch.zeros((), device=logits.device), {"logprobs": lp, "entropy": ent}

    device = next(policy_model[0].parameters()).device
    micro = [_to_device(mb, device) for mb in batch.split(micro_batch_size)]
    try:
        outputs = _run_schedule(policy_model, micro, forward_only=True, loss_fn=score,
                                routing=routing)
    finally:
        for chunk in policy_model:
            chunk.train()
    if not groups.is_last_stage:
        return None, None
    logprobs = torch.cat([o["logprobs"] for o in outputs]).float().cpu()
    entropy = torch.cat([o["entropy"] for o in outputs]).float().cpu() if with_entropy else None
    return logprobs, entropy


def global_normalizer(batch: PolicyBatch, loss_cfg: PolicyLossConfig, dp_group) -> float:
    """The divisor of the minibatch loss, summed over data-parallel ranks: sequences, or response
    tokens for ``token_mean`` aggregation. Every microbatch uses it, so the summed gradient equals
    that of the whole minibatch however it is split."""
    if loss_cfg.variant == "grpo" and loss_cfg.aggregation == "token_mean":
        local = batch.response_mask.sum().double()
    else:
        local = torch.tensor(float(batch.size), dtype=torch.float64)
    local = local.to(compute_device())  # NCCL reduces device tensors only
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(local, group=dp_group)
    return float(local)


def train_minibatch(
    policy_model: list,
    batch: PolicyBatch,
    micro_batch_size: int,
    loss_cfg: PolicyLossConfig,
    scoring: ScoringConfig,
    groups: ParallelGroups,
    routing=None,
) -> dict[str, float]:
    """Forward and backward of the policy loss over one minibatch (grads accumulate in DDP buffers,
    finalised by Megatron; the caller zeroes grads before and steps the optimizer after).

    Normalisation: Megatron's schedule divides each microbatch loss by the number of microbatches M
    and DDP averages grads over the data(-context)-parallel ranks. We want the gradient of
    ``sum over all sequences / N_global`` instead, so each microbatch returns
    ``policy_loss(..., loss_normalizer=N_global) * M * DP``; the two scalings cancel exactly.

    ``routing``: optional MoE routing hooks, e.g. R2 replay of the old policy's routes (see
    :func:`_run_schedule`), applied to ``batch.split(micro_batch_size)`` in order.

    Returns metrics averaged over microbatches and data-parallel ranks (0 keys on non-last stages).
    """
    normalizer = global_normalizer(batch, loss_cfg, groups.dp_group)
    device = next(policy_model[0].parameters()).device
    micro = [_to_device(mb, device) for mb in batch.split(micro_batch_size)]
    scale = len(micro) * groups.dp_size

    def loss_fn(mb: PolicyBatch, logits: torch.Tensor):
        lp, ent = vocab_parallel_logprobs(
            logits, mb.labels, temperature=scoring.temperature, tp_group=groups.tp_group,
            vocab_size=scoring.vocab_size, compute_entropy=True,
            chunk_size=scoring.logprob_chunk_size)
        lp = maybe_corrupt("nan_loss", lp)
        # Non-finite log-probs (diverged weights, a bad kernel): the loss would be NaN. Compute it on
        # sanitised values (ratio 1) so metrics keep their keys, contribute zero gradient, and flag
        # the minibatch; the caller then skips its optimiser step.
        nonfinite = not bool(torch.isfinite(lp[mb.response_mask]).all())
        if nonfinite:
            lp = torch.where(torch.isfinite(lp), lp, mb.old_logprobs.to(lp.dtype))
        loss, metrics = policy_loss(
            lp, mb.old_logprobs, mb.advantages, mb.response_mask, loss_cfg,
            ref_logprobs=mb.ref_logprobs, entropy=ent.detach(), loss_normalizer=normalizer)
        if nonfinite:
            loss = loss * 0.0
        metrics = {k: (v.detach() if torch.is_tensor(v) else torch.tensor(float(v)))
                   for k, v in metrics.items()}
        metrics["loss/total"] = loss.detach()
        metrics["faults/nonfinite_loss"] = torch.tensor(float(nonfinite))
        return loss * scale, metrics

    outputs = _run_schedule(policy_model, micro, forward_only=False, loss_fn=loss_fn,
                            routing=routing)
    metrics = reduce_metrics(outputs, groups)
    aux = pop_moe_aux_loss()
    if aux is not None and groups.is_last_stage and groups.pp_size == 1:
        metrics["moe/aux_loss"] = aux / len(micro)
    return metrics


def pop_moe_aux_loss() -> float | None:
    """Sum over MoE layers of the load-balancing loss Megatron tracked since the last call (this
    rank's layers, summed over microbatches), then reset the tracker. Megatron's own training loop
    resets it when it logs; without that it would accumulate for the whole run."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if not tracker:
        return None
    total = sum(float(entry["values"].sum()) for entry in tracker.values())
    for entry in tracker.values():
        entry["values"].zero_()
    return total


def reduce_metrics(outputs: list[dict], groups: ParallelGroups) -> dict[str, float]:
    """Mean over microbatches, then over data-parallel ranks; min/max keys keep their extreme.

    ``loss/*`` keys are sums: each microbatch carries its share of the minibatch loss (it was divided
    by the global normaliser), so the minibatch loss is their sum over microbatches and DP ranks.
    """
    if not outputs:
        return {}
    keys = sorted(outputs[0])
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
            t = v.clone().double().to(compute_device())
            if key.endswith("min") or key.endswith("max"):
                dist.all_reduce(t, op=dist.ReduceOp.MIN if key.endswith("min") else dist.ReduceOp.MAX,
                                group=groups.dp_group)
            else:
                dist.all_reduce(t, group=groups.dp_group)
                if not key.startswith("loss/"):
                    t /= groups.dp_size
            out[key] = t
    return {k: float(v) for k, v in out.items()}


def train_sft_minibatch(
    policy_model: list,
    batch: PolicyBatch,
    micro_batch_size: int,
    scoring: ScoringConfig,
    groups: ParallelGroups,
) -> dict[str, float]:
    """Supervised warm-up: token-mean negative log-likelihood of the ``response_mask`` tokens
    (prompt tokens are not trained), through the same schedule and log-prob kernel as the RL update.
    Scoring uses temperature 1 whatever the rollout temperature."""
    local_tokens = batch.response_mask.sum().double().to(compute_device())
    if groups.dp_size > 1:
        dist.all_reduce(local_tokens, group=groups.dp_group)
    normalizer = max(float(local_tokens), 1.0)
    device = next(policy_model[0].parameters()).device
    micro = [_to_device(mb, device) for mb in batch.split(micro_batch_size)]
    scale = len(micro) * groups.dp_size

    def loss_fn(mb: PolicyBatch, logits: torch.Tensor):
        lp, _ = vocab_parallel_logprobs(
            logits, mb.labels, temperature=1.0, tp_group=groups.tp_group,
            vocab_size=scoring.vocab_size, compute_entropy=False,
            chunk_size=scoring.logprob_chunk_size)
        mask = mb.response_mask.to(lp.dtype)
        loss = -(lp * mask).sum() / normalizer
        return loss * scale, {"loss/sft_nll": loss.detach()}

    outputs = _run_schedule(policy_model, micro, forward_only=False, loss_fn=loss_fn)
    return reduce_metrics(outputs, groups)
