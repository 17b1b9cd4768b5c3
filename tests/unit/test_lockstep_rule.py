"""The step kinds of :func:`~gspo_megatron.backends.megatron.engine.lockstep.next_step` on one
rank (its all-reduce a no-op): a rank alone runs a round when its plan has blocks, Megatron's step
otherwise, and is done without work; a coupled rank without work idles through the round the
others agreed on, or runs Megatron's dummy forward. (The collective over two EP groups that
decide differently: ``tests/distributed/test_lockstep.py``.)"""

from types import SimpleNamespace

from gspo_megatron.backends.megatron.engine.lockstep import Step, StepKind, agree_all, next_step


def plan(steps=7, n=5, blocks_free=True):
    return SimpleNamespace(steps=steps, n=n, blocks_free=blocks_free)


def test_step_kinds_alone_and_coupled():
    alone = dict(coupled=False, fast=True, group=None)
    assert next_step(False, None, **alone) == Step(StepKind.DONE)
    assert next_step(True, None, **alone) == Step(StepKind.MEGATRON)
    assert next_step(True, plan(blocks_free=False), **alone) == Step(StepKind.MEGATRON)
    assert next_step(True, plan(), **alone) == Step(StepKind.ROUND, 7, 5)
    coupled = dict(coupled=True, fast=True, group=None)
    assert next_step(True, plan(), **coupled) == Step(StepKind.ROUND, 7, 5)
    assert next_step(True, None, **coupled) == Step(StepKind.MEGATRON)
    assert next_step(False, None, **coupled) == Step(StepKind.DONE)
    # without the fast decoder: Megatron's step (or the dummy forward) at every step
    assert next_step(True, plan(), coupled=True, fast=False, group=None) == \
        Step(StepKind.MEGATRON)
    assert agree_all(True, None) and not agree_all(False, None)
