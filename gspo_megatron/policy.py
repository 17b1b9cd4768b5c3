"""The interface between the RL loop and a model backend: :class:`Policy`, :class:`Generator`,
and the data they exchange (:class:`PolicyBatch`, :class:`RolloutSample`).

The trainer (:mod:`gspo_megatron.trainer`) talks only to these; the Megatron-Core implementation is
:class:`gspo_megatron.backends.megatron.policy.MegatronPolicy` and
:class:`gspo_megatron.backends.megatron.engine.rollout.RolloutEngine`.

Alignment convention (used everywhere in gspo_megatron): every ``[B, T]`` field is aligned with the
*labels*. Position ``t`` holds the prediction of token ``t + 1``:

    tokens         = [p0 p1 p2 r0 r1 r2 pad pad]   (prompt p, response r, right padding)
    labels         = [p1 p2 r0 r1 r2 pad pad pad]  (tokens shifted left by one)
    response_mask  = [ 0  0  1  1  1   0   0   0]  (label is a response token)

so ``logprobs[b, t] = log pi(labels[b, t] | tokens[b, :t+1])`` and the mask selects exactly the
response tokens' log-probs. Where each sequence's tokens sit (right padding today) is the batch's
:class:`~gspo_megatron.layout.TokenLayout`; every per-sequence value placed into a batch goes
through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Protocol

import torch

from gspo_megatron.layout import ContextShard, PackedRows, TokenLayout
from gspo_megatron.weight_pieces import PieceBox, WeightPiece

RANK_STATE_KEY = "rank"
"""A checkpoint's ``extra[RANK_STATE_KEY]``: state that differs per rank (under
``rollout.placement: separate``, the rollouts in flight); the backend saves it per rank."""


@dataclass
class PolicyBatch:
    """Sequences for log-prob passes and policy updates (all on this rank)."""

    tokens: torch.Tensor
    """[B, T] int64 prompt + response, right-padded."""
    labels: torch.Tensor
    """[B, T] int64 ``tokens`` shifted left by one (padding at the end)."""
    response_mask: torch.Tensor
    """[B, T] bool, True where ``labels`` is a response token."""
    advantages: torch.Tensor | None = None
    """[B] float32 group-normalised advantage A_i."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] float32 log pi_old of the labels (trainer recompute or rollout engine's)."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, T] float32 log-probs the rollout engine reported while sampling."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] float32 reference-model log-probs for the KL term."""
    layout: TokenLayout | None = None
    """Where each sequence's tokens sit (:func:`make_policy_batch` sets it; None: every row is
    one sequence starting at position 0, e.g. a hand-made test batch)."""
    rows: torch.Tensor | None = None
    """[B] int64, on a microbatch: the rows of the batch it was cut from (routes recorded or
    replayed for it are those rows'). None on a whole batch."""
    packing: PackedRows | None = None
    """On a packed microbatch: how its rows are concatenated into the one row the model sees
    (:class:`~gspo_megatron.layout.PackedRows`); None when the model sees the ``[B, T]`` rows."""
    context: ContextShard | None = None
    """On a context-parallel microbatch: this rank's share of every row
    (:class:`~gspo_megatron.layout.ContextShard`); its ``[b, T / cp]`` tensors hold those
    positions. None: whole rows."""

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The ``[B, ...]`` tensor fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if torch.is_tensor(getattr(self, f.name))}

    def select(self, index: slice | torch.Tensor) -> "PolicyBatch":
        """Rows ``index`` of every field (of a batch, not of a packed microbatch)."""
        if self.packing is not None:
            raise ValueError("a packed microbatch cannot be re-sliced; select from its batch")
        layout = self.layout.select(index) if self.layout is not None else None
        return dataclasses.replace(self, layout=layout,
                                   **{k: v[index] for k, v in self.tensors().items()})

    def split(self, size: int) -> list["PolicyBatch"]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(slice(s, s + size)) for s in range(0, self.size, size)]

    def position_ids(self) -> torch.Tensor:
        """[B, T] rotary positions of the tokens (the layout's; 0..T-1 without one); on a
        context-parallel shard, those of its positions."""
        if self.layout is not None:
            full = self.layout.seq_length
            positions = self.layout.position_ids(self.tokens.device)
        else:  # whole rows of a hand-made batch: this shard's share of 0 .. T - 1
            full = self.seq_length * (self.context.size if self.context is not None else 1)
            positions = torch.arange(full, device=self.tokens.device).expand(self.size, -1)
        return positions if self.context is None else self.context.shard(positions, full)

    def context_parallel(self, shard: ContextShard) -> "PolicyBatch":
        """This rank's share of every row (:class:`~gspo_megatron.layout.ContextShard`): each
        ``[B, T]`` field cut to ``[B, T / cp]``; ``[B]`` fields (advantages) unchanged. A packed
        microbatch keeps its ``[n, T]`` rows (its packed row is cut at the model's input,
        :meth:`PackedRows.context_index`); its ``response_mask`` keeps only the positions this
        rank holds, so the loss's per-sequence sums add up over the CP group as a padded shard's
        do."""
        if self.context is not None:
            raise ValueError("a microbatch cannot be context-sharded twice")
        if self.packing is not None:
            held = self.packing.held(shard, self.seq_length).to(self.response_mask.device)
            return dataclasses.replace(self, context=shard,
                                       response_mask=self.response_mask & held)
        t = self.seq_length
        return dataclasses.replace(self, context=shard, **{
            k: shard.shard(v, t) for k, v in self.tensors().items()
            if v.dim() >= 2 and v.shape[1] == t})


def make_policy_batch(
    sequences: list[list[int]],
    prompt_lengths: list[int],
    pad_id: int,
    pad_to_multiple_of: int = 1,
    seq_length: int | None = None,
) -> PolicyBatch:
    """Lay token lists (prompt + response each) out as a label-aligned :class:`PolicyBatch`,
    right-padded (:meth:`TokenLayout.right_padded`: ``seq_length`` fixes T, as pipeline parallel
    needs; otherwise the longest sequence rounded up to ``pad_to_multiple_of``)."""
    layout = TokenLayout.right_padded([len(s) for s in sequences], prompt_lengths,
                                      pad_to_multiple_of, seq_length)
    t = layout.seq_length  # one tensor of the padded lists (right padding: row i, from 0)
    tokens = torch.tensor([list(seq) + [pad_id] * (t - len(seq)) for seq in sequences],
                          dtype=torch.long).reshape(layout.num_rows, t)
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    return PolicyBatch(tokens=tokens, labels=labels, response_mask=layout.response_mask(),
                       layout=layout)


POLICY_MASK_KEY = "policy_mask"
"""``RolloutSample.extra`` of a multi-turn sample: one 0/1 per response token, 1 where the policy
wrote it, 0 for an environment's (tool or user) tokens, which are context only
(:func:`gspo_megatron.stages.batch_stage` takes them out of ``response_mask``)."""
EPISODE_KEY = "episode"
"""``RolloutSample.extra`` of a multi-turn sample: ``{"reward", "turns", "tool_calls", "end"}``
(:mod:`gspo_megatron.envs.turns`)."""

HELD_REQUEST_KEY = "held_request"
"""``RolloutSample.extra`` of an aborted response the engine holds (``GroupStop.hold_cut``): its
request id there, for :attr:`GroupStop.continue_ids`."""

STALE_TOKENS_KEY = "stale_tokens"
"""``RolloutSample.extra`` of a partial rollout's response: how many of its first tokens were
sampled by older weights than the step's (``mismatch/tokens_differ_stale`` counts them apart)."""


@dataclass
class RolloutSample:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Generated tokens, including the EOS token when one was produced; no padding."""
    response_logprobs: list[float]
    """``log softmax(logits[:V] / T)`` of each response token (before top-k/top-p truncation)."""
    finish_reason: Literal["eos", "length", "aborted"]
    """``aborted``: a partial rollout stopped it unfinished (:class:`GroupStop`); it goes on in
    a later rollout (:mod:`gspo_megatron.rollouts.partial`)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupStop:
    """When a partial rollout stops (APRIL; slime's partial rollouts): once ``need`` groups of
    responses are complete, the requests still running are aborted and returned unfinished.

    ``group_of[i]``: the group of request ``i`` of the call; a group is complete when every one
    of its requests in the call has finished (its other members finished in earlier calls).
    ``refill(running)``: asked after every engine step with the number of requests still
    running, returns new requests ``(prompt ids, budget, group)`` to add to the call (fresh
    groups, so that the engine keeps a batch's worth of requests running); None: no refill."""

    group_of: list[int]
    need: int
    refill: Callable[[int], list[tuple[list[int], int, int]]] | None = None
    must: frozenset[int] = frozenset()
    """Groups that must be complete too before the stop (a partial rollout's groups at their
    maximum age: the rollout waits for them as a plain rollout waits for its tail)."""
    hold_cut: bool = False
    """Keep the requests the stop cuts in the engine, KV cache and all (``rollout.
    partial_keep_kv``), for a later call to continue instead of prefilling them again; an aborted
    sample the engine holds names its request in ``extra[HELD_REQUEST_KEY]``."""
    continue_ids: dict[int, int] = field(default_factory=dict)
    """Requests of the call (by index) that continue a request the engine holds from the previous
    call (by its ``extra[HELD_REQUEST_KEY]``): the prompt is that request's prompt and written
    tokens, its KV cache computed by the older weights (PipelineRL's in-flight weight update).
    All or nothing: unless every held request is continued, the engine drops them and prefills
    every prompt (after a checkpoint: a run resumed from it holds no cache)."""

    def __post_init__(self):
        self.pending: dict[int, int] = {}
        for g in self.group_of:
            self.pending[g] = self.pending.get(g, 0) + 1
        self.complete = 0
        self._must_left = sum(self.pending.get(g, 0) > 0 for g in self.must)

    def add(self, group: int) -> int:
        """A request of ``group`` joins the call; returns its index."""
        self.group_of.append(group)
        self.pending[group] = self.pending.get(group, 0) + 1
        return len(self.group_of) - 1

    def finished(self, i: int) -> None:
        """Request ``i`` of the call finished."""
        g = self.group_of[i]
        self.pending[g] -= 1
        self.complete += self.pending[g] == 0
        self._must_left -= self.pending[g] == 0 and g in self.must

    @property
    def done(self) -> bool:
        return self.complete >= self.need and self._must_left == 0


class Generator(Protocol):
    """Samples responses from the live policy (the rollout engine)."""

    def generate(self, prompts: list[list[int]], seed: int, budgets: list[int] | None = None,
                 stop: GroupStop | None = None,
                 progress: Callable[[int], None] | None = None,
                 turns: Any = None) -> list[RolloutSample]:
        """One response per entry of ``prompts`` (token ids), in order, then one per request
        ``stop.refill`` added. ``budgets``: each request's new-token budget (default
        ``rollout.max_new_tokens``); ``stop``: end early once enough groups are complete, the
        unfinished responses ``aborted``; ``progress(n)``: told the number of the call's
        responses finished so far as they finish (a display: evaluation's); ``turns``: the
        requests are multi-turn episodes (:class:`~gspo_megatron.envs.turns.TurnDriver`)."""

    def with_sampling(self, config) -> "Generator":
        """The same engine (model, KV cache) sampling with another ``RolloutConfig``'s
        temperature / top-p / top-k (greedy evaluation, pass@k sampling)."""

    def held_state(self) -> Any:
        """The requests held from the last call (``GroupStop.hold_cut``) whole, KV cache
        included, for a checkpoint that must resume them exactly; None when none is held."""

    def restore_held(self, state: Any) -> None:
        """Hold :meth:`held_state`'s requests again, as the engine that saved them did."""


class RouteHooks(Protocol):
    """Hooks a pass calls around each microbatch's forward to record or replay MoE routes."""

    def before_forward(self, mb_index: int, microbatch: PolicyBatch) -> None: ...
    def after_forward(self, mb_index: int, microbatch: PolicyBatch) -> None: ...
    def finish(self) -> None: ...


class StepRouting(Protocol):
    """The MoE routes of one RL step's batch: the hooks of the old-log-prob pass and of each
    minibatch update, and the ``routing/*`` metrics that follow. What is recorded or replayed
    (routing replay none / R2 / R3, diagnostics) is the backend's business: the loop calls the
    same methods in the same order whatever the mode."""

    def old_pass(self) -> RouteHooks:
        """Hooks for the old-policy log-prob pass over the step's batch."""

    def after_old_pass(self, train_lp: torch.Tensor | None) -> dict[str, float]:
        """After that pass (collective): ``routing/rollout/*`` where the engine recorded routes.
        ``train_lp``: the pass's ``[B, T]`` log-probs (None off the loss ranks)."""

    def update(self, rows: torch.Tensor | slice) -> RouteHooks:
        """Hooks for the update forward of the minibatch made of the batch's rows ``rows``."""

    def after_update(self, i: int, minibatch: PolicyBatch, objective) -> dict[str, float]:
        """After minibatch ``i``'s optimizer step (collective): ``routing/drift/*`` and, on
        diagnosed steps, ``routing/*`` (``objective`` gives the clip rule and temperature)."""

    def timings(self) -> dict[str, float]:
        """``perf/*`` of the step's routing work."""


class Routing(Protocol):
    """A policy's MoE routing in the RL loop (``Policy.routing``)."""

    def start_step(self, batch: PolicyBatch, samples: list[RolloutSample], step: int
                   ) -> StepRouting:
        """The routing of RL step ``step`` on ``batch`` (``samples``: its rollouts in row order)."""


class Policy(Protocol):
    """A trainable policy behind one backend: log-prob passes, minibatch updates, the optimiser,
    MoE routing and checkpoint state. Every method is collective over the ranks that hold
    the model; results live on the ranks that compute the loss (the last pipeline stage)."""

    def logprobs(self, batch: PolicyBatch, *, temperature: float = 1.0,
                 routing: RouteHooks | None = None) -> torch.Tensor | None:
        """``[B, T]`` log pi(labels) (no grad), None on ranks without the loss."""

    def train_minibatch(self, batch: PolicyBatch, objective, *,
                        routing: RouteHooks | None = None) -> dict[str, float]:
        """Forward + backward of ``objective`` (:class:`gspo_megatron.algorithms.Objective`)."""

    def zero_grad(self) -> None: ...

    def optimizer_step(self, corrupt_grad=None) -> tuple[bool, float]:
        """``(applied, grad_norm)``; skipped (False) when any gradient is not finite."""

    @property
    def lr(self) -> float: ...

    def temporary_optimizer(self, optim_cfg, total_steps: int):
        """Context manager: a fresh optimizer and schedule (SFT warm-up), the RL one restored."""

    def training_state_offloaded(self):
        """Context manager around a rollout on this rank: ``trainer.offload``'s part of the
        training state in host memory inside it, back bitwise after; yields the bytes moved."""

    def copy_weights_to(self, other: "Policy") -> None: ...

    @property
    def routing(self) -> Routing | None:
        """MoE routing replay / diagnostics for the RL loop; None when the run uses neither."""

    # State.
    def has_checkpoint(self, load_dir: str) -> bool: ...
    def save_checkpoint(self, save_dir: str, step: int, extra: dict, keep_last: int,
                        before_commit=None, background: bool = False) -> str:
        """Atomic: a checkpoint becomes the latest only once completely written. ``background``:
        written while training goes on, committed by :meth:`wait_for_checkpoint`."""
    def wait_for_checkpoint(self) -> float:
        """Block until a background checkpoint is written and committed; the seconds blocked."""
    def abort_checkpoint(self) -> None:
        """Drop an uncommitted background checkpoint (it never becomes the latest)."""
    def load_checkpoint(self, load_dir: str, allow_pickle: bool = False) -> tuple[int, dict]: ...
    def save_weights(self, directory: str) -> None: ...
    def load_weights(self, directory: str) -> None: ...
    def weight_pieces(self) -> list[WeightPiece]:
        """This rank's pieces of the weights it holds the main replica of (views of the
        parameters, in their dtype; over the ranks, every tensor once), for
        :meth:`load_weight_pieces` in a policy of another layout (separate rollout ranks). Not
        collective."""
    def load_weight_pieces(self, pieces: Iterable[tuple[PieceBox, torch.Tensor]]) -> None:
        """Copy each ``(box, data)`` into the windows of this rank's tensors it overlaps (from
        any layout), reading each ``data`` before asking for the next (a receiver reuses its
        buffer); ``KeyError`` naming a tensor the pieces do not cover."""
