"""Balanced data-parallel ranks (``trainer.balance_data_parallel``) on 3 gloo processes, without a
model: :func:`~gspo_megatron.stages.balance_stage` moves whole samples between ranks so every rank
holds about the same tokens per minibatch, each sample keeps its minibatch, its advantage and
what it carries in ``extra`` (R3's routes), and :func:`~gspo_megatron.stages.update_stage` then
trains exactly those minibatches. That the gradient is unchanged is shown with the model in
``test_parallel_invariance.py`` (``packed_dp2_balanced``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_gloo

pytestmark = pytest.mark.distributed

WORLD, PER_RANK, MINIBATCHES, SEED = 3, 8, 2, 11


def _samples(rank: int):
    """Rank 0 sampled the long responses (a long-tailed step on one rank). Sample ``(r, i)``
    has id ``100 r + i``, advantage ``id / 1000`` and a routes tensor filled with its id."""
    from gspo_megatron.policy import RolloutSample

    gen = torch.Generator().manual_seed(rank)
    scale = 40 if rank == 0 else 4
    out = []
    for i in range(PER_RANK):
        n = int(torch.randint(1, scale, (1,), generator=gen))
        sid = 100 * rank + i
        out.append(RolloutSample([sid % 50 + 2, 3], [5] * n, [-0.5] * n, "eos",
                                 extra={"id": sid, "routes": torch.full((2, n + 1, 2), sid)}))
    return out


def _groups(rank: int):
    from gspo_megatron.distributed import ParallelGroups

    world = dist.group.WORLD
    return ParallelGroups(world_size=WORLD, rank=rank, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                          ep_size=1, cp_rank=0, cp_size=1, dp_rank=rank, dp_size=WORLD,
                          tp_group=world, cp_group=world, dp_group=world, dp_cp_group=world,
                          pp_group=world, model_parallel_group=world)


class _Recorder:
    """A policy that records the advantages (sample ids) of each minibatch it trains."""

    routing, lr = None, 0.1

    def __init__(self):
        self.minibatches = []

    def zero_grad(self):
        pass

    def train_minibatch(self, batch, objective, *, routing=None):
        self.minibatches.append(sorted(round(float(a) * 1000) for a in batch.advantages))
        return {}

    def optimizer_step(self, corrupt_grad=None):
        return True, 1.0


def _worker(rank: int, world: int):
    from gspo_megatron.config import TrainConfig
    from gspo_megatron.policy import make_policy_batch
    from gspo_megatron.stages import balance_stage, batch_stage, update_stage

    samples = _samples(rank)
    advantages = torch.tensor([s.extra["id"] / 1000 for s in samples])
    out = balance_stage(samples, advantages, MINIBATCHES, SEED + rank, _groups(rank))
    for s, a in zip(out.samples, out.advantages.tolist()):  # everything travelled together
        assert round(a * 1000) == s.extra["id"], (a, s.extra["id"])
        assert s.extra["routes"].shape == (2, len(s.prompt_ids) + len(s.response_ids) - 1, 2)
        assert (s.extra["routes"] == s.extra["id"]).all()
        assert s.prompt_ids[0] == s.extra["id"] % 50 + 2
    cfg = TrainConfig()
    cfg.trainer.num_minibatches = MINIBATCHES
    batch = batch_stage(out.samples, out.advantages,
                        lambda seqs, prompts: make_policy_batch(seqs, prompts, pad_id=0))
    batch.old_logprobs = torch.zeros(batch.tokens.shape)
    policy = _Recorder()
    update_stage(policy, batch, cfg, seed=0, minibatch_sizes=out.minibatch_sizes)
    tokens = [sum(len(s.prompt_ids) + len(s.response_ids) for s in out.samples[a:a + n])
              for a, n in zip((0, out.minibatch_sizes[0]), out.minibatch_sizes)]
    return {"minibatches": policy.minibatches, "sizes": out.minibatch_sizes, "tokens": tokens,
            "metrics": out.metrics}


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_balanced_ranks_keep_minibatches_and_even_out_tokens():
    from gspo_megatron.stages import minibatch_order

    results = run_gloo(_worker, WORLD)
    per = PER_RANK // MINIBATCHES
    # Before: rank r's minibatch m is its own shuffle's slice m (update_stage's rule).
    expected = [set() for _ in range(MINIBATCHES)]
    tokens_before = [[0] * MINIBATCHES for _ in range(WORLD)]
    for r in range(WORLD):
        samples = _samples(r)
        order = minibatch_order(PER_RANK, SEED + r).tolist()
        for m in range(MINIBATCHES):
            chosen = [samples[i] for i in order[m * per:(m + 1) * per]]
            expected[m] |= {s.extra["id"] for s in chosen}
            tokens_before[r][m] = sum(len(s.prompt_ids) + len(s.response_ids) for s in chosen)
    for m in range(MINIBATCHES):
        got = [i for res in results for i in res["minibatches"][m]]
        assert sorted(got) == sorted(expected[m])  # each minibatch keeps its samples, once each
    assert all(res["sizes"] == [per] * MINIBATCHES for res in results)
    moved = sum(i // 100 != r for r, res in enumerate(results) for mb in res["minibatches"]
                for i in mb)
    assert moved > 0
    worst_before = max(max(col) / (sum(col) / WORLD) for col in zip(*tokens_before))
    worst_after = max(max(col) / (sum(col) / WORLD) for col in zip(*(r["tokens"] for r in results)))
    metrics = results[0]["metrics"]
    assert metrics["perf/dp_token_imbalance_before"] == pytest.approx(worst_before)
    assert metrics["perf/dp_token_imbalance"] == pytest.approx(worst_after)
    assert worst_before > 2.0 and worst_after < 1.25, (worst_before, worst_after)  # 2.36 -> 1.18
