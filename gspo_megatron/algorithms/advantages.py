"""Group-relative advantages (GSPO paper, Zheng et al. 2025, Eq. 6).

For a prompt ``x`` with ``G`` sampled responses ``y_1..y_G`` and rewards
``r(x, y_i)``::

    A_i = (r(x, y_i) - mean({r(x, y_j)}_{j=1..G})) / std({r(x, y_j)}_{j=1..G})   (Eq. 6)

Conventions chosen here (tested in ``tests/unit/test_advantages.py``):

* ``std`` is the **population** standard deviation (``unbiased=False``, divide
  by ``G``). It is defined for ``G = 1`` (it is 0), and it is what Eq. 6's
  ``std({r})`` of a finite set means literally. Peers that use ``torch.std``'s
  default (sample std, divide by ``G - 1``) produce advantages smaller by a
  factor ``sqrt((G - 1) / G)``.
* ``eps`` is added to the std: ``(r - mean) / (std + eps)``.
* A group is *zero-variance* when all its rewards are exactly equal (max == min);
  this includes every group when ``group_size == 1``. Its advantages are
  exactly ``0.0`` (not ``~1e-11`` from rounding in the mean), never NaN, and the
  group is reported in ``zero_variance_mask`` / ``num_zero_variance_groups`` and
  the ``reward/zero_variance_group_fraction`` metric.
* ``normalize_std=False`` gives the Dr. GRPO style ``A_i = r_i - mean``.
* Statistics are computed in float64 and the advantages are returned in the
  rewards' floating dtype (float32 when rewards are integer/bool). If the result
  does not fit that dtype a ``ValueError`` naming ``rewards`` is raised.

Rewards are laid out group-major: ``rewards[g * group_size + k]`` is response
``k`` of prompt ``g``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["GroupAdvantageResult", "group_advantages"]


@dataclass(frozen=True)
class GroupAdvantageResult:
    """Output of :func:`group_advantages`."""

    advantages: torch.Tensor
    """``[N]`` per-response advantages, ``N = num_groups * group_size``."""

    group_mean: torch.Tensor
    """``[num_groups]`` float64 mean reward of each group."""

    group_std: torch.Tensor
    """``[num_groups]`` float64 population std (``unbiased=False``) of each group."""

    zero_variance_mask: torch.Tensor
    """``[num_groups]`` bool, True where all rewards of the group are equal
    (their advantages are exactly 0 and carry no learning signal)."""

    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-dim tensors namespaced ``reward/``: ``mean``, ``std``
    (population std over all N rewards), ``min``, ``max``, ``group_std_mean``,
    ``zero_variance_group_fraction``, ``zero_variance_groups``."""

    @property
    def num_zero_variance_groups(self) -> int:
        """Number of zero-variance groups (host sync)."""
        return int(self.zero_variance_mask.sum().item())

    @property
    def group_size(self) -> int:
        return self.advantages.numel() // max(self.zero_variance_mask.numel(), 1)


def _check_args(rewards: object, group_size: object, eps: object) -> None:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [N] (N = num_prompts * group_size), got shape {tuple(rewards.shape)}"
        )
    n = rewards.numel()
    if n == 0:
        raise ValueError("rewards is empty; need N = num_prompts * group_size > 0")
    if n % group_size != 0:
        raise ValueError(
            f"rewards has N={n} elements, which is not divisible by group_size={group_size}"
        )
    if rewards.is_complex():
        raise ValueError(f"rewards must be real-valued, got dtype {rewards.dtype}")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> GroupAdvantageResult:
    """Group-normalised advantages (paper Eq. 6).

    Args:
        rewards: ``[N]`` rewards, group-major, ``N = num_prompts * group_size``.
        group_size: responses per prompt ``G`` (>= 1).
        normalize_std: divide by ``std + eps`` (GSPO/GRPO). ``False`` gives
            ``r - mean`` (Dr. GRPO).
        eps: added to the population std.

    Returns:
        :class:`GroupAdvantageResult` with ``advantages [N]`` and group stats.

    Raises:
        ValueError: naming ``rewards``/``group_size``/``eps`` for a non-1-D or
            empty ``rewards``, N not divisible by ``group_size``, ``group_size < 1``,
            non-finite rewards, or advantages that overflow the output dtype.
    """
    _check_args(rewards, group_size, eps)
    r64 = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(r64).all()):
        bad = (~torch.isfinite(r64)).nonzero().flatten()[:5].tolist()
        raise ValueError(f"rewards contains NaN or Inf (first bad indices: {bad})")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()

    groups = r64.view(-1, group_size)  # [num_groups, G]
    # Work in units of each group's max |r| so rewards near the float64 limit
    # cannot overflow the mean / variance; results are rescaled at the end.
    scale = groups.abs().amax(dim=1, keepdim=True).clamp(min=1.0)  # [num_groups, 1]
    scaled = groups / scale
    mean_s = scaled.mean(dim=1, keepdim=True)
    centered_s = scaled - mean_s  # (r - mean) / scale
    std_s = centered_s.pow(2).mean(dim=1, keepdim=True).sqrt()  # population std / scale
    group_mean = mean_s * scale
    group_std = std_s * scale
    zero_var = groups.amax(dim=1) == groups.amin(dim=1)  # [num_groups] bool

    if normalize_std:
        adv = centered_s / (std_s + eps / scale)  # Eq. 6: (r - mean) / (std + eps)
    else:
        adv = centered_s * scale  # Dr. GRPO: r - mean, no std normalisation
    adv = torch.where(zero_var[:, None], torch.zeros_like(adv), adv)
    advantages = adv.reshape(-1).to(out_dtype)
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError(
            "rewards: advantages overflow dtype "
            f"{out_dtype} (reward range too large; pass float64 rewards or rescale them)"
        )

    gscale = r64.abs().max().clamp(min=1.0)
    flat_s = r64 / gscale
    metrics = {
        "reward/mean": flat_s.mean() * gscale,
        "reward/std": (flat_s - flat_s.mean()).pow(2).mean().sqrt() * gscale,
        "reward/min": r64.min(),
        "reward/max": r64.max(),
        "reward/group_std_mean": (std_s * (scale / gscale)).mean() * gscale,
        "reward/zero_variance_group_fraction": zero_var.to(torch.float64).mean(),
        "reward/zero_variance_groups": zero_var.sum().to(torch.float64),
    }
    return GroupAdvantageResult(
        advantages=advantages,
        group_mean=group_mean.squeeze(1),
        group_std=group_std.squeeze(1),
        zero_variance_mask=zero_var,
        metrics={k: v.detach() for k, v in metrics.items()},
    )
