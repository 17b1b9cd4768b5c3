"""R3 (Rollout Routing Replay, arXiv 2510.11370): the experts the rollout engine chose, recorded
while it sampled, replayed in the trainer's forwards; and the live rollout-vs-trainer route
disagreement the R3 paper measures.

Recording (:class:`RolloutRouteRecorder`)
----------------------------------------
Megatron's static engine runs one forward per context window: the prefill ``[0, p_min)`` (the
shortest prompt of the batch), then one position per decode step. Every position of every row is
forwarded exactly once (prompt tokens of longer prompts are fed during the decode steps), so the
routes each router takes in those forwards, ``[s * b, k]`` sequence-major per window, concatenate
along the sequence into ``[L, b, S, k]`` for the whole engine batch. A sample keeps the positions
it forwarded: ``prompt + response - 1`` (the last token, EOS or the length limit, is sampled but
never fed back, so the engine has no route for it). Rows a batch was padded with (Megatron pads
the batch for EP) and positions after a row's EOS are dropped. The routers are those of the model
that samples (the live policy, or the ``rollout.precision`` copy), each recorded through the same
:class:`~.routing.ScopedRouterReplay` objects R2 uses, in the same compact dtype (uint8 up to 256
experts). Cost: one device-to-host copy of ``[tokens, k]`` uint8 per MoE layer and window.

Alignment with the training batch (:func:`rollout_route_store`)
--------------------------------------------------------------
Routes are indexed by *token*: sample ``i``'s routes go where the batch's
:class:`~gspo_megatron.layout.TokenLayout` puts its tokens (``token_span``: row ``i`` from
position 0 when right-padded), and ``known`` marks them. The rest (the last token, padding) has
no recorded route: a replay routes those freely (:attr:`~.routing.RouteStore.known`). None of
them affects a scored log-prob: the output at the last token predicts past the response, and
padding comes after every real token (causal).
Under sequence parallelism each TP rank keeps its shard of positions; under PP each stage its
own MoE layers (the engine's forwards run every stage's routers).
"""

from __future__ import annotations

import torch

from gspo_megatron.backends.megatron.routing.replay import ModelRouting, RouteStore, router_actions
from gspo_megatron.distributed import all_reduce_
from gspo_megatron.layout import TokenLayout
from gspo_megatron.routing.stats import AlignmentSums, alignment_sums

ROLLOUT_ROUTES_KEY = "routes"
"""``RolloutSample.extra`` key of a sample's routes ``[L_local, prompt + response - 1, k]``."""


class RolloutRouteRecorder:
    """Records the routes of every forward the rollout engine runs, per engine batch.

    :meth:`before_forward` / :meth:`after_forward` wrap one ``run_one_forward_step`` (the
    inference wrapper calls them); :meth:`take` returns the batch's routes and resets. Forwards
    outside them (Megatron's EP ``dummy_forward`` padding) route freely and are not recorded."""

    def __init__(self, routing: ModelRouting):
        self.routing = routing
        self._windows: list[tuple[int, torch.Tensor]] = []  # (start position, [L, b, s, k])

    def before_forward(self) -> None:
        self.routing.set_action(router_actions().RECORD)

    def after_forward(self, inference_input: dict, context=None) -> None:
        """``inference_input``: the window's ``tokens`` ``[b, s]`` (their shape gives the
        layout) and ``position_ids`` (the first is the window's start)."""
        tokens = inference_input["tokens"]
        start = int(inference_input["position_ids"][0, 0])
        b = tokens.shape[0]
        indices, _ = self.routing.collect(len(self._windows), b)  # [L, b, s, k] on the CPU
        self.routing.set_action(None)  # free routing until the next recorded window
        if self._windows:
            prev_start, prev = self._windows[-1]
            if start != prev_start + prev.shape[2]:
                raise RuntimeError(f"rollout routes: window at position {start} does not follow "
                                   f"the previous one ({prev_start} + {prev.shape[2]})")
        elif start != 0:
            raise RuntimeError(f"rollout routes: the first window starts at {start}, not 0")
        self._windows.append((start, indices))

    def take(self) -> torch.Tensor | None:
        """``[L, b, S, k]``: the routes of every position forwarded since the last call (None if
        nothing was forwarded); resets."""
        windows, self._windows = self._windows, []
        if not windows:
            return None
        return torch.cat([w for _, w in windows], dim=2)

    def reset(self, keep=()) -> None:
        """Forget the recorded windows (``keep``: ids of requests held across calls, which the
        static engine never has)."""
        if keep:
            raise ValueError("the static engine holds no request across calls")
        self._windows = []
        self.routing.reset()


class PackedRouteRecorder:
    """Records the routes of the dynamic engine's forwards (R3 on :mod:`..engine.dynamic`).

    Each step forwards one packed buffer ``[1, T_padded]``: the new tokens of every active
    request (a prompt chunk at prefill, one token per request at decode), padded for the
    step's shape. The context says where each of the first ``active_token_count`` tokens
    belongs (``request_ids[token_to_request_idx]``) and at which position of its request
    (``token_to_pos_ids``); the routers see the buffer sequence-major, so a step's routes are
    ``[L, T_padded, k]`` and its real tokens the first ``active_token_count`` of them. The
    padding forwards of the EP lock-step (``dummy_forward``) do not pass through here.
    Cost per step: one device-to-host copy of ``[tokens, k]`` per MoE layer, and three small
    index tensors."""

    def __init__(self, routing: ModelRouting):
        self.routing = routing
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def before_forward(self) -> None:
        self.routing.set_action(router_actions().RECORD)

    def after_forward(self, inference_input: dict, context) -> None:
        """Keep the step's routes with their request ids and positions."""
        indices, _ = self.routing.collect(len(self._steps), 1)  # [L, 1, T_padded, k]
        self.routing.set_action(None)
        n = int(context.active_token_count)
        if indices.shape[2] < n:  # the routers saw a sequence-parallel shard of the buffer
            raise NotImplementedError(
                f"R3 recording: the routers routed {indices.shape[2]} of the step's {n} tokens "
                "(sequence parallel stays on in generation under TP > 1 with EP > 1)")
        slots = context.token_to_request_idx[:n].long()
        ids = context.request_ids[slots].long().cpu()  # indexing copies
        positions = context.token_to_pos_ids[:n].cpu().long().clone()  # a view of the buffer
        self._steps.append((ids, positions, indices[:, 0, :n]))
        self._table = None

    def record_tokens(self, ids: torch.Tensor, positions: torch.Tensor,
                      routes: torch.Tensor) -> None:
        """Routes the engine took outside a module forward (the multi-step decoder,
        :mod:`..engine.rounds`): token ``m`` of request ``ids[m]`` at ``positions[m]`` went to
        experts ``routes[:, m]`` (``[L, m, k]``, each MoE layer's top-k)."""
        self._steps.append((ids, positions, routes.to(self.routing.dtype).cpu()))
        self._table = None

    def take_request(self, request_id: int, length: int) -> torch.Tensor:
        """``[L, length, k]``: the routes of request ``request_id`` at positions ``0 .. length -
        1`` (every token it forwarded). Raises if one was never recorded. A position forwarded
        twice (a request Megatron evicted, prefilled again with what it wrote) keeps its first
        route: the forward whose logits sampled the next token (R3 replays the routes taken at
        sampling, not a recompute's)."""
        if self._table is None:
            ids, pos, routes = (torch.cat(x, dim=-2 if i == 2 else 0)
                                for i, x in enumerate(zip(*self._steps)))
            self._table = ids, pos, routes
        ids, pos, routes = self._table
        mine = ids == request_id
        out = torch.zeros(routes.shape[0], length, routes.shape[-1], dtype=routes.dtype)
        seen = torch.zeros(length, dtype=torch.bool)
        p = pos[mine]
        if p.numel() and int(p.max()) >= length:
            raise RuntimeError(f"rollout routes: request {request_id} forwarded position "
                               f"{int(p.max())}, past its {length} tokens")
        picked = routes[:, mine]
        if p.numel() and p.unique().numel() < p.numel():  # duplicates: the earliest of each
            order = torch.sort(p, stable=True).indices  # (steps are recorded in time order)
            sorted_p = p[order]
            first = torch.ones_like(sorted_p, dtype=torch.bool)
            first[1:] = sorted_p[1:] != sorted_p[:-1]
            keep = order[first]
            p, picked = p[keep], picked[:, keep]
        out[:, p] = picked
        seen[p] = True
        if not bool(seen.all()):
            raise RuntimeError(f"rollout routes: request {request_id} has no route for "
                               f"{int((~seen).sum())} of its {length} forwarded positions")
        return out

    def state_dict(self) -> list:
        """The routes kept (of the requests the engine holds), for a checkpoint."""
        return [tuple(t.clone() for t in step) for step in self._steps]

    def load_state_dict(self, steps: list) -> None:
        self._steps, self._table = [tuple(step) for step in steps], None

    def reset(self, keep=()) -> None:
        """Forget the recorded steps, but the routes of the requests in ``keep`` (held by the
        engine for a later call: their earlier tokens are not forwarded again)."""
        keep = torch.tensor(sorted(keep), dtype=torch.long)
        self._steps = [] if not keep.numel() else [
            (ids[m], pos[m], routes[:, m]) for ids, pos, routes in self._steps
            for m in [torch.isin(ids, keep)] if bool(m.any())]
        self._table = None
        self.routing.reset()


def rollout_route_store(samples, layout: TokenLayout, routing: ModelRouting) -> RouteStore:
    """The rollout's routes as a :class:`RouteStore` aligned with the training batch of
    ``samples`` laid out by ``layout`` (``[B, T]``): ``indices [L_local, B, T_local, k]`` and
    ``known [B, T_local]`` (see the module docstring). Raises if a sample has none."""
    L, k = len(routing.moe_layers), routing.topk
    B, T = layout.num_rows, layout.seq_length
    indices = torch.zeros(L, B, T, k, dtype=routing.dtype)
    known = torch.zeros(B, T, dtype=torch.bool)
    for i, s in enumerate(samples):
        routes = s.extra.get(ROLLOUT_ROUTES_KEY)
        if routes is None:
            raise RuntimeError(f"rollout sample {i} carries no routes: the engine was built "
                               "without route recording")
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        if routes.shape[0] != L or routes.shape[1] != n or routes.shape[2] != k:
            raise RuntimeError(f"rollout sample {i}: routes {tuple(routes.shape)}, expected "
                               f"({L}, {n}, {k}) for this stage's MoE layers")
        row, span = layout.token_span(i)
        forwarded = slice(span.start, span.stop - 1)  # the last token is never fed back
        indices[:, row, forwarded] = routes.to(routing.dtype)
        known[row, forwarded] = True
    pos = routing.local_positions(T)
    return RouteStore(indices[:, :, pos].contiguous(), list(routing.moe_layers),
                      known=known[:, pos].contiguous())


def rollout_disagreement(routing: ModelRouting, rollout: RouteStore, trainer: RouteStore,
                         response_mask: torch.Tensor, train_lp: torch.Tensor | None,
                         rollout_lp: torch.Tensor, groups, prefix: str = "routing/rollout",
                         lengths: torch.Tensor | None = None) -> dict[str, float]:
    """Where the rollout engine and the trainer's old-policy forward route differently (the
    numbers of the R3 paper, per MoE layer, every step, no extra forward).

    ``trainer``: the routes the trainer's routers chose themselves in the old-log-prob pass (free
    routing, or the natural top-k captured under an R3 replay). Counted on the scored positions
    (``response_mask``, ``[B, T]``). Returns ``{prefix}/change_rate`` (share of (position, layer)
    routes whose top-k set differs) and ``/layer_i``, ``/jaccard``, ``/token_change_rate`` (share
    of positions differing in at least one layer) and, on the last pipeline stage,
    ``/abs_log_ratio_changed`` / ``_unchanged``: mean ``|log p_train - log p_rollout|`` of
    positions with / without a differing route. Collective over the world."""
    from gspo_megatron.backends.megatron.routing.diagnostics import (layer_statistics,
                                                                      sum_over_shards)

    sums, changed_count = layer_statistics(routing, rollout, trainer, response_mask, lengths)
    metrics = {k: v for k, v in sums.metrics(prefix, with_entropy=False).items()
               if "/load" not in k}
    sum_over_shards(changed_count, routing, groups)
    if train_lp is None:  # not the last pipeline stage
        return metrics
    mask = response_mask.bool()
    log_ratio = train_lp.double() - rollout_lp.double()
    al = alignment_sums(changed_count > 0, log_ratio, torch.zeros_like(log_ratio), mask)
    flat = all_reduce_(al.flat(), groups.dp_group)
    metrics.update({k: v for k, v in AlignmentSums.from_flat(flat).metrics(prefix).items()
                    if "clipfrac" not in k})
    return metrics
