"""GSPO / GSPO-token / GRPO clipped policy losses (Zheng et al. 2025, arXiv 2507.18071).

Shapes: ``B`` sequences (responses) per call, ``T`` token positions (the local
shard of the sequence under context parallelism). ``response_mask[b, t]`` is
True for response tokens whose log-probs enter the loss.

Normalisation (``loss_normalizer``)
-----------------------------------
The returned loss is ``-(sum of per-sequence objectives) / loss_normalizer``
(``token_mean``: ``-(sum of per-token objectives) / loss_normalizer``).
Defaults: ``B`` (rows of this call, zero-length rows included) for
``gspo``/``gspo_token``/``grpo + seq_mean_token_mean``; the total number of
response tokens of this call (summed over ``cp_group``) for ``token_mean``.
To make the summed losses of microbatches / data-parallel ranks give exactly
the gradient of the whole minibatch, pass the minibatch's total number of
sequences (resp. total response tokens for ``token_mean``) as
``loss_normalizer`` on every microbatch and *sum* the microbatch losses.
The KL term uses the same aggregation and normaliser as the policy term.

Rollout correction (``correction_weights``, :mod:`.rollout_correction`): each sequence's
(``[B]`` weights) or token's (``[B, T]``) contribution to the policy term is multiplied by its
detached weight ``w``; the normaliser is unchanged, so a token or sequence with ``w = 0`` gives
no gradient but still counts in ``|y_i|`` and in ``B`` / the token total. That keeps the
normaliser a function of the batch layout alone (any microbatch / data-parallel split still sums
to the whole minibatch's gradient, and a down-weighted batch is not silently re-scaled up); slime
does the same (its rejection masks zero the numerator while the denominators stay the original
per-rollout token counts), while verl's ``rollout_rs`` drops rejected tokens from its
``response_mask`` and hence from its token-mean normaliser. The KL term is not weighted.

Context parallelism: see :mod:`gspo_megatron.algorithms.reductions`; every CP
rank returns the full (identical) loss and gradients flow to its own shard.
Host syncs: value validation (1), the all-empty-mask check (1), the quantile
metric (1), plus 1 for ``[B, T]`` advantages with ``variant='gspo'``. Value
checks are combined over ``cp_group`` so all CP ranks raise together.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Literal, NamedTuple

import torch
import torch.distributed as dist

from gspo_megatron.sections import Problem, Section

from .reductions import all_reduce_no_grad, all_reduce_sum

__all__ = ["LOG_RATIO_CLAMP", "PolicyLossConfig", "clip_flags", "clipped_positions", "k3",
           "policy_loss", "sequence_log_ratio"]

Variant = Literal["gspo", "gspo_token", "grpo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean"]

_SEQUENCE_VARIANTS = ("gspo", "gspo_token")
# Paper defaults (Sec. 5.1): GSPO(-token) eps_low=3e-4, eps_high=4e-4; GRPO 0.2 / 0.27.
_DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
_SEQUENCE_CLIP_WARN_ABOVE = 1e-2

LOG_RATIO_CLAMP = 20.0
"""Log-ratios (``log s_i``, ``log r_it``) and the k3 log-differences are clamped
to ``[-20, 20]`` before ``exp``. Beyond that the ratio is ~5e8 (or ~2e-9), far
outside any clip range; the clamp keeps values finite and makes the gradient 0
there (instead of ``0 * inf = NaN`` through an overflowed ``exp``)."""


@dataclass(frozen=True)
class PolicyLossConfig(Section, name="loss"):
    """Configuration of :func:`policy_loss` (the ``loss`` section of a recipe). Invalid values
    raise :class:`~gspo_megatron.sections.FieldError` naming the field."""

    variant: Variant = "gspo"
    """``"gspo"``: sequence ratio ``s_i`` (Eq. 7) clipped per sequence (Eq. 5).
    ``"gspo_token"``: GSPO-token (Eq. 13/14), per-token advantages allowed.
    ``"grpo"``: per-token ratio ``r_it`` clipped per token (Eq. 2)."""

    clip_low: float | None = None
    """``eps_low``: lower clip bound is ``1 - clip_low``. ``None`` = paper default
    for the variant (3e-4 for gspo/gspo_token, 0.2 for grpo). Must be in [0, 1)."""

    clip_high: float | None = None
    """``eps_high``: upper clip bound is ``1 + clip_high``. ``None`` = paper default
    (4e-4 for gspo/gspo_token, 0.27 for grpo). Must be >= 0."""

    aggregation: Aggregation = "seq_mean_token_mean"
    """GRPO token aggregation. ``"seq_mean_token_mean"``: mean over each
    sequence's response tokens, then sum over sequences / ``loss_normalizer``
    (default B). ``"token_mean"`` (DAPO): sum over all response tokens /
    ``loss_normalizer`` (default: total response tokens). Sequence-level
    variants only accept ``"seq_mean_token_mean"``."""

    kl_coef: float = 0.0
    """Weight of the k3 KL penalty ``exp(ref - logp) - (ref - logp) - 1`` to the
    reference policy (needs ``ref_logprobs``). 0 disables it."""

    def _problems(self) -> Iterator[Problem]:
        if self.variant in _SEQUENCE_VARIANTS and self.aggregation != "seq_mean_token_mean":
            yield (("aggregation", "variant"),
                   f"'{self.aggregation}' only applies to variant='grpo'; "
                   f"variant={self.variant!r} requires 'seq_mean_token_mean'")
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                yield (name,), f"must be a finite float or None, got {value!r}"
            elif value < 0:
                yield (name,), f"must be >= 0, got {value}"
            elif name == "clip_low" and value >= 1:
                yield (name,), f"must be < 1 (lower bound 1 - clip_low > 0), got {value}"
        if isinstance(self.kl_coef, bool) or not isinstance(self.kl_coef, (int, float)) or not (
            math.isfinite(self.kl_coef) and self.kl_coef >= 0
        ):
            yield ("kl_coef",), f"must be a finite float >= 0, got {self.kl_coef!r}"

    def __post_init__(self) -> None:
        super().__post_init__()
        big = [f"{n}={v}" for n, v in (("clip_low", self.clip_low), ("clip_high", self.clip_high))
               if v is not None and v > _SEQUENCE_CLIP_WARN_ABOVE]
        if self.variant in _SEQUENCE_VARIANTS and big:
            # Python's default filter shows it once per calling line (a run builds its loss
            # config once); no process-wide flag of our own.
            warnings.warn(
                f"PolicyLossConfig(variant={self.variant!r}) got {', '.join(big)}. The GSPO "
                "sequence ratio s_i is a length-normalised geometric mean and stays within "
                "~1e-3 of 1, so its clip range needs ~1e-4-scale eps (paper: 3e-4 / 4e-4). "
                "Token-level GRPO values like 0.2 effectively disable clipping; several "
                "GSPO implementations ship 0.2 by mistake.",
                UserWarning,
                stacklevel=3,
            )

    @property
    def eps_low(self) -> float:
        """Resolved ``clip_low`` (paper default for the variant when None)."""
        return _DEFAULT_CLIP[self.variant][0] if self.clip_low is None else float(self.clip_low)

    @property
    def eps_high(self) -> float:
        """Resolved ``clip_high`` (paper default for the variant when None)."""
        return _DEFAULT_CLIP[self.variant][1] if self.clip_high is None else float(self.clip_high)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _validate(logprobs: Any, old_logprobs: Any, advantages: Any, response_mask: Any, config: Any,
              ref_logprobs: Any, entropy: Any, loss_normalizer: Any, cp_group: Any,
              weights: Any = None) -> torch.Tensor:
    """Check types/shapes/values; return the mask as bool ``[B, T]``."""
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages,
             "response_mask": response_mask, "ref_logprobs": ref_logprobs, "entropy": entropy,
             "correction_weights": weights}
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {_shape(logprobs)}")
    bt = _shape(logprobs)
    for name in ("old_logprobs", "response_mask", "ref_logprobs", "entropy"):
        t = named[name]
        if t is not None and _shape(t) != bt:
            raise ValueError(f"{name} shape {_shape(t)} does not match logprobs shape {bt} ([B, T])")
    if _shape(advantages) not in (bt[:1], bt):
        raise ValueError(
            f"advantages must be [B]={bt[:1]} or [B, T]={bt} (matching logprobs), "
            f"got shape {_shape(advantages)}"
        )
    if weights is not None and _shape(weights) not in (bt[:1], bt):
        raise ValueError(f"correction_weights must be [B]={bt[:1]} or [B, T]={bt}, "
                         f"got shape {_shape(weights)}")
    for name in ("logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy",
                 "correction_weights"):
        t = named[name]
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when kl_coef > 0 (kl_coef={config.kl_coef})")
    if loss_normalizer is not None and not (
        isinstance(loss_normalizer, (int, float)) and not isinstance(loss_normalizer, bool)
        and math.isfinite(loss_normalizer) and loss_normalizer > 0
    ):
        raise ValueError(f"loss_normalizer must be a finite number > 0 or None, got {loss_normalizer!r}")

    if response_mask.dtype == torch.bool:
        mask = response_mask
        bad_mask = torch.zeros((), dtype=torch.bool, device=mask.device)
    else:
        bad_mask = ((response_mask != 0) & (response_mask != 1)).any()
        mask = response_mask != 0
    # One host sync for all value checks (max over cp_group, so every CP rank raises
    # together instead of deadlocking the others); the error path names the culprit.
    checks: list[tuple[str, torch.Tensor]] = [("response_mask", bad_mask)]
    for name in ("logprobs", "old_logprobs", "ref_logprobs", "entropy"):
        if named[name] is not None:
            checks.append((name, (mask & ~torch.isfinite(named[name].detach())).any()))
    adv_finite = torch.isfinite(advantages.detach())
    checks.append(("advantages", (~adv_finite).any() if advantages.dim() == 1 else (mask & ~adv_finite).any()))
    if weights is not None:  # finite and >= 0 (per sequence, or at response positions)
        w = weights.detach()
        bad_w = ~(torch.isfinite(w) & (w >= 0))
        checks.append(("correction_weights", bad_w.any() if w.dim() == 1 else (mask & bad_w).any()))
    flags = all_reduce_no_grad(torch.stack([c for _, c in checks]).to(torch.float32), cp_group).cpu() > 0
    if bool(flags.any()):
        name = checks[int(flags.to(torch.int64).argmax())][0]
        if name == "response_mask":
            raise ValueError("response_mask must be bool or contain only 0/1 values")
        where = "" if name == "advantages" and advantages.dim() == 1 else " at response (masked-in) positions"
        if name == "correction_weights":
            raise ValueError("correction_weights must be finite and >= 0")
        raise ValueError(f"{name} contains NaN or Inf{where}")
    return mask


def sequence_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cp_group: Any | None = None,
) -> torch.Tensor:
    """GSPO Eq. 7 in log space: ``log s_i = (1/|y_i|) sum_t (logp_it - old_logp_it)``.

    Inputs ``[B, T]``; returns ``[B]`` (0 for zero-length responses), differentiable
    w.r.t. ``logprobs``, sums all-reduced over ``cp_group``. Not clamped. The one
    definition of the sequence ratio: :func:`policy_loss` and the routing
    diagnostics (through :func:`clipped_positions`) both call it.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    diff = torch.where(mask, logprobs - old_logprobs.detach(), zero)
    sums = all_reduce_sum(torch.stack([diff.sum(-1), mask.to(diff.dtype).sum(-1)]), cp_group)
    return sums[0] * (1.0 / sums[1].clamp(min=1.0))


def clip_flags(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` takes the clipped
    branch (zero gradient): ``low = A < 0 and ratio < 1 - eps_low``, ``high = A > 0 and
    ratio > 1 + eps_high``. Any matching shapes; detached bool tensors."""
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    return low.detach(), high.detach()


def _clip_objective(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` (Eq. 2 / 5 / 13), and
    where the clipped branch is active (:func:`clip_flags`)."""
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    obj = torch.minimum(ratio * adv, clipped * adv)
    return (obj, *clip_flags(ratio, adv, eps_low, eps_high))


def k3(log_diff: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator ``exp(d) - d - 1`` with ``d = log q - log p`` clamped to
    ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``: >= 0, 0 iff d = 0, in the input's dtype.
    The one definition (KL penalty, ``kl/*`` metrics, rollout mismatch, replay gap)."""
    d = log_diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


class _Prepared(NamedTuple):
    """Inputs of the surrogate in the compute dtype (>= fp32), padding zeroed, with the
    per-sequence quantities every variant needs."""

    logp: torch.Tensor           # [B, T] differentiable
    old: torch.Tensor            # [B, T]
    adv: torch.Tensor            # [B] or [B, T] as given
    adv_tok: torch.Tensor        # [B, T] advantage of each response token
    ref: torch.Tensor | None     # [B, T]
    mask: torch.Tensor           # [B, T] bool
    zero: torch.Tensor           # 0-dim
    seq_len: torch.Tensor        # [B] |y_i| (over cp_group)
    inv_len: torch.Tensor        # [B] 1 / max(|y_i|, 1)
    seq_log_ratio: torch.Tensor  # [B] log s_i (Eq. 7), differentiable
    adv_seq: torch.Tensor        # [B] A_i (the mean over response tokens for [B, T] input)


def _prepare(logprobs, old_logprobs, advantages, mask, ref_logprobs, cp_group) -> _Prepared:
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Padding may hold -inf/NaN: replace it before any arithmetic (where, not *mask).
    logp = torch.where(mask, logprobs.to(dtype), zero)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    adv_in = advantages.detach().to(dtype)
    adv_tok = torch.where(mask, adv_in if adv_in.dim() == 2 else adv_in[:, None].expand_as(logp), zero)
    ref = None if ref_logprobs is None else torch.where(mask, ref_logprobs.detach().to(dtype), zero)
    # Per-sequence sums over cp_group: |y_i| and sum_t A_it.
    sums = all_reduce_no_grad(torch.stack([mask.to(dtype).sum(-1), adv_tok.sum(-1)], dim=-1), cp_group)
    seq_len = sums[:, 0]
    if not bool(seq_len.sum() > 0):
        raise ValueError(f"response_mask has no response tokens (shape {_shape(mask)})")
    inv_len = 1.0 / seq_len.clamp(min=1.0)
    seq_log_ratio = sequence_log_ratio(logp, old, mask, cp_group=cp_group)  # Eq. 7
    adv_seq = adv_in if adv_in.dim() == 1 else sums[:, 1] * inv_len  # A_i
    return _Prepared(logp, old, adv_in, adv_tok, ref, mask, zero, seq_len, inv_len,
                     seq_log_ratio, adv_seq)


def _check_gspo_advantages(x: _Prepared, adv_dim: int, cp_group) -> None:
    """``gspo`` needs one advantage per sequence: ``[B, T]`` input must be constant per row."""
    if adv_dim != 2:
        return
    off = x.mask & ~torch.isclose(x.adv_tok, x.adv_seq[:, None].expand_as(x.adv_tok),
                                  rtol=1e-5, atol=1e-6)
    # reduced so every CP rank raises together (a rank-local raise would deadlock)
    if bool(all_reduce_no_grad(off.sum().to(x.zero.dtype), cp_group) > 0):
        raise ValueError(
            "advantages [B, T] must be constant over each sequence's response tokens "
            "for variant='gspo' (use 'gspo_token' for per-token advantages)"
        )


def _surrogate(x: _Prepared, adv_dim: int, config: PolicyLossConfig, cp_group,
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence objective ``[B]`` (before the normaliser) and the clipped tokens
    ``(low, high)`` ``[B, T]`` of ``config.variant``: the one place the clip rule is applied.
    ``weights`` (detached rollout correction, ``[B]`` or ``[B, T]``, compute dtype) multiply the
    sequence objective or each token's term; None leaves the objective untouched."""
    mask, zero, eps_low, eps_high = x.mask, x.zero, config.eps_low, config.eps_high
    nonempty = x.seq_len > 0
    log_s = x.seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if config.variant == "gspo" and (weights is None or weights.dim() == 1):
        _check_gspo_advantages(x, adv_dim, cp_group)
        s = torch.exp(log_s)  # s_i, Eq. 7
        # Eq. 5: J_i = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); its gradient
        # (Eq. 10) is A_i s_i / |y_i| * grad log pi(y_it) for every token: equal weights.
        obj_seq, low_seq, high_seq = _clip_objective(s, x.adv_seq, eps_low, eps_high)
        seq_obj = torch.where(nonempty, obj_seq, zero)
        if weights is not None:
            seq_obj = seq_obj * weights  # rollout correction: w_i * J_i
        return (seq_obj, (low_seq & nonempty)[:, None] & mask,
                (high_seq & nonempty)[:, None] & mask)
    adv_tok = x.adv_tok
    if config.variant == "gspo":
        # Token weights on GSPO: the GSPO-token form (Eq. 13) with A_it = A_i, whose value, clip
        # decision and unweighted gradient equal GSPO's (Eq. 5 / 10), so w_it acts per token
        # inside the sequence mean: (1/|y_i|) sum_t w_it min(s_it A_i, clip(s_it) A_i).
        _check_gspo_advantages(x, adv_dim, cp_group)
        adv_tok = torch.where(mask, x.adv_seq[:, None].expand_as(x.adv_tok), zero)
    if config.variant in _SEQUENCE_VARIANTS:
        # Eq. 13: s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)] -> value s_i, grad s_i * grad log pi
        ratio_tok = torch.exp(log_s.detach())[:, None] * torch.exp(x.logp - x.logp.detach())
    else:
        # GRPO, Eq. 2: r_it = pi_theta(y_it) / pi_old(y_it)
        ratio_tok = torch.exp((x.logp - x.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    # Eq. 14 / Eq. 2: per-token min(r A, clip(r) A)
    obj_tok, tok_low, tok_high = _clip_objective(ratio_tok, adv_tok, eps_low, eps_high)
    if weights is not None:  # rollout correction: w_it (or w_i) times each token's term
        obj_tok = obj_tok * (weights[:, None] if weights.dim() == 1 else weights)
    obj_sum = all_reduce_sum(torch.where(mask, obj_tok, zero).sum(-1), cp_group)  # [B]
    if config.aggregation == "token_mean":
        seq_obj = obj_sum  # DAPO: token sums, normalised by total tokens below
    else:
        seq_obj = obj_sum * x.inv_len  # (1/|y_i|) sum_t ...  (Eq. 14 / Eq. 2)
    return seq_obj, tok_low & mask, tok_high & mask


@torch.no_grad()
def clipped_positions(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    cp_group: Any | None = None,
) -> torch.Tensor:
    """``[B, T]`` bool: the response tokens whose clipped branch is active in
    :func:`policy_loss` with the same inputs (exactly the set behind its ``clip/*``
    metrics): per sequence for ``gspo`` (every token of a clipped sequence), per
    token for ``gspo_token`` (sequence ratio, token advantage) and ``grpo``."""
    mask = response_mask.bool()
    x = _prepare(logprobs, old_logprobs, advantages, mask, None, cp_group)
    _, low, high = _surrogate(x, advantages.dim(), config, cp_group)
    return low | high


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    cp_group: Any | None = None,
    loss_normalizer: float | None = None,
    correction_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss for GSPO, GSPO-token or GRPO.

    Args:
        logprobs: ``[B, T]`` log pi_theta(y_it | x, y_i,<t); gradients flow here.
        old_logprobs: ``[B, T]`` log-probs of the rollout policy (detached).
        advantages: ``[B]`` per sequence or ``[B, T]`` per token (detached).
            ``gspo`` needs one value per sequence: a ``[B, T]`` tensor must be
            constant over each sequence's response tokens (else ValueError).
        response_mask: ``[B, T]`` bool or 0/1. Rows without response tokens
            contribute 0 loss and 0 gradient; an all-empty mask (over
            ``cp_group``) raises ValueError.
        config: :class:`PolicyLossConfig`.
        ref_logprobs: ``[B, T]`` reference-policy log-probs for the k3 KL term.
        entropy: ``[B, T]`` token entropies, only for the ``entropy/mean`` metric.
        cp_group: context-parallel group; each rank passes its ``T`` shard.
        loss_normalizer: see the module docstring (default B, or total response
            tokens for ``token_mean``).
        correction_weights: rollout/training mismatch weights (detached, finite,
            >= 0; :func:`~.rollout_correction.correction_weights`), None = no
            correction. ``[B]``: sequence ``i``'s objective is multiplied by
            ``w_i`` (``gspo``: ``w_i J_i``, Eq. 5; ``gspo_token``/``grpo``: every
            token term of row ``i``). ``[B, T]``: each token's term
            ``min(r A, clip(r) A)`` is multiplied by ``w_it`` before the
            aggregation (``gspo`` then uses the GSPO-token form, Eq. 13 with
            ``A_it = A_i``, whose value and clip decision equal GSPO's). The
            normaliser, the KL term and the ``clip/*`` / ``ratio/*`` metrics
            are unchanged (module docstring).

    Returns:
        ``(loss, metrics)``: scalar loss = policy term + ``kl_coef`` * KL term,
        and a dict of detached 0-dim tensors (identical on all CP ranks, not
        reduced over data parallelism): ``loss/policy``, ``loss/kl`` (KL term
        before ``kl_coef``, same normaliser), ``loss/total``, ``kl/ref_k3``
        (token mean), ``kl/old_k3``, ``clip/fraction`` (+ ``_low``/``_high``;
        per sequence for gspo, mean over sequences of the per-token clipped
        share for gspo_token, per token for grpo), ``clip/token_fraction``
        (token-weighted; every token of a clipped GSPO sequence counts),
        ``ratio/mean|min|max`` (``s_i`` over non-empty sequences for
        gspo/gspo_token, ``r_it`` over response tokens for grpo),
        ``ratio/seq_log_ratio_p05|p50|p95`` (``log s_i``), ``response/empty_fraction`` and
        ``entropy/mean``. Padding is excluded from every metric.
    """
    mask = _validate(logprobs, old_logprobs, advantages, response_mask, config,
                     ref_logprobs, entropy, loss_normalizer, cp_group, correction_weights)
    x = _prepare(logprobs, old_logprobs, advantages, mask, ref_logprobs, cp_group)
    logp, old, ref, zero = x.logp, x.old, x.ref, x.zero
    dtype = logp.dtype
    use_kl = ref is not None and config.kl_coef > 0
    kl_sum = None
    if use_kl:  # Eq. k3 per sequence: sum_t exp(ref-logp)-(ref-logp)-1
        kl_sum = all_reduce_sum(k3(ref - logp).mul(mask.to(dtype)).sum(-1), cp_group)
    weights = None
    if correction_weights is not None:  # detached; padding (possibly junk) zeroed
        weights = correction_weights.detach().to(dtype)
        weights = weights if weights.dim() == 1 else torch.where(mask, weights, zero)
    seq_obj, tok_low, tok_high = _surrogate(x, advantages.dim(), config, cp_group, weights)
    seq_len, total_tokens, inv_len = x.seq_len, x.seq_len.sum(), x.inv_len

    token_mean = config.aggregation == "token_mean"
    if loss_normalizer is None:
        normalizer = total_tokens if token_mean else torch.tensor(float(logp.shape[0]), dtype=dtype)
    else:
        normalizer = torch.tensor(float(loss_normalizer), dtype=dtype)
    normalizer = normalizer.to(logp.device)
    loss_pol = -seq_obj.sum() / normalizer  # negative objective
    loss = loss_pol
    kl_term = None
    if use_kl:
        kl_seq = kl_sum if token_mean else kl_sum * inv_len  # same aggregation as policy
        kl_term = kl_seq.sum() / normalizer
        loss = loss + config.kl_coef * kl_term

    metrics = _metrics(config, mask, seq_len, x.seq_log_ratio.detach(), tok_low, tok_high,
                       logp.detach(), old, ref, entropy, cp_group)
    metrics["loss/policy"] = loss_pol.detach()
    metrics["loss/total"] = loss.detach()
    if kl_term is not None:
        metrics["loss/kl"] = kl_term.detach()
    return loss, metrics


def _metrics(config: PolicyLossConfig, mask: torch.Tensor, seq_len: torch.Tensor,
             seq_log_ratio: torch.Tensor, tok_low: torch.Tensor, tok_high: torch.Tensor,
             logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
             entropy: torch.Tensor | None, cp_group: Any | None) -> dict[str, torch.Tensor]:
    """Detached metrics; token sums are all-reduced over ``cp_group`` in one call."""
    dtype = logp.dtype
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    nonempty, total_tokens = seq_len > 0, seq_len.sum()
    r_tok = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    cols = [tok_low.to(dtype).sum(-1), tok_high.to(dtype).sum(-1),
            torch.where(mask, k3(old - logp), zero).sum(-1),
            torch.where(mask, r_tok, zero).sum(-1)]
    if ref is not None:
        cols.append(torch.where(mask, k3(ref - logp), zero).sum(-1))
    if entropy is not None:
        cols.append(torch.where(mask, entropy.detach().to(dtype), zero).sum(-1))
    sums = all_reduce_no_grad(torch.stack(cols, dim=-1), cp_group)  # [B, k]
    low_tok, high_tok = sums[:, 0], sums[:, 1]
    n_seq = nonempty.to(dtype).sum()
    inv_len = 1.0 / seq_len.clamp(min=1.0)
    m: dict[str, torch.Tensor] = {}
    if config.variant == "grpo":
        m["clip/fraction_low"] = low_tok.sum() / total_tokens
        m["clip/fraction_high"] = high_tok.sum() / total_tokens
        big = torch.finfo(dtype).max
        ext = all_reduce_no_grad(
            torch.stack([torch.where(mask, r_tok, -big).amax() if mask.numel() else zero - big,
                         torch.where(mask, -r_tok, -big).amax() if mask.numel() else zero - big]),
            cp_group, op=dist.ReduceOp.MAX)
        m["ratio/mean"] = sums[:, 3].sum() / total_tokens
        m["ratio/min"], m["ratio/max"] = -ext[1], ext[0]
    else:
        # gspo: per-token flags are whole sequences, so this is the sequence share.
        m["clip/fraction_low"] = (low_tok * inv_len).sum() / n_seq
        m["clip/fraction_high"] = (high_tok * inv_len).sum() / n_seq
        s = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        m["ratio/mean"] = torch.where(nonempty, s, zero).sum() / n_seq
        m["ratio/min"] = torch.where(nonempty, s, torch.full_like(s, math.inf)).min()
        m["ratio/max"] = torch.where(nonempty, s, torch.full_like(s, -math.inf)).max()
    m["clip/fraction"] = m["clip/fraction_low"] + m["clip/fraction_high"]
    m["clip/token_fraction"] = (low_tok.sum() + high_tok.sum()) / total_tokens
    q = torch.quantile(seq_log_ratio[nonempty], torch.tensor([0.05, 0.5, 0.95], dtype=dtype, device=logp.device))
    m["ratio/seq_log_ratio_p05"], m["ratio/seq_log_ratio_p50"], m["ratio/seq_log_ratio_p95"] = q.unbind(0)
    m["kl/old_k3"] = sums[:, 2].sum() / total_tokens
    col = 4
    if ref is not None:
        m["kl/ref_k3"] = sums[:, col].sum() / total_tokens
        col += 1
    if entropy is not None:
        m["entropy/mean"] = sums[:, col].sum() / total_tokens
    m["response/empty_fraction"] = 1.0 - n_seq / seq_len.numel()
    return {k: v.detach() for k, v in m.items()}
