"""TRL's GRPO-trainer loss, transcribed for the equality tests of tests/unit/test_loss_peers.py.

Source: huggingface/trl, trl/trainer/grpo_trainer.py at commit
f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24): the loss part of
``GRPOTrainer._compute_loss`` for ``loss_type`` in grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo
with ``importance_sampling_level`` token or sequence and the k3 KL term (``beta``). TRL is
licensed under the Apache License 2.0 (Copyright The HuggingFace Team); this is a transcription of
that arithmetic, in the same order of operations, for one process and one gradient-accumulation
step (``num_items_in_batch`` = the batch's response tokens, ``num_processes = 1``, no vLLM
importance sampling, no entropy mask, no off-policy mask, no two-sided ``delta``); metrics and
the entropy bonus are dropped. Only what the tests compare is here.
"""

from __future__ import annotations

import torch


def grpo_trainer_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type,
                      importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2,
                      sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, beta=0.0,
                      ref_per_token_logps=None, max_completion_length=None):
    """The scalar loss TRL back-propagates. ``advantages`` ``[B]``; the rest ``[B, T]``."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    else:
        raise ValueError(importance_sampling_level)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                        - (ref_per_token_logps - per_token_logps) - 1)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    else:
        raise ValueError(loss_type)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type in ("cispo", "dapo"):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "luspo":
        return (per_token_loss * mask.sum(1, keepdim=True)).mean()
    raise ValueError(loss_type)
