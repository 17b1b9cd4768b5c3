"""In-loop routing diagnostics: after an optimiser step, how far has the policy's MoE routing moved
from the old policy's on the batch it was just updated on, and what does that do to the ratios.

One call (:func:`routing_diagnostics`) costs one forward of the minibatch with free routing (routes,
router entropy, log-probs of the current policy) and, with ``replay_gap``, a second forward that
replays the old policy's routes. Statistics count the label-aligned ``response_mask`` positions
(the outputs that are scored: the last prompt token through the second-to-last response token);
padding and prompt positions are routed and replayed like any token but left out of the numbers.
Logged keys (all flat, under ``routing/``): see :class:`~gspo_megatron.routing.stats.LayerSums`,
:class:`~gspo_megatron.routing.stats.AlignmentSums` and ``routing/replay_gap_*`` below.
"""

from __future__ import annotations

import torch

from typing import Callable

from gspo_megatron.algorithms import k3
from gspo_megatron.backends.megatron.routing.replay import ModelRouting, RouteStore
from gspo_megatron.distributed import all_reduce_
from gspo_megatron.routing.stats import (AlignmentSums, LayerSums, alignment_sums, layer_sums,
                                         route_change)

MAX_LOAD_KEYS = 1024
"""Per-expert load keys (``routing/load/layer_i/expert_e``) are logged only while
MoE layers x experts is at most this; the per-layer imbalance is always logged."""


def layer_statistics(routing: ModelRouting, old: RouteStore, new: RouteStore,
                     response_mask: torch.Tensor, lengths: torch.Tensor | None = None,
                     count_positions: bool = True) -> tuple[LayerSums, torch.Tensor | None]:
    """Per-MoE-layer sums over the world (one all-reduce) and, with ``count_positions``, this
    rank's per-position count of layers whose route changed ``[B, T]`` (full sequence, zeros
    outside this rank's shard; the caller sums it with :func:`sum_over_shards`). ``lengths``:
    the rows' sequence lengths (packed passes under context parallelism:
    :meth:`ModelRouting.local_mask`)."""
    B, T = response_mask.shape
    pos = routing.local_positions(T)
    mask = routing.local_mask(response_mask, lengths).reshape(-1)
    total = LayerSums.zeros(routing.num_moe_layers, routing.num_experts)
    changed_count = torch.zeros(B, T, dtype=torch.float64) if count_positions else None
    if routing.moe_layers:
        L = len(routing.moe_layers)
        o = old.indices.reshape(L, -1, old.indices.shape[-1])
        n = new.indices.reshape(L, -1, new.indices.shape[-1])
        ent = new.entropy.reshape(L, -1) if new.entropy is not None else None
        local = layer_sums(o, n, mask, routing.num_experts, entropy=ent)
        idx = torch.tensor(routing.moe_layers)
        for name in ("tokens", "changed", "jaccard", "entropy", "load"):
            getattr(total, name)[idx] = getattr(local, name)
        if count_positions:
            changed, _ = route_change(old.indices, new.indices, routing.num_experts)  # [L, B, T_loc]
            # only the positions this rank routes (a packed CP store is zero at the others')
            mine = routing.local_mask(torch.ones(B, T, dtype=torch.bool), lengths)
            changed_count[:, pos] = changed.double().sum(0) * mine
    flat = all_reduce_(total.flat())
    return total.with_flat(flat / routing.route_replicas), changed_count


def sum_over_shards(changed_count: torch.Tensor, routing: ModelRouting, groups) -> torch.Tensor:
    """:func:`layer_statistics`' per-position counts summed over the ranks that hold other
    positions of the same rows (sequence-parallel TP shards, context-parallel shards) or other
    layers (pipeline stages), in place."""
    if groups.tp_size > 1 and routing.sequence_parallel:
        all_reduce_(changed_count, groups.tp_group)
    if groups.cp_size > 1:
        all_reduce_(changed_count, groups.cp_group)
    if groups.pp_size > 1:
        all_reduce_(changed_count, groups.pp_group)
    return changed_count


def route_drift(routing: ModelRouting, old: RouteStore, new: RouteStore,
                response_mask: torch.Tensor, lengths: torch.Tensor | None = None
                ) -> tuple[float, list[float]]:
    """Share of (position, MoE layer) routes whose top-k set differs between ``old`` (the
    old-policy pass) and ``new`` (the routes free routing takes now), over the world, and the same
    per MoE layer. One all-reduce; costs no forward pass (``new`` comes from a training forward).
    NaN when no position is counted."""
    sums, _ = layer_statistics(routing, old, new, response_mask, lengths, count_positions=False)
    total = float(sums.tokens.sum())
    per_layer = (sums.changed / sums.tokens.clamp(min=1)).tolist()
    return (float(sums.changed.sum()) / total if total > 0 else float("nan")), per_layer


def routing_diagnostics(policy_model: list, routing: ModelRouting, batch, old_routes: RouteStore,
                        batching, scoring, groups, clip_rule: Callable,
                        replay_gap: bool = True, prefix: str = "routing") -> dict[str, float]:
    """Routing statistics of ``policy_model`` (current weights) vs ``old_routes`` on ``batch``.

    ``batch`` must carry ``old_logprobs`` and ``advantages`` (the minibatch just trained on) and
    ``old_routes`` its rows' routes from the old-policy pass. ``clip_rule(logprobs, old_logprobs,
    advantages, mask)``: the objective's ``[B, T]`` clipped positions
    (:meth:`~gspo_megatron.algorithms.PolicyGradientObjective.clipped_positions`). Returns
    ``routing/*`` metrics; the layer statistics are on every rank, the log-ratio ones on the last
    pipeline stage. ``batching``: the policy's microbatching (a micro-batch size, or a
    :class:`~.schedule.Microbatching`)."""
    from gspo_megatron.backends.megatron.schedule import compute_logprobs

    mbs = batching if isinstance(batching, int) else batching.micro_batch_size

    rec = routing.recorder(capture_entropy=True)
    new_lp, _ = compute_logprobs(policy_model, batch, batching, scoring, groups, routing=rec)
    new_routes = rec.store()
    rep_lp = None
    if replay_gap:
        rep_lp, _ = compute_logprobs(policy_model, batch, batching, scoring, groups,
                                     routing=routing.replayer(old_routes, mbs))

    lengths = batch.layout.lengths if batch.layout is not None else None
    sums, changed_count = layer_statistics(routing, old_routes, new_routes, batch.response_mask,
                                           lengths)
    metrics = sums.metrics(prefix)
    if routing.num_moe_layers * routing.num_experts > MAX_LOAD_KEYS:
        metrics = {k: v for k, v in metrics.items() if not k.startswith(f"{prefix}/load/")}

    sum_over_shards(changed_count, routing, groups)  # which positions changed in any layer
    if new_lp is None:  # not the last pipeline stage: no log-probs here
        return metrics

    mask = batch.response_mask.bool()
    log_ratio = new_lp.double() - batch.old_logprobs.double()
    # The loss's own clip rule (sequence ratio for gspo/gspo_token, each token's advantage for
    # gspo_token and grpo), in float64.
    clipped = clip_rule(new_lp.double(), batch.old_logprobs.double(), batch.advantages.double(),
                        mask)
    al = alignment_sums(changed_count > 0, log_ratio, clipped, mask)
    extra = [mask.double().sum()]
    if rep_lp is not None:
        d = (rep_lp.double() - new_lp.double())[mask]
        extra += [d.abs().sum(), k3(d.double()).sum()]
    flat = all_reduce_(torch.cat([al.flat(), torch.stack(extra)]), groups.dp_group)
    metrics.update(AlignmentSums.from_flat(flat[:6]).metrics(prefix))
    n = float(flat[6])
    if rep_lp is not None and n > 0:
        metrics[f"{prefix}/replay_gap_abs_logprob"] = float(flat[7]) / n
        metrics[f"{prefix}/replay_gap_k3"] = float(flat[8]) / n
    return metrics
