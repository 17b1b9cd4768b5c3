"""verl's policy losses, transcribed for the equality tests of tests/unit/test_loss_peers.py.

Source: verl-project/verl, verl/trainer/ppo/core_algos.py at commit
1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22): ``agg_loss``,
``compute_policy_loss_vanilla`` (dual clip ``clip_ratio_c``), ``compute_policy_loss_sapo``,
``compute_policy_loss_gpg``, ``compute_policy_loss_geo_mean``, ``compute_policy_loss_cispo``, and
verl/utils/torch_functional.py ``masked_sum`` / ``masked_mean``. verl is licensed under the Apache
License 2.0 (Copyright 2024 Bytedance Ltd. and/or its affiliates); this is a transcription of
those functions' arithmetic, in the same order of operations, with verl's config objects replaced
by arguments, the single-process (``dp_size = 1``) path of ``agg_loss`` only, and the metrics
dropped. Only what the tests compare is here.
"""

from __future__ import annotations

import torch


def masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, global_batch_size=None, loss_scale_factor=None):
    """``agg_loss`` with ``dp_size = 1`` and ``batch_num_tokens`` = the mask's sum."""
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size
    raise ValueError(loss_agg_mode)


def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low,
            clip_ratio_high, clip_ratio_c=3.0, rollout_is_weights=None, **agg):
    """``compute_policy_loss_vanilla``: PPO clip with the dual clip ``clip_ratio_c`` for A < 0."""
    assert clip_ratio_c > 1.0
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **agg)


def sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos=1.0, tau_neg=1.05,
         rollout_is_weights=None, **agg):
    """``compute_policy_loss_sapo`` (always seq-mean-token-mean)."""
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg)


def gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
        rollout_is_weights=None, **agg):
    """``compute_policy_loss_gpg``: -log pi * A."""
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **agg)


def geo_mean(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
             rollout_is_weights=None):
    """``compute_policy_loss_geo_mean`` (GMPO; its loss_agg_mode is unused)."""
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -clip_ratio_low, clip_ratio_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl,
                                       sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1)
                      / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp((torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1)
                                   / (response_mask_sum + 1e-8))
        pg_losses = pg_losses * seq_is_weights
    return torch.mean(pg_losses)


def cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
          loss_agg_mode="token-mean", rollout_is_weights=None, **agg):
    """``compute_policy_loss_cispo``: -sg(clip(r)) * A * log pi."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **agg)
