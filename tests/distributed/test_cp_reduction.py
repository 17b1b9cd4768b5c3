"""Context-parallel policy loss (every registered loss) over 2 gloo processes vs. a
single-process float64 run.

Each rank holds half of the T dimension of every sequence; losses are computed
with ``cp_group`` and must equal the single-process loss, and the gradient of
each rank's shard must equal the matching slice of the single-process gradient
(this checks the identity-backward all-reduce). One sequence has all of its
response tokens on rank 1, so rank 0 sees a locally empty row.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import warm
from tests.helpers.dist import free_port
from gspo_megatron.algorithms import LOSSES, PolicyLossConfig, masked_mean, policy_loss

WORLD = 2
B, T = 5, 12
CASES = [
    # (config, noise of the old log-probs, per-token advantages, token correction weights)
    (PolicyLossConfig(variant="gspo", kl_coef=0.1), 2e-3, False, False),
    (PolicyLossConfig(variant="gspo_token"), 2e-3, True, False),
    (PolicyLossConfig(variant="grpo", kl_coef=0.1), 0.3, True, False),
    (PolicyLossConfig(variant="grpo", aggregation="token_mean"), 0.3, False, False),
    # The registry's other losses and aggregations: every per-sequence sum they take (token
    # sums, GMPO's clipped log-ratio sum and its weights' geometric mean, LUSPO's |y_i|, Dr.
    # GRPO's default B x T horizon) must be the single process's.
    (PolicyLossConfig(variant="grpo", clip_ratio_c=1.3, aggregation="seq_mean_token_sum_norm"),
     0.5, True, True),
    (PolicyLossConfig(variant="gspo", aggregation="seq_mean_token_sum"), 2e-3, False, True),
    (PolicyLossConfig(variant="geo_mean", kl_coef=0.1), 0.3, False, True),
    *((PolicyLossConfig(variant=v), 0.3, v in ("sapo", "cispo", "gpg"), v != "gpg")
      for v in LOSSES if v not in ("gspo", "gspo_token", "grpo", "geo_mean")),
]


def _inputs(noise: float, per_token_adv: bool):
    g = torch.Generator().manual_seed(1234)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[1, : T // 2] = False  # response tokens only on rank 1
    mask[1, T // 2] = True
    mask[3] = False  # empty response everywhere
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, ref, mask, adv


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)  # tiny tensors; avoid any OpenMP pool use in forked children
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD)))
        sl = slice(rank * T // WORLD, (rank + 1) * T // WORLD)
        for cfg, noise, per_tok, weighted in CASES:
            logp, old, ref, mask, adv = _inputs(noise, per_tok)
            kw = dict(ref_logprobs=ref, entropy=-logp.detach()) if cfg.kl_coef else {}
            if weighted:
                kw["correction_weights"] = 0.5 + torch.rand(
                    B, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
            full_lp = logp.clone().requires_grad_(True)
            full_loss, full_m = policy_loss(full_lp, old, adv, mask, cfg, **kw)
            full_loss.backward()

            shard_lp = logp[:, sl].clone().requires_grad_(True)
            kw_s = {k: v[:, sl] for k, v in kw.items()}
            adv_s = adv[:, sl] if adv.dim() == 2 else adv
            loss, m = policy_loss(shard_lp, old[:, sl], adv_s, mask[:, sl], cfg, cp_group=group, **kw_s)
            loss.backward()
            torch.testing.assert_close(loss, full_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(shard_lp.grad, full_lp.grad[:, sl], rtol=1e-12, atol=1e-14)
            assert torch.count_nonzero(full_lp.grad) > 0
            for key, value in full_m.items():
                torch.testing.assert_close(m[key], value, rtol=1e-10, atol=1e-12, msg=f"{cfg.variant} {key}")

        # masked_mean over the CP group: value and per-shard gradient
        vals = torch.randn(B, T, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        _, _, _, mask, _ = _inputs(0.0, False)
        full_v = vals.clone().requires_grad_(True)
        (masked_mean(full_v, mask) ** 2).sum().backward()
        shard_v = vals[:, sl].clone().requires_grad_(True)
        out = masked_mean(shard_v, mask[:, sl], group=group)
        (out**2).sum().backward()
        torch.testing.assert_close(out, masked_mean(vals, mask))
        torch.testing.assert_close(shard_v.grad, full_v.grad[:, sl])

        # bad values on ONE rank make every rank raise (no deadlock in later collectives)
        logp, old, ref, mask, adv = _inputs(2e-3, False)
        lp_bad = logp[:, sl].clone()
        if rank == 0:
            lp_bad[0, mask[0, sl].nonzero()[0, 0]] = float("nan")
        adv_bt = adv[:, None].expand(B, T // WORLD).clone()
        if rank == 1:
            adv_bt[0, mask[0, sl].nonzero()[0, 0]] += 1.0  # not constant over the sequence
        for bad_lp, bad_adv, field in ((lp_bad, adv, "logprobs"), (logp[:, sl], adv_bt, "advantages")):
            try:
                policy_loss(bad_lp, old[:, sl], bad_adv, mask[:, sl], PolicyLossConfig(), cp_group=group)
            except ValueError as e:
                assert field in str(e), str(e)
            else:
                raise AssertionError(f"rank {rank}: bad {field} on one rank did not raise")

        # all-empty mask over the group raises on every rank (no deadlock)
        try:
            policy_loss(shard_lp.detach(), old[:, sl], adv, torch.zeros(B, T // WORLD, dtype=torch.bool),
                        PolicyLossConfig(), cp_group=group)
        except ValueError as e:
            assert "response_mask" in str(e)
        else:
            raise AssertionError("all-empty mask did not raise")
    finally:
        dist.destroy_process_group()



@pytest.mark.distributed
def test_cp_policy_loss_matches_single_process():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo backend not available")
    # fork: the children inherit the imported torch, which keeps the test fast
    warm.gloo_context()  # the warm forkserver: not pytest's fork (it may hold a process group)
    mp.start_processes(_worker, args=(free_port(),), nprocs=WORLD, join=True,
                       start_method="forkserver")
