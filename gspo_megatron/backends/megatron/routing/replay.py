"""Per-model routing record / replay on Megatron-Core's own ``RouterReplay``.

Megatron-Core (>= 0.16) routes every MoE token through ``topk_routing_with_score_function``, which
asks the router's ``router_replay`` object for the top-k (:class:`RouterReplay.get_replay_topk`):
``RECORD`` runs the normal top-k and keeps the indices, ``REPLAY_FORWARD`` / ``REPLAY_BACKWARD``
gather the router scores at given indices (so the router still gets a gradient). With
``moe_enable_routing_replay=True`` every router's instance joins one class-level list, so a
reference model or a second policy in the process would mix into it.

Here each router of *one* model gets its own :class:`ScopedRouterReplay` (a ``RouterReplay`` that
is taken out of the class-level list), held by :class:`ModelRouting`. Top-k itself is Megatron's.

Layout
------
A :class:`RouteStore` holds the routes of a batch on this rank: ``indices [L_local, B, T_local, k]``
(uint8 up to 256 experts, uint16 up to 65,536), ``L_local`` = the MoE layers of this pipeline stage
(``moe_layers`` gives their global MoE index: dense layers are skipped, so with
``moe_layer_freq=[1, 0, 1]`` the layers are 0 and 1), ``T_local`` = this rank's part of the
sequence (``T / TP`` under sequence parallelism: each TP rank routes, records and replays only its
shard; nothing is gathered). Rows are the batch's sequences, so a store can be re-sliced for any
minibatch / microbatch split (``select``). Megatron's routers see tokens sequence-major
(``[s * b, k]``); the conversion happens in :class:`RouteRecorder` / :class:`RouteReplayer`.

Schedule hooks
--------------
:class:`RouteRecorder` and :class:`RouteReplayer` implement the ``before_forward(i)`` /
``after_forward(i)`` / ``finish()`` hooks that :func:`gspo_megatron.backends.megatron.schedule._run_schedule`
calls around each microbatch's model forward. Megatron's schedules run forward steps in microbatch
order on every stage (also 1F1B), and backward steps in the same order, so: before forward ``i``
the replayer sets the targets (``REPLAY_FORWARD``, and queues them for the backward), after it
switches to ``REPLAY_BACKWARD`` so that activation recomputation in the backward pops the queue in
FIFO order (Megatron's own design); ``finish`` clears everything so rollouts and other passes route
freely.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gspo_megatron.config.model import moe_layer_pattern
from gspo_megatron.layout import ContextShard, in_batch_order
from gspo_megatron.routing.stats import entropy_from_logits, entropy_from_probs, route_dtype

__all__ = ["ModelRouting", "RouteRecorder", "RouteReplayer", "RouteStore", "ScopedRouterReplay",
           "moe_layer_pattern"]


def _router_replay_cls():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def router_actions():
    """Megatron's ``RouterReplayAction`` (imported on first use)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return RouterReplayAction


@functools.lru_cache(maxsize=None)
def scoped_router_replay_class():
    """The :class:`ScopedRouterReplay` class (built on first use: it subclasses Megatron's)."""
    RouterReplay = _router_replay_cls()

    class ScopedRouterReplay(RouterReplay):
        """A ``RouterReplay`` owned by one router of one model (not in the class-level list).

        Adds three things around Megatron's ``get_replay_topk``: a check that replayed indices
        fit the tokens being routed (a mismatch would otherwise gather silently from the wrong
        rows); when ``capture_entropy`` is set, the router entropy of the scores it is given; and,
        when ``capture_natural`` is set during a replayed forward, the top-k the router would
        have chosen itself (Megatron's own top-k on the same scores, no gradient), kept in
        ``recorded_topk_idx`` as a recording would."""

        def __init__(self, score_kind: str = "logits"):
            super().__init__()
            instances = RouterReplay.global_router_replay_instances
            for i in range(len(instances) - 1, -1, -1):
                if instances[i] is self:
                    del instances[i]
            self.score_kind = score_kind
            self.capture_entropy = False
            self.capture_natural = False
            self.recorded_entropy: torch.Tensor | None = None
            self.num_experts: int | None = None
            self.target_free: torch.Tensor | None = None
            """[N] bool: tokens without a target route (routed freely even while replaying)."""
            self.used_topk_idx: torch.Tensor | None = None
            """The indices a partial replay actually used (targets, free routes where free)."""

        def _check(self, scores: torch.Tensor, indices: torch.Tensor | None, what: str):
            if indices is None:
                raise RuntimeError(f"routing replay ({what}): no routes were set for this router")
            if indices.shape[0] != scores.shape[0]:
                raise RuntimeError(
                    f"routing replay ({what}): {indices.shape[0]} recorded tokens but the router "
                    f"sees {scores.shape[0]}; the batch layout (padding, micro-batch size, "
                    "sequence/context parallel split) must match the recording")

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            A = router_actions()
            if self.capture_entropy:
                with torch.no_grad():
                    self.recorded_entropy = (entropy_from_logits(scores) if self.score_kind == "logits"
                                             else entropy_from_probs(scores)).detach()
            if self.router_replay_action == A.REPLAY_FORWARD:
                self._check(scores, self.target_topk_idx, "forward")
                natural = None
                if self.capture_natural or self.target_free is not None:
                    with torch.no_grad():
                        _, natural = default_compute_topk(scores.detach(), topk,
                                                          num_groups=num_groups,
                                                          group_topk=group_topk)
                if self.capture_natural:
                    self.record_indices(natural)
                if self.target_free is not None:
                    # Partial replay (R3): tokens the recording did not cover route freely. The
                    # merged indices replace the queued targets, so the backward's recompute
                    # replays exactly what this forward used.
                    target = self.target_topk_idx.to(scores.device)
                    merged = torch.where(self.target_free.to(scores.device).unsqueeze(-1),
                                         natural, target)
                    if self.replay_backward_list and self.replay_backward_list[-1] is \
                            self.target_topk_idx:
                        self.replay_backward_list[-1] = merged
                    self.target_topk_idx = merged
                    self.used_topk_idx = merged
            elif self.router_replay_action == A.REPLAY_BACKWARD:
                self._check(scores, self.replay_backward_list[0] if self.replay_backward_list
                            else None, "recompute")
            return super().get_replay_topk(scores, topk, num_groups, group_topk,
                                           default_compute_topk)

    return ScopedRouterReplay


def ScopedRouterReplay(score_kind: str = "logits"):
    """A fresh per-router replay object: ``score_kind`` is ``"logits"`` when the router hands
    top-k raw logits (softmax after top-k, Qwen3) and ``"probs"`` otherwise (entropy only)."""
    return scoped_router_replay_class()(score_kind)


@dataclass
class RouteStore:
    """Routes of a batch on this rank (see the module docstring for the layout)."""

    indices: torch.Tensor
    """[L_local, B, T_local, k] expert ids (uint8 / uint16), on the CPU."""
    moe_layers: list[int]
    """Global MoE-layer index of each of the L_local layers."""
    entropy: torch.Tensor | None = None
    """[L_local, B, T_local] router entropy (nats) when recorded with ``capture_entropy``."""
    known: torch.Tensor | None = None
    """[B, T_local] bool: positions whose routes were recorded (None = all). Rollout routes (R3)
    cover the tokens the engine forwarded (prompt and response but the last token); a replay
    routes the others freely."""

    @property
    def batch_size(self) -> int:
        return self.indices.shape[1]

    def select(self, rows) -> "RouteStore":
        """Rows (sequences) ``rows``: a slice or an index tensor, as in ``PolicyBatch.select``."""
        return RouteStore(self.indices[:, rows], self.moe_layers,
                          None if self.entropy is None else self.entropy[:, rows],
                          None if self.known is None else self.known[rows])

    def sequence_major(self, rows: slice) -> list[torch.Tensor]:
        """Per local layer, the routes of rows ``rows`` as Megatron's router sees them:
        int64 ``[T_local * b, k]`` (sequence-major)."""
        x = self.indices[:, rows].long()  # [L, b, T, k]
        return [x[i].transpose(0, 1).reshape(-1, x.shape[-1]) for i in range(x.shape[0])]

    def free_sequence_major(self, rows: slice) -> torch.Tensor | None:
        """``[T_local * b]`` bool, True where rows ``rows`` have no recorded route (None when
        every position is known)."""
        if self.known is None:
            return None
        return ~self.known[rows].transpose(0, 1).reshape(-1)

    def packed(self, rows: torch.Tensor, packing, context=None
               ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Per local layer, the routes of rows ``rows`` in the order of their packed row
        (:class:`~gspo_megatron.layout.PackedRows`; with ``context``, this context-parallel
        rank's positions of it): int64 ``[S, k]``, every pad given experts ``0 .. k-1`` (its
        routing is masked out); and ``[S]`` bool, True where no route was recorded (the pads
        included), or None when every position is known."""
        x = self.indices[:, rows].long()  # [L, n, T, k]
        pad = torch.arange(x.shape[-1])
        routes = [packing.gather_rows(x[i], pad, context) for i in range(x.shape[0])]
        if self.known is None:
            return routes, None
        return routes, ~packing.gather_rows(self.known[rows], False, context)

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size()

    def bytes_per_token_per_layer(self) -> int:
        return self.indices.shape[-1] * self.indices.element_size()


class ModelRouting:
    """The MoE routers of one model (this rank's pipeline stage), each with its own replay object.

    ``ModelRouting(model_chunks, groups)`` attaches (replacing any ``RouterReplay`` that
    ``moe_enable_routing_replay`` put there, and taking it out of Megatron's class-level list).
    Attaching twice to the same model shares the replay objects: the policy and the rollout
    engine (R3 recording on the live model) each hold a view of the same routers.
    With no action set the replay object defers to Megatron's normal top-k, so attaching changes
    nothing until a recorder or replayer runs."""

    def __init__(self, model_chunks: list, groups=None, packed: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        chunks = [getattr(c, "module", c) for c in model_chunks]
        config = chunks[0].config
        if not config.num_moe_experts:
            raise ValueError("routing replay/diagnostics need an MoE model (num_moe_experts > 0)")
        if config.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError("routing replay does not apply to sinkhorn routing")
        self.config = config
        self.num_experts = int(config.num_moe_experts)
        self.topk = int(config.moe_router_topk)
        self.dtype = route_dtype(self.num_experts)
        pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
        self.num_moe_layers = sum(pattern)
        score_kind = ("logits" if config.moe_router_score_function == "softmax"
                      and not config.moe_router_pre_softmax else "probs")
        RouterReplay = _router_replay_cls()
        self.routers, self.replays, self.moe_layers = [], [], []
        for chunk in chunks:
            layers = getattr(getattr(chunk, "decoder", None), "layers", [])
            for layer in layers:
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if not isinstance(router, TopKRouter):
                    continue
                old = router.router_replay
                if isinstance(old, scoped_router_replay_class()):
                    replay = old  # attached before (the policy's, or the rollout engine's view)
                else:
                    if old is not None and old in RouterReplay.global_router_replay_instances:
                        RouterReplay.global_router_replay_instances.remove(old)
                    replay = ScopedRouterReplay(score_kind)
                    router.router_replay = replay
                self.routers.append(router)
                self.replays.append(replay)
                self.moe_layers.append(sum(pattern[: layer.layer_number - 1]))
        if not self.routers and groups is None:
            raise ValueError("no MoE router found in the model")
        self.tp_size = groups.tp_size if groups is not None else 1
        self.tp_rank = groups.tp_rank if groups is not None else 0
        self.sequence_parallel = bool(config.sequence_parallel)
        self.groups = groups
        self.context = (ContextShard(groups.cp_rank, groups.cp_size)
                        if groups is not None and groups.cp_size > 1 else None)
        self.packed = packed
        """The passes pack their microbatches (``trainer.max_tokens_per_microbatch``): route
        stores then hold whole rows, a context-parallel rank's routes at the positions it holds
        of each sequence (:meth:`local_mask`), zeros elsewhere."""

    # -- layout
    def local_positions(self, seq_length: int) -> slice | torch.Tensor:
        """The positions of a ``seq_length`` row this rank routes, in the order its routers see
        them: its context-parallel share (:class:`~gspo_megatron.layout.ContextShard`, an index
        tensor), then its sequence-parallel slice of that. Packed passes: the whole row (see
        :attr:`packed`)."""
        if self.packed:
            return slice(0, seq_length)
        if self.context is not None:
            positions = self.context.positions(seq_length)
            if self.sequence_parallel and self.tp_size > 1:
                n = positions.numel() // self.tp_size
                positions = positions[self.tp_rank * n:(self.tp_rank + 1) * n]
            return positions
        if self.sequence_parallel and self.tp_size > 1:
            n = seq_length // self.tp_size
            return slice(self.tp_rank * n, (self.tp_rank + 1) * n)
        return slice(0, seq_length)

    def local_mask(self, mask: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """``mask [B, T]`` at :meth:`local_positions`, kept only where this rank routes: under
        context parallelism with packing, the chunks of each sequence (``lengths [B]``) this rank
        holds (:meth:`~gspo_megatron.layout.ContextShard.segment_held`)."""
        local = mask[:, self.local_positions(mask.shape[1])]
        if self.packed and self.context is not None:
            if lengths is None:
                raise ValueError("packed context-parallel routes need the batch's lengths")
            local = local & self.context.segment_held(lengths, mask.shape[1]).to(local.device)
        return local

    @property
    def route_replicas(self) -> int:
        """How many ranks route the same token in one layer (TP without SP routes the full
        sequence on every TP rank)."""
        return 1 if self.sequence_parallel else self.tp_size

    # -- actions
    def set_action(self, action) -> None:
        for r in self.replays:
            r.set_router_replay_action(action)

    def reset(self) -> None:
        """No action, no indices: routing is free again."""
        for r in self.replays:
            r.clear_router_replay_action()
            r.clear_indices()
            r.capture_entropy = False
            r.capture_natural = False
            r.recorded_entropy = None
            r.target_free = None
            r.used_topk_idx = None

    def recorder(self, capture_entropy: bool = False) -> "RouteRecorder":
        return RouteRecorder(self, capture_entropy)

    def replayer(self, store: RouteStore, micro_batch_size: int,
                 capture_natural: bool = False) -> "RouteReplayer":
        return RouteReplayer(self, store, micro_batch_size, capture_natural)

    def check_packed(self, microbatch) -> None:
        """Packed microbatches are routed as one row; under sequence parallelism each TP rank
        would hold a shard of that row that no other pass shares (not supported)."""
        if getattr(microbatch, "packing", None) is not None and self.route_shards > 1:
            raise ValueError("routing replay/diagnostics with packed microbatches "
                             "(trainer.max_tokens_per_microbatch) need "
                             "parallel.tensor_model_parallel_size 1 (sequence-parallel shards "
                             "of a packed row are not recorded)")

    @property
    def route_shards(self) -> int:
        """Ranks that each route one slice of a microbatch's tokens (TP under SP)."""
        return self.tp_size if self.sequence_parallel else 1

    def _to_rows(self, x: torch.Tensor, microbatch, b: int) -> torch.Tensor:
        """A router's per-token values ``[s * b, ...]`` (sequence-major) -> ``[b, s, ...]``; for a
        packed microbatch ``[S, ...]`` -> ``[n, T, ...]`` at each sequence's positions."""
        packing = getattr(microbatch, "packing", None)
        if packing is None:
            return x.reshape(-1, b, *x.shape[1:]).transpose(0, 1)
        return packing.scatter_rows(x, microbatch.seq_length, microbatch.context)

    def collect(self, mb_index: int, microbatch, capture_entropy: bool = False,
                attr: str = "recorded_topk_idx"):
        """The routes each router recorded for the microbatch just run (a ``PolicyBatch``, or
        its number of sequences ``b`` for padded rows): ``([L, b, T_local, k] indices,
        [L, b, T_local] entropy or None)`` on the CPU, taken out of the routers (their ``attr``
        is cleared: ``recorded_topk_idx``, or ``used_topk_idx`` for the routes a partial replay
        used). A packed microbatch's routes are put back at its sequences' positions."""
        b = microbatch if isinstance(microbatch, int) else microbatch.size
        per_layer, ent = [], []
        for layer, r in zip(self.moe_layers, self.replays):
            idx = getattr(r, attr)
            if idx is None:
                raise RuntimeError(f"MoE layer {layer} recorded no routes for microbatch {mb_index}")
            per_layer.append(self._to_rows(idx.detach(), microbatch, b).to(self.dtype).cpu())
            if capture_entropy:
                ent.append(self._to_rows(r.recorded_entropy, microbatch, b).float().cpu())
            setattr(r, attr, None)
        if not per_layer:  # a pipeline stage without MoE layers
            return torch.zeros(0, b, 0, self.topk, dtype=self.dtype), None
        return torch.stack(per_layer), (torch.stack(ent) if ent else None)


class RouteRecorder:
    """Schedule hooks that record every microbatch's routes; :meth:`store` assembles them (rows in
    microbatch order, i.e. the row order of the batch that was split)."""

    def __init__(self, routing: ModelRouting, capture_entropy: bool = False):
        self.routing = routing
        self.capture_entropy = capture_entropy
        self._indices: list[torch.Tensor] = []  # per microbatch [L, b, T_local, k]
        self._entropy: list[torch.Tensor] = []
        self._rows: list[torch.Tensor | None] = []  # per microbatch, its batch rows

    def before_forward(self, mb_index: int, microbatch=None) -> None:
        A = router_actions()
        self.routing.check_packed(microbatch)
        for r in self.routing.replays:
            r.set_router_replay_action(A.RECORD)
            r.recorded_topk_idx = None
            r.capture_entropy = self.capture_entropy

    def after_forward(self, mb_index: int, microbatch=None) -> None:
        indices, entropy = self.routing.collect(mb_index, microbatch, self.capture_entropy)
        self._indices.append(indices)
        self._rows.append(getattr(microbatch, "rows", None))
        if entropy is not None:
            self._entropy.append(entropy)

    def finish(self) -> None:
        self.routing.reset()

    def store(self) -> RouteStore:
        """The recorded routes, rows in the batch's order (microbatches of packed sequences
        hold rows out of order: put back by their ``rows``)."""
        return RouteStore(in_batch_order(self._indices, self._rows, 1),
                          list(self.routing.moe_layers),
                          in_batch_order(self._entropy, self._rows, 1) if self._entropy else None)



class RouteReplayer:
    """Schedule hooks that force the routes of ``store`` (rows = the batch's rows, split into
    consecutive microbatches of ``micro_batch_size``) in every forward and recompute. With
    ``capture_natural``, each forward also keeps the routes the routers would have chosen
    (:meth:`natural_store`): free routing's top-k on the same scores, at the cost of one top-k."""

    def __init__(self, routing: ModelRouting, store: RouteStore, micro_batch_size: int,
                 capture_natural: bool = False):
        if routing.routers and list(store.moe_layers) != list(routing.moe_layers):
            raise ValueError(f"route store holds MoE layers {store.moe_layers}, the model "
                             f"{routing.moe_layers}")
        self.routing, self.store, self.mbs = routing, store, micro_batch_size
        self.device = (routing.routers[0].weight.device if routing.routers else torch.device("cpu"))
        self.capture_natural = capture_natural
        self._natural: list[torch.Tensor] = []
        self._used: list[torch.Tensor] = []
        self._rows: list[torch.Tensor | None] = []

    def before_forward(self, mb_index: int, microbatch=None) -> None:
        A = router_actions()
        start = mb_index * self.mbs
        b = microbatch.size if microbatch is not None else self.mbs
        rows = getattr(microbatch, "rows", None)
        if rows is None:
            rows = torch.arange(start, start + b)
        if int(rows.max()) >= self.store.batch_size:
            raise RuntimeError(f"routing replay: microbatch {mb_index} needs row {int(rows.max())}"
                               f" but the route store has {self.store.batch_size}")
        self.routing.check_packed(microbatch)
        if getattr(microbatch, "packing", None) is not None:
            routes, free = self.store.packed(rows.cpu(), microbatch.packing, microbatch.context)
        else:
            rows = slice(int(rows[0]), int(rows[0]) + b)
            routes = self.store.sequence_major(rows)
            free = self.store.free_sequence_major(rows)
        for r, idx in zip(self.routing.replays, routes):
            r.set_target_indices(idx.to(self.device))
            r.set_router_replay_action(A.REPLAY_FORWARD)
            r.capture_natural = self.capture_natural
            r.target_free = free
            r.recorded_topk_idx = None
            r.used_topk_idx = None

    def after_forward(self, mb_index: int, microbatch=None) -> None:
        mb = microbatch if microbatch is not None else self.mbs
        self._rows.append(getattr(microbatch, "rows", None))
        if self.capture_natural:
            self._natural.append(self.routing.collect(mb_index, mb)[0])
            for r in self.routing.replays:
                r.capture_natural = False  # not in the backward's recompute
        if self.store.known is not None:
            self._used.append(self.routing.collect(mb_index, mb, attr="used_topk_idx")[0])
            for r in self.routing.replays:
                r.target_free = None  # the recompute pops the merged routes as they are
        self.routing.set_action(router_actions().REPLAY_BACKWARD)

    def replayed_store(self) -> RouteStore:
        """The routes the pass used: the store's where known, free routing's elsewhere (a full
        store: replaying it again reproduces the pass exactly)."""
        if self.store.known is None:
            return RouteStore(self.store.indices, list(self.store.moe_layers))
        if not self._used:
            raise RuntimeError("replayed_store() needs a finished pass")
        return RouteStore(in_batch_order(self._used, self._rows, 1), list(self.routing.moe_layers))

    def natural_store(self) -> RouteStore:
        """The routes free routing would have taken in the replayed forwards (``capture_natural``)."""
        if not self._natural:
            raise RuntimeError("natural_store() needs capture_natural=True and a finished pass")
        return RouteStore(in_batch_order(self._natural, self._rows, 1),
                          list(self.routing.moe_layers))

    def finish(self) -> None:
        self.routing.reset()
