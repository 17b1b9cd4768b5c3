"""The interface between the RL loop and a model backend: :class:`Policy`, :class:`Generator`,
and the data they exchange (:class:`PolicyBatch`, :class:`RolloutSample`).

The trainer (:mod:`gspo_megatron.trainer`) talks only to these; the Megatron-Core implementation is
:class:`gspo_megatron.backends.megatron.policy.MegatronPolicy` and
:class:`gspo_megatron.backends.megatron.rollout.RolloutEngine`.

Alignment convention (used everywhere in gspo_megatron): every ``[B, T]`` field is aligned with the
*labels*. Position ``t`` holds the prediction of token ``t + 1``:

    tokens         = [p0 p1 p2 r0 r1 r2 pad pad]   (prompt p, response r, right padding)
    labels         = [p1 p2 r0 r1 r2 pad pad pad]  (tokens shifted left by one)
    response_mask  = [ 0  0  1  1  1   0   0   0]  (label is a response token)

so ``logprobs[b, t] = log pi(labels[b, t] | tokens[b, :t+1])`` and the mask selects exactly the
response tokens' log-probs. Padding is on the right, so with causal attention it never affects a
real token and needs no attention mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch


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

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def select(self, index: slice | torch.Tensor) -> "PolicyBatch":
        """Rows ``index`` of every field."""
        return dataclasses.replace(self, **{
            f.name: (getattr(self, f.name)[index] if getattr(self, f.name) is not None else None)
            for f in dataclasses.fields(self)
        })

    def split(self, size: int) -> list["PolicyBatch"]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(slice(s, s + size)) for s in range(0, self.size, size)]

    def position_ids(self) -> torch.Tensor:
        """[B, T] positions 0..T-1 (right padding keeps real tokens at their true positions)."""
        return torch.arange(self.seq_length, device=self.tokens.device).expand(self.size, -1)


def make_policy_batch(
    sequences: list[list[int]],
    prompt_lengths: list[int],
    pad_id: int,
    pad_to_multiple_of: int = 1,
    seq_length: int | None = None,
) -> PolicyBatch:
    """Pack token lists (prompt + response each) into a label-aligned :class:`PolicyBatch`.

    ``seq_length`` fixes T (pipeline parallel needs one shape for every microbatch); otherwise T is the
    longest sequence rounded up to ``pad_to_multiple_of`` (TP x 2CP for sequence/context sharding).
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt_lengths")
    longest = max(len(s) for s in sequences)
    t = seq_length if seq_length is not None else longest
    if longest > t:
        raise ValueError(f"a sequence has {longest} tokens, more than seq_length={t}")
    t = -(-t // pad_to_multiple_of) * pad_to_multiple_of
    b = len(sequences)
    tokens = torch.full((b, t), pad_id, dtype=torch.long)
    response_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        # label index t predicts token t+1: response tokens p..len-1 are labels p-1..len-2
        response_mask[i, max(p - 1, 0): len(seq) - 1] = True
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    return PolicyBatch(tokens=tokens, labels=labels, response_mask=response_mask)


@dataclass
class RolloutSample:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Generated tokens, including the EOS token when one was produced; no padding."""
    response_logprobs: list[float]
    """``log softmax(logits[:V] / T)`` of each response token (before top-k/top-p truncation)."""
    finish_reason: Literal["eos", "length"]
    extra: dict[str, Any] = field(default_factory=dict)


class Generator(Protocol):
    """Samples responses from the live policy (the rollout engine)."""

    def generate(self, prompts: list[list[int]], seed: int) -> list[RolloutSample]:
        """One response per entry of ``prompts`` (token ids), in order."""


class RouteHooks(Protocol):
    """Hooks a pass calls around each microbatch's forward to record or replay MoE routes."""

    def before_forward(self, mb_index: int, microbatch: PolicyBatch) -> None: ...
    def after_forward(self, mb_index: int, microbatch: PolicyBatch) -> None: ...
    def finish(self) -> None: ...


class Policy(Protocol):
    """A trainable policy behind one backend: log-prob passes, minibatch updates, the optimiser,
    MoE routing hooks and checkpoint state. Every method is collective over the ranks that hold
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

    def copy_weights_to(self, other: "Policy") -> None: ...

    # MoE routing: record/replay hooks and the statistics computed from them.
    def record_routes(self) -> RouteHooks: ...
    def replay_routes(self, routes, capture_natural: bool = False) -> RouteHooks:
        """Hooks forcing ``routes`` (positions without a route route freely); afterwards
        ``.replayed_store()`` holds the routes used and, with ``capture_natural``,
        ``.natural_store()`` the routers' own top-k."""
    def route_drift(self, old_routes, new_routes, response_mask: torch.Tensor
                    ) -> tuple[float, list[float]]: ...
    def rollout_routes(self, samples: list[RolloutSample], seq_length: int):
        """The routes the rollout engine recorded for ``samples`` (R3), aligned with their
        ``[B, seq_length]`` training batch; positions it did not forward are left to free routing."""
    def rollout_disagreement(self, rollout_routes, trainer_routes, batch: PolicyBatch,
                             train_lp: torch.Tensor | None) -> dict[str, float]:
        """``routing/rollout/*``: where the rollout engine and the trainer routed differently."""
    def routing_diagnostics(self, batch: PolicyBatch, old_routes, loss_cfg, temperature: float,
                            replay_gap: bool = True) -> dict[str, float]: ...

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
    def load_checkpoint(self, load_dir: str) -> tuple[int, dict]: ...
    def save_weights(self, directory: str) -> None: ...
    def load_weights(self, directory: str) -> None: ...
