"""DAPO's batch shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", arXiv 2503.14476): dynamic sampling (Sec. 3.2) and overlong handling (Sec. 3.4).

* **Dynamic sampling.** A group whose G rewards all tie has zero advantage for every response
  (Eq. 6: ``r - mean = 0``), so it adds no policy gradient while still counting in the loss
  normaliser: as a verifiable task gets learned, most groups become all-correct or all-wrong and
  a step trains on a fraction of its nominal batch. DAPO drops those groups and samples more
  prompts until the batch is full. The tie rule is the advantages' own
  (:attr:`~.advantages.GroupAdvantageResult.zero_variance_mask`: max == min), stated once.
* **Overlong filtering.** A response cut at the generation budget is not wrong, only unfinished;
  its reward (usually 0) would punish a line of reasoning that may have been right. Its policy
  term is masked out.
* **Soft overlong punishment** (Eq. 13). A length-aware penalty added to the reward over the last
  ``L_cache`` tokens of the budget ``L_max``::

      R_length(y) = 0                                   if |y| <= L_max - L_cache
                    ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    -1                                   if |y| > L_max

  (times ``penalty_factor``; our responses never exceed ``L_max = rollout.max_new_tokens``, so the
  last case cannot occur). ``|y|`` counts the EOS token when one was produced (verl's
  ``valid_response_length`` does too).

Pure torch; the trainer (:meth:`gspo_megatron.trainer.Trainer.sample`) decides when to call what.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

from ..sections import Problem, Section

__all__ = ["DynamicSamplingConfig", "GroupSelection", "OverlongConfig", "mask_truncated",
           "select_groups", "soft_overlong_penalty"]


@dataclass
class DynamicSamplingConfig(Section, name="dynamic_sampling"):
    """DAPO dynamic sampling (arXiv 2503.14476, Sec. 3.2; verl ``algorithm.filter_groups``, slime
    ``--dynamic-sampling-filter-path``): drop prompt groups whose rewards all tie and sample more
    prompts so that every step trains on ``rollout.prompts_per_step`` groups. Off by default."""

    enabled: bool = False
    """Default False (every sampled group is trained on, today's behaviour). True: after each
    rollout batch, groups whose G rewards are all equal are dropped; while any data-parallel rank
    has fewer than ``rollout.prompts_per_step`` groups left, every rank draws and rolls out another
    batch of ``rollout.prompts_per_step`` prompts (all ranks together, so expert-parallel
    collectives stay in lock-step)."""

    max_extra_batches: int = 3
    """Default 3: at most this many extra rollout batches per step (each ``prompts_per_step x
    group_size`` responses; verl's ``max_num_gen_batches`` bounds the total the same way). When the
    bound is reached with too few varied groups, the step is filled with dropped (tied) groups, in
    the order they were sampled: their advantages are 0, so the step trains on fewer effective
    groups, exactly as without dynamic sampling, and ``sampling/filled_groups`` says how many.
    Training never stops for it (verl raises instead)."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(0, "max_extra_batches")


@dataclass
class OverlongConfig(Section, name="overlong"):
    """Responses cut at ``rollout.max_new_tokens`` (DAPO, arXiv 2503.14476, Sec. 3.4). Both off by
    default; they combine (the penalty shapes the rewards, the mask then drops truncated
    responses' policy term)."""

    mask_truncated: bool = False
    """Default False. True: DAPO's overlong filtering: a response that hit ``max_new_tokens``
    without EOS gets advantage 0 after group normalisation (it still counts in its group's mean
    and std, and in the loss normaliser, like every masked term here; it gives no policy
    gradient)."""

    buffer_tokens: int = 0
    """Default 0 (no penalty). ``L_cache`` of DAPO's soft overlong punishment (Eq. 13): a response
    longer than ``max_new_tokens - buffer_tokens`` tokens loses ``penalty_factor x (excess /
    buffer_tokens)`` reward, up to ``penalty_factor`` at the budget. DAPO used 4096 of a 20480
    budget (verl ``reward_model.overlong_buffer.len``). At most ``rollout.max_new_tokens``."""

    penalty_factor: float = 1.0
    """Default 1.0 (DAPO): the penalty at ``max_new_tokens`` tokens (verl
    ``overlong_buffer.penalty_factor``)."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._at_least(0, "buffer_tokens", note=" (0 = no penalty)")
        if not self.penalty_factor >= 0:
            yield self._problem("penalty_factor", f"must be >= 0, got {self.penalty_factor}")


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int,
                          factor: float = 1.0) -> torch.Tensor:
    """DAPO Eq. 13 (times ``factor``): ``[N]`` float64 penalties (<= 0) for response lengths
    ``lengths`` ``[N]`` (tokens, EOS included) under the budget ``max_length`` (``L_max``) and the
    buffer ``buffer`` (``L_cache``, 0 = no penalty)."""
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    free = max_length - buffer  # L_max - L_cache
    penalty = ((free - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return penalty * factor


def mask_truncated(advantages: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: ``advantages`` ``[N]`` with 0 where ``truncated`` ``[N]`` (bool)."""
    return torch.where(truncated.to(advantages.device), torch.zeros_like(advantages), advantages)


class GroupSelection(NamedTuple):
    """Which sampled groups a step trains on (:func:`select_groups`)."""

    chosen: list[tuple[int, int]]
    """``(batch, group)`` of each trained group, in order: varied groups first (in sampling
    order), then tied fillers."""
    kept: int
    """Varied groups among ``chosen``."""
    filled: int
    """Tied groups among ``chosen`` (the bound on extra batches was reached)."""
    dropped: int
    """Tied groups sampled and not trained on."""
    surplus: int
    """Varied groups sampled beyond the ``need`` (discarded, as DAPO does)."""


def select_groups(tied: list[torch.Tensor], need: int) -> GroupSelection:
    """Choose ``need`` groups from the rollout batches of one step. ``tied[b]`` ``[groups_b]``
    (bool) marks batch ``b``'s groups whose rewards all tie. Varied groups are taken in sampling
    order; if fewer than ``need`` exist, the earliest tied groups fill the rest."""
    varied = [(b, g) for b, t in enumerate(tied) for g in range(t.numel()) if not bool(t[g])]
    ties = [(b, g) for b, t in enumerate(tied) for g in range(t.numel()) if bool(t[g])]
    total = len(varied) + len(ties)
    if total < need:
        raise ValueError(f"select_groups: {total} groups sampled, fewer than the {need} needed")
    chosen = varied[:need]
    filled = need - len(chosen)
    chosen += ties[:filled]
    return GroupSelection(chosen, kept=need - filled, filled=filled,
                          dropped=len(ties) - filled, surplus=max(len(varied) - need, 0))
