"""The policy loss of any registered variant (:mod:`.losses`: GSPO, GSPO-token, GRPO, SAPO,
CISPO, GMPO, GPG): input checks, the aggregation's normaliser, the KL term and the metrics, the
same for every loss; the loss's own module supplies its surrogate.

Shapes: ``B`` sequences (responses) per call, ``T`` token positions (the local
shard of the sequence under context parallelism). ``response_mask[b, t]`` is
True for response tokens whose log-probs enter the loss.

Normalisation (``loss_normalizer``)
-----------------------------------
The returned loss is ``-(sum of per-sequence objectives) / loss_normalizer``, each sequence's
objective already aggregated over its tokens (:mod:`.losses.aggregations`: a token mean or a token
sum). Defaults by the aggregation's normaliser: ``B`` (rows of this call, zero-length rows
included) for ``seq_mean_token_mean`` / ``seq_mean_token_sum``; the total number of response
tokens of this call (summed over ``cp_group``) for ``token_mean``; ``B * T`` (``T`` the padded
width summed over ``cp_group``, verl's default horizon) for ``seq_mean_token_sum_norm``, whose
constant a caller normally gives (the response budget, ``B * L``). To make the summed losses of
microbatches / data-parallel ranks give exactly the gradient of the whole minibatch, pass the
minibatch's total (sequences, response tokens, or sequences x budget) as ``loss_normalizer`` on
every microbatch and *sum* the microbatch losses. The KL term uses the same aggregation and
normaliser as the policy term.

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
metric (1), plus 1 for ``[B, T]`` advantages with ``variant='gspo'`` or ``'geo_mean'``. Value
checks are combined over ``cp_group`` so all CP ranks raise together.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .losses import AGGREGATIONS, LossInputs, PolicyLossConfig, Surrogate
from .losses.base import LOG_RATIO_CLAMP, clip_flags, k3, sequence_log_ratio
from .reductions import all_reduce_no_grad, all_reduce_sum, group_world_size

__all__ = ["LOG_RATIO_CLAMP", "PolicyLossConfig", "clip_flags", "clipped_positions", "k3",
           "policy_loss", "sequence_log_ratio"]


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


def _prepare(logprobs, old_logprobs, advantages, mask, ref_logprobs, cp_group) -> LossInputs:
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
    seq_log_ratio = sequence_log_ratio(logp, old, mask, cp_group=cp_group)  # GSPO Eq. 7
    adv_seq = adv_in if adv_in.dim() == 1 else sums[:, 1] * inv_len  # A_i
    return LossInputs(logp, old, adv_in, adv_tok, ref, mask, zero, seq_len, inv_len,
                      seq_log_ratio, adv_seq, cp_group)


def _surrogate(x: LossInputs, config: PolicyLossConfig,
               weights: torch.Tensor | None = None) -> Surrogate:
    """The variant's surrogate (its module's ``LOSS``) with its resolved knobs and aggregation:
    the one place a loss's rule is applied."""
    return config.spec.surrogate(x, config.params, weights,
                                 AGGREGATIONS[config.resolved_aggregation])


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
    token for the others (GMPO: the tokens whose log-ratio is clipped; CISPO: whose weight
    is capped); none for the losses without a hard clip (``sapo``, ``gpg``)."""
    mask = response_mask.bool()
    x = _prepare(logprobs, old_logprobs, advantages, mask, None, cp_group)
    sur = _surrogate(x, config)
    return sur.low | sur.high


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
    """The policy-gradient loss of ``config.variant`` (any registered loss).

    Args:
        logprobs: ``[B, T]`` log pi_theta(y_it | x, y_i,<t); gradients flow here.
        old_logprobs: ``[B, T]`` log-probs of the rollout policy (detached).
        advantages: ``[B]`` per sequence or ``[B, T]`` per token (detached).
            ``gspo`` and ``geo_mean`` need one value per sequence: a ``[B, T]`` tensor must
            be constant over each sequence's response tokens (else ValueError).
        response_mask: ``[B, T]`` bool or 0/1. Rows without response tokens
            contribute 0 loss and 0 gradient; an all-empty mask (over
            ``cp_group``) raises ValueError.
        config: :data:`PolicyLossConfig`.
        ref_logprobs: ``[B, T]`` reference-policy log-probs for the k3 KL term.
        entropy: ``[B, T]`` token entropies, only for the ``entropy/mean`` metric.
        cp_group: context-parallel group; each rank passes its ``T`` shard.
        loss_normalizer: see the module docstring (default by the aggregation).
        correction_weights: rollout/training mismatch weights (detached, finite,
            >= 0; :func:`~.rollout_correction.correction_weights`), None = no
            correction. ``[B]``: sequence ``i``'s objective is multiplied by
            ``w_i`` (``gspo``: ``w_i J_i``, Eq. 5; token-level losses: every
            token term of row ``i``). ``[B, T]``: each token's term is multiplied by
            ``w_it`` before the aggregation (``gspo`` then uses the GSPO-token form, Eq. 13
            with ``A_it = A_i``, whose value and clip decision equal GSPO's; ``geo_mean``
            weights each sequence by the geometric mean of its ``w_it``). The
            normaliser, the KL term and the ``clip/*`` / ``ratio/*`` metrics
            are unchanged (module docstring).

    Returns:
        ``(loss, metrics)``: scalar loss = policy term + ``kl_coef`` * KL term,
        and a dict of detached 0-dim tensors (identical on all CP ranks, not
        reduced over data parallelism): ``loss/policy``, ``loss/kl`` (KL term
        before ``kl_coef``, same normaliser), ``loss/total``, ``kl/ref_k3``
        (token mean), ``kl/old_k3``; for a loss with a hard clip ``clip/fraction``
        (+ ``_low``/``_high``; per sequence for gspo, mean over sequences of the per-token
        clipped share for the sequence-level gspo_token / geo_mean, per token for the
        token-level losses) and ``clip/token_fraction`` (token-weighted; every token of a
        clipped GSPO sequence counts); the loss's own (``clip/fraction_dual`` of GRPO's dual
        clip, ``gate/weight_mean`` of SAPO); ``ratio/mean|min|max`` (``s_i`` over non-empty
        sequences for the sequence-level losses, ``r_it`` over response tokens for the
        token-level ones), ``ratio/seq_log_ratio_p05|p50|p95`` (``log s_i``),
        ``response/empty_fraction`` and ``entropy/mean``. Padding is excluded from every metric.
    """
    mask = _validate(logprobs, old_logprobs, advantages, response_mask, config,
                     ref_logprobs, entropy, loss_normalizer, cp_group, correction_weights)
    x = _prepare(logprobs, old_logprobs, advantages, mask, ref_logprobs, cp_group)
    logp, old, ref, zero = x.logp, x.old, x.ref, x.zero
    dtype = logp.dtype
    aggregation = AGGREGATIONS[config.resolved_aggregation]
    use_kl = ref is not None and config.kl_coef > 0
    kl_sum = None
    if use_kl:  # Eq. k3 per sequence: sum_t exp(ref-logp)-(ref-logp)-1
        kl_sum = all_reduce_sum(k3(ref - logp).mul(mask.to(dtype)).sum(-1), cp_group)
    weights = None
    if correction_weights is not None:  # detached; padding (possibly junk) zeroed
        weights = correction_weights.detach().to(dtype)
        weights = weights if weights.dim() == 1 else torch.where(mask, weights, zero)
    sur = _surrogate(x, config, weights)
    seq_len, total_tokens, inv_len = x.seq_len, x.seq_len.sum(), x.inv_len

    if loss_normalizer is not None:
        normalizer = torch.tensor(float(loss_normalizer), dtype=dtype)
    elif aggregation.normalizer == "tokens":
        normalizer = total_tokens
    elif aggregation.normalizer == "sequences":
        normalizer = torch.tensor(float(logp.shape[0]), dtype=dtype)
    else:  # B x the padded width (over cp_group): verl's default horizon for Dr. GRPO
        normalizer = torch.tensor(float(logp.shape[0] * logp.shape[1] * group_world_size(cp_group)),
                                  dtype=dtype)
    normalizer = normalizer.to(logp.device)
    loss_pol = -sur.seq_obj.sum() / normalizer  # negative objective
    loss = loss_pol
    kl_term = None
    if use_kl:
        # same aggregation as the policy term
        kl_seq = kl_sum if aggregation.per_sequence == "sum" else kl_sum * inv_len
        kl_term = kl_seq.sum() / normalizer
        loss = loss + config.kl_coef * kl_term

    metrics = _metrics(config, mask, seq_len, x.seq_log_ratio.detach(), sur, logp.detach(), old,
                       ref, entropy, cp_group)
    metrics["loss/policy"] = loss_pol.detach()
    metrics["loss/total"] = loss.detach()
    if kl_term is not None:
        metrics["loss/kl"] = kl_term.detach()
    return loss, metrics


def _metrics(config: PolicyLossConfig, mask: torch.Tensor, seq_len: torch.Tensor,
             seq_log_ratio: torch.Tensor, sur: Surrogate, logp: torch.Tensor, old: torch.Tensor,
             ref: torch.Tensor | None, entropy: torch.Tensor | None,
             cp_group: Any | None) -> dict[str, torch.Tensor]:
    """Detached metrics; token sums are all-reduced over ``cp_group`` in one call."""
    spec = config.spec
    dtype = logp.dtype
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    nonempty, total_tokens = seq_len > 0, seq_len.sum()
    r_tok = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    cols = [sur.low.to(dtype).sum(-1), sur.high.to(dtype).sum(-1),
            torch.where(mask, k3(old - logp), zero).sum(-1),
            torch.where(mask, r_tok, zero).sum(-1)]
    if ref is not None:
        cols.append(torch.where(mask, k3(ref - logp), zero).sum(-1))
    if entropy is not None:
        cols.append(torch.where(mask, entropy.detach().to(dtype), zero).sum(-1))
    cols.extend(torch.where(mask, v.to(dtype), zero).sum(-1) for v in sur.token_means.values())
    sums = all_reduce_no_grad(torch.stack(cols, dim=-1), cp_group)  # [B, k]
    low_tok, high_tok = sums[:, 0], sums[:, 1]
    n_seq = nonempty.to(dtype).sum()
    inv_len = 1.0 / seq_len.clamp(min=1.0)
    m: dict[str, torch.Tensor] = {}
    if spec.level == "token":
        if spec.clips:
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
        if spec.clips:
            # gspo: per-token flags are whole sequences, so this is the sequence share.
            m["clip/fraction_low"] = (low_tok * inv_len).sum() / n_seq
            m["clip/fraction_high"] = (high_tok * inv_len).sum() / n_seq
        s = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        m["ratio/mean"] = torch.where(nonempty, s, zero).sum() / n_seq
        m["ratio/min"] = torch.where(nonempty, s, torch.full_like(s, math.inf)).min()
        m["ratio/max"] = torch.where(nonempty, s, torch.full_like(s, -math.inf)).max()
    if spec.clips:
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
        col += 1
    for i, name in enumerate(sur.token_means):
        m[name] = sums[:, col + i].sum() / total_tokens
    m["response/empty_fraction"] = 1.0 - n_seq / seq_len.numel()
    return {k: v.detach() for k, v in m.items()}
