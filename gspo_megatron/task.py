"""What a run learns from: the prompts, the tokenizer that encodes them and the reward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Task:
    """What a run learns from: prompts, the tokenizer that encodes them and the reward."""

    tokenizer: Any
    """Encodes prompts (with their chat template) and decodes responses for the reward."""
    sampler: Any
    """Yields each step's training prompts, all data-parallel ranks' (this rank takes its
    slice); its ``state_dict`` is checkpointed (:class:`gspo_megatron.data.PromptSampler`)."""
    train: list
    """Training prompt examples (the supervised warm-up reads them too)."""
    eval: list
    """Held-out prompt examples (greedy accuracy, sampled mean@n / pass@k)."""
    reward_fn: Callable
    """The reward (:func:`gspo_megatron.rewards.get_reward_fn`)."""
    reward_workers: Any = None
    """The reward process pool (:mod:`gspo_megatron.rewards.workers`), stopped by
    :meth:`~gspo_megatron.trainer.Trainer.close`; None: rewards run in this process."""
    episodes: Any = None
    """Multi-turn rollouts (:class:`~gspo_megatron.envs.turns.Episodes`, ``multi_turn.env``),
    closed by :meth:`~gspo_megatron.trainer.Trainer.close`; None: one turn per response."""
