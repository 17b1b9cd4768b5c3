"""DAPO's dynamic sampling and overlong handling, and pass@k: against independent references
(float64 / exact fractions) on fresh random inputs, then through the trainer's loop with a fake
policy and generator (group filtering, extra batches, fillers, exact resume)."""

import json
import math
import random
from fractions import Fraction

import pytest
import torch

from gspo_megatron.algorithms.dapo import (DynamicSamplingConfig, OverlongConfig, mask_truncated,
                                           select_groups, soft_overlong_penalty)
from gspo_megatron.algorithms.pass_at_k import pass_at_k, pass_at_k_ladder, sampled_eval_metrics
from gspo_megatron.config import TrainConfig
from gspo_megatron.config.validation import ConfigError, validate_config
from gspo_megatron.data import PromptExample, PromptSampler
from gspo_megatron.policy import RolloutSample
from gspo_megatron.sections import FieldError
from gspo_megatron.trainer import Task, Trainer

from tests.unit.test_trainer_stages import CharTokenizer, FakePolicy, _Groups


# ----------------------------------------------------------------------------- overlong

def _penalty_reference(length: int, l_max: int, cache: int, factor: float) -> float:
    """DAPO Eq. 13, written case by case."""
    if length <= l_max - cache:
        return 0.0
    if length <= l_max:
        return factor * ((l_max - cache) - length) / cache
    return -factor


@pytest.mark.parametrize("trial", range(5))
def test_soft_overlong_penalty_matches_eq_13(trial):
    gen = random.Random(trial)
    l_max = gen.randint(4, 300)
    cache = gen.randint(1, l_max)
    factor = gen.uniform(0.1, 3.0)
    lengths = [gen.randint(0, l_max + 20) for _ in range(64)] + [l_max - cache, l_max - cache + 1,
                                                                   l_max, l_max + 1]
    got = soft_overlong_penalty(torch.tensor(lengths), l_max, cache, factor)
    want = torch.tensor([_penalty_reference(n, l_max, cache, factor) for n in lengths],
                        dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_soft_overlong_penalty_shape():
    """0 up to L_max - L_cache, then a straight line to -factor at L_max."""
    p = soft_overlong_penalty(torch.arange(0, 11), 10, 4, 0.5).tolist()
    assert p[:7] == [0.0] * 7  # |y| <= 6
    assert p[7:] == pytest.approx([-0.125, -0.25, -0.375, -0.5])
    assert soft_overlong_penalty(torch.tensor([10, 12]), 10, 0).tolist() == [0.0, 0.0]  # off


def test_mask_truncated_zeroes_only_truncated():
    adv = torch.randn(8)
    cut = torch.tensor([True, False] * 4)
    out = mask_truncated(adv, cut)
    assert out[cut].eq(0).all() and torch.equal(out[~cut], adv[~cut])


# ----------------------------------------------------------------------------- group selection

def _select_reference(tied, need):
    order = [(b, g, bool(t)) for b, batch in enumerate(tied) for g, t in enumerate(batch.tolist())]
    varied = [(b, g) for b, g, t in order if not t]
    ties = [(b, g) for b, g, t in order if t]
    chosen = varied[:need] + ties[:max(need - len(varied), 0)]
    return chosen, max(need - len(varied), 0)


@pytest.mark.parametrize("trial", range(20))
def test_select_groups_against_reference(trial):
    gen = torch.Generator().manual_seed(trial)
    need = int(torch.randint(1, 8, (1,), generator=gen))
    batches = int(torch.randint(1, 5, (1,), generator=gen))
    tied = [torch.rand(need, generator=gen) < 0.6 for _ in range(batches)]
    sel = select_groups(tied, need)
    chosen, filled = _select_reference(tied, need)
    assert sel.chosen == chosen and sel.filled == filled and sel.kept == need - filled
    n_tied = sum(int(t.sum()) for t in tied)
    n_varied = batches * need - n_tied
    assert sel.dropped == n_tied - filled and sel.surplus == max(n_varied - need, 0)
    assert sel.kept + sel.filled + sel.dropped + sel.surplus == batches * need


def test_select_groups_prefers_varied_then_earliest_ties():
    tied = [torch.tensor([True, False, True]), torch.tensor([True, True, True])]
    sel = select_groups(tied, 3)
    assert sel.chosen == [(0, 1), (0, 0), (0, 2)] and sel.kept == 1 and sel.filled == 2
    with pytest.raises(ValueError, match="fewer than the 4 needed"):
        select_groups([torch.tensor([False, True])], 4)


# ----------------------------------------------------------------------------- pass@k

def _pass_at_k_exact(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("trial", range(10))
def test_pass_at_k_is_the_unbiased_estimator(trial):
    gen = random.Random(100 + trial)
    for _ in range(50):
        n = gen.randint(1, 64)
        c, k = gen.randint(0, n), gen.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_exact(n, c, k)), abs=1e-12)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(*bad)
    assert pass_at_k_ladder(8) == [1, 2, 4, 8] and pass_at_k_ladder(6) == [1, 2, 4, 6]
    assert pass_at_k_ladder(1) == [1]


def test_sampled_eval_metrics_sums_per_problem_estimates():
    correct = torch.tensor([0, 2, 4, 1])
    row = sampled_eval_metrics(correct, 4)
    assert row[0] == 4 and row[1] == pytest.approx((0 + 2 + 4 + 1) / 4)
    for i, k in enumerate(pass_at_k_ladder(4)):
        want = sum(float(_pass_at_k_exact(4, int(c), k)) for c in correct)
        assert row[2 + i] == pytest.approx(want)


# ----------------------------------------------------------------------------- config

def test_configs_refuse_bad_values():
    with pytest.raises(FieldError, match="dynamic_sampling.max_extra_batches must be >= 0"):
        DynamicSamplingConfig(enabled=True, max_extra_batches=-1)
    with pytest.raises(FieldError, match="overlong.penalty_factor must be >= 0"):
        OverlongConfig(penalty_factor=-1.0)
    cfg = TrainConfig()
    cfg.overlong.buffer_tokens = cfg.rollout.max_new_tokens + 1
    with pytest.raises(ConfigError, match=r"overlong.buffer_tokens \(1025\) must be <= "
                                          r"rollout.max_new_tokens \(1024\)"):
        validate_config(cfg, world_size=1, check_paths=False)


def test_defaults_are_off():
    cfg = TrainConfig()
    assert not cfg.dynamic_sampling.enabled and not cfg.overlong.mask_truncated
    assert cfg.overlong.buffer_tokens == 0 and cfg.evaluation.num_samples == 0


# ----------------------------------------------------------------------------- the loop

class ParityGenerator:
    """Prompt 'c=c': for even ``ord(c)`` every response is right (a tied group); for odd, the
    responses alternate right / wrong (a varied group). Records the seed of each call."""

    def __init__(self, truncate_wrong=False):
        self.seeds = []
        self.truncate_wrong = truncate_wrong

    def generate(self, prompts, seed):
        self.seeds.append(seed)
        out = []
        for j, p in enumerate(prompts):
            right = p[-1] % 2 == 0 or j % 2 == 0
            token = p[-1] if right else p[-1] + 1
            cut = self.truncate_wrong and not right
            out.append(RolloutSample(list(p), [token] if cut else [token, 1],
                                     [-0.5] if cut else [-0.5, -0.1], "length" if cut else "eos"))
        return out

    def with_sampling(self, config):
        return self


def _prompts(n):
    return [PromptExample(prompt=f"{chr(50 + i)}={chr(50 + i)}", answer=chr(50 + i), index=i)
            for i in range(n)]


def _loop(tmp_path, steps=2, gen=None, **sections):
    cfg = TrainConfig()
    cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens = 2, 4, 2
    cfg.trainer.num_minibatches, cfg.trainer.micro_batch_size = 2, 2
    cfg.trainer.eval_interval, cfg.trainer.steps = 0, steps
    cfg.logging.run_dir, cfg.logging.progress = str(tmp_path), False
    for name, fields in sections.items():
        for k, v in fields.items():
            setattr(getattr(cfg, name), k, v)
    train = _prompts(40)
    from gspo_megatron.rewards import get_reward_fn
    gen = gen or ParityGenerator()
    policy = FakePolicy()
    task = Task(CharTokenizer(), PromptSampler(train, 4, seed=cfg.trainer.seed), train, [],
                get_reward_fn("arithmetic_exact"))
    trainer = Trainer(cfg, _Groups(), policy, gen, task)
    return trainer, policy, gen


def test_without_dynamic_sampling_one_batch_per_step(tmp_path):
    trainer, policy, gen = _loop(tmp_path)
    trainer.fit()
    assert gen.seeds == [1234, 2234]  # the step seeds, one rollout batch each
    metrics = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert not any(k.startswith("sampling/") for k in metrics[0])
    assert 0 < metrics[0]["reward/zero_variance_group_fraction"] < 1


def test_dynamic_sampling_trains_only_varied_groups(tmp_path):
    trainer, policy, gen = _loop(tmp_path, dynamic_sampling=dict(enabled=True, max_extra_batches=8))
    trainer.fit()
    metrics = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    for m in metrics:
        assert m["sampling/kept_groups"] == 4 and m["sampling/filled_groups"] == 0
        assert m["sampling/rollout_batches"] >= 2  # about half the groups tie: one batch is short
        assert m["sampling/extra_rollouts"] == (m["sampling/rollout_batches"] - 1) * 4 * 2
        assert (m["sampling/kept_groups"] + m["sampling/dropped_groups"]
                + m["sampling/surplus_groups"] == m["sampling/rollout_batches"] * 4)
    # every trained group is varied: advantages +-1 in each pair, never 0
    for batch in policy.batches:
        assert batch.advantages.abs().min() > 0.5
    # extra batches use their own seeds: batch b of a step is seed + b * stride
    from gspo_megatron.rollouts.sampling import EXTRA_BATCH_SEED_STRIDE
    first = int(metrics[0]["sampling/rollout_batches"])
    assert gen.seeds[:first] == [1234 + b * EXTRA_BATCH_SEED_STRIDE for b in range(first)]


def test_dynamic_sampling_fills_with_tied_groups_at_the_bound(tmp_path):
    trainer, policy, _ = _loop(tmp_path, steps=1,
                               dynamic_sampling=dict(enabled=True, max_extra_batches=0))
    trainer.fit()
    m = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert m["sampling/rollout_batches"] == 1 and m["sampling/extra_rollouts"] == 0
    assert m["sampling/kept_groups"] + m["sampling/filled_groups"] == 4
    assert m["sampling/filled_groups"] == m["reward/zero_variance_groups"] > 0
    zeros = sum(int((b.advantages == 0).sum()) for b in policy.batches)
    assert zeros == 2 * m["sampling/filled_groups"]  # fillers carry zero advantage


def test_dynamic_sampling_resumes_exactly(tmp_path):
    ds = dict(dynamic_sampling=dict(enabled=True, max_extra_batches=8),
              checkpoint=dict(save_interval=1))
    trainer, policy, _ = _loop(tmp_path / "a", steps=2, **ds)
    trainer.fit()
    resumed, _, _ = _loop(tmp_path / "a", steps=4, **ds)
    resumed.policy = policy  # the fake's checkpoints live in the policy object
    resumed.fit()
    straight, _, _ = _loop(tmp_path / "b", steps=4, **ds)
    straight.fit()
    assert resumed.task.sampler.state_dict() == straight.task.sampler.state_dict()
    a = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    b = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    for ma, mb in zip(a, b, strict=True):
        for key in ("sampling/rollout_batches", "sampling/kept_groups", "reward/mean",
                    "loss/policy"):
            assert ma[key] == mb[key], key


def test_overlong_mask_and_penalty_in_the_loop(tmp_path):
    gen = ParityGenerator(truncate_wrong=True)
    trainer, policy, _ = _loop(tmp_path, steps=1, gen=gen,
                               overlong=dict(mask_truncated=True, buffer_tokens=1,
                                             penalty_factor=0.5))
    trainer.fit()
    m = json.loads(open(tmp_path / "metrics.jsonl").readline())
    # wrong answers are 1 token, cut: reward 0 - 0.5 * (1 - 1) / 1 = 0; right ones are 2 tokens
    # (EOS included) at the budget: 1 - 0.5
    assert m["reward/max"] == pytest.approx(0.5) and m["reward/min"] == pytest.approx(0.0)
    assert m["response/clip_rate"] == pytest.approx(1 - m["response/eos_fraction"])
    assert m["response/clip_rate"] > 0
    assert m["response/max_length"] == 2.0
    # every truncated response was masked: only right (positive-advantage) rows remain non-zero
    adv = torch.cat([b.advantages for b in policy.batches])
    assert (adv >= 0).all() and (adv > 0).any()
