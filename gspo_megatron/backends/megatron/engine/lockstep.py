"""Which ranks decode in lock-step, and the one collective that decides each step for them.

Under expert parallelism a decoding step's MoE layers exchange tokens between the ranks of an
EP group (Megatron's dispatcher, or the step function's sharded experts), so those ranks must
take every step together even though they hold different requests: a rank that stopped early
would leave the others waiting in a collective. Which ranks are coupled is a property of the
layout, and every decision that changes whether a rank takes part in a step (the experts
replicated for decoding, so that no step needs another rank; each step's kind) is taken by one
all-reduce over exactly those ranks, :func:`coupled_group`. Deciding one thing over the EP group
and the next over the world deadlocks at DP > EP: two EP groups decide differently and one of them
waits in a world collective the other never joins (``tests/distributed/test_lockstep.py``).
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist

from gspo_megatron.distributed import all_reduce_


class StepKind(enum.IntEnum):
    """What the coupled ranks do next (:func:`next_step`)."""

    DONE = 0
    """No coupled rank has work: the call ends on all of them."""
    MEGATRON = 1
    """Megatron's step (a prefill, admissions, a paused request, blocks short): one forward."""
    ROUND = 2
    """A multi-step round of the fast decoder (:mod:`.rounds`) over this rank's requests."""
    IDLE_ROUND = 3
    """A round's steps on a rank without requests: its experts serve the others'."""
    DUMMY = 4
    """Megatron's ``dummy_forward`` on a rank without requests (its MoE layers' collectives)."""


@dataclasses.dataclass(frozen=True)
class Step:
    """The next step of this rank, decided alike on every coupled rank."""

    kind: StepKind
    steps: int = 1
    """Decoding steps it takes (a round's, the most any coupled rank wants; 1 otherwise)."""
    rows: int = 0
    """A round's: the most requests a coupled rank decodes (the sharded experts' gather rows)."""


def coupled_group(groups):
    """The process group of the ranks whose decoding steps exchange tensors with this rank's
    (None: the world), for a layout with EP > 1: Megatron's expert tensor x expert x pipeline
    group when it holds this rank's tensor-parallel group (the dense layers' all-reduces), else
    the world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_model_pipeline_parallel_group()
    ranks = set(dist.get_process_group_ranks(group))
    tp = set(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
    pp = set(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    return group if tp | pp <= ranks else None


def agree_all(flag: bool, group) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one MIN all-reduce): e.g. that every
    coupled rank has room for the replicated experts."""
    return bool(all_reduce_(torch.tensor([int(flag)]), group, dist.ReduceOp.MIN).item())


def next_step(mine: bool, plan, coupled: bool, fast: bool, group) -> Step:
    """This rank's next step. ``mine``: it has requests running or waiting; ``plan``: the round
    it could run (:meth:`~.rounds.FastDecoder.plan`, None when its next step must be
    Megatron's); ``coupled``: its steps need other ranks' (EP, experts not replicated), which
    then decide with it by one MAX all-reduce over ``group``: a round only when no coupled rank
    with work needs Megatron's step; ``fast``: the fast decoder is on (else only MEGATRON,
    DUMMY or DONE)."""
    ready = plan is not None and plan.blocks_free
    if not coupled:
        if not mine:
            return Step(StepKind.DONE)
        return Step(StepKind.ROUND, plan.steps, plan.n) if ready else Step(StepKind.MEGATRON)
    flags = torch.tensor([int(mine), int(mine and not (ready and fast)),
                          plan.steps if ready and fast else 0, plan.n if ready and fast else 0])
    go, blocked, steps, rows = all_reduce_(flags, group, dist.ReduceOp.MAX).tolist()
    if not go:
        return Step(StepKind.DONE)
    if blocked:
        return Step(StepKind.MEGATRON if mine else StepKind.DUMMY)
    return Step(StepKind.ROUND if mine else StepKind.IDLE_ROUND, max(steps, 1), rows)
