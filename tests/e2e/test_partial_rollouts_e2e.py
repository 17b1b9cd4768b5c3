"""Partial rollouts end to end (``rollout.partial_rollouts``): the tiny recipe with R3, groups
carried from step to step (``rollout/partial_carried_share`` > 0), and a run killed after its
step-2 checkpoint (the groups in flight are in it) resumes to the uninterrupted run's metrics
bitwise."""

import pytest

from tests.e2e.test_train_e2e import kill_and_resume

pytestmark = pytest.mark.slow

SAME = ("reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm",
        "rollout/partial_carried_share", "rollout/partial_max_age", "routing/replay_mismatch")


@pytest.mark.parametrize("keep_kv", ["false", "true"])
def test_partial_rollouts_with_r3_carry_groups_and_resume_bitwise(tmp_path, keep_kv):
    """With ``rollout.partial_keep_kv`` the carried responses continue from the engine's cache
    (R3: their routes from the rollouts that forwarded them), and the first rollout after the
    checkpoint prefills them in both runs."""
    a, b = kill_and_resume(tmp_path, "--rollout.partial_rollouts=true", "--routing.replay=r3",
                           "--rollout.max_new_tokens=8", "--model.seq_length=16",
                           f"--rollout.partial_keep_kv={keep_kv}")
    assert any(m["rollout/partial_carried_share"] > 0 for m in a)
    # at most 4 x 4 groups held (rollout.in_flight_groups' default), 4 taken each step
    assert all(0 < m["rollout/partial_in_flight"] <= 12 for m in a)
    assert any(m["rollout/partial_max_age"] >= 1 for m in a)
    for key in SAME:
        if key in a[0]:
            assert [m[key] for m in a] == [m[key] for m in b], key


@pytest.mark.distributed
def test_partial_rollouts_on_rollout_ranks_match_colocated_and_resume_bitwise(tmp_path):
    """``placement: separate`` with partial rollouts: the rollout rank holds the groups in
    flight and sends their state with every step's samples; at staleness 0 the run is the
    colocated one, value for value; at staleness 1 a run killed after its step-2 checkpoint
    resumes (the rollout rank gets its groups back) to the uninterrupted run's metrics bitwise."""
    from tests.e2e.test_train_e2e import gspo_train, read_metrics

    partial = ["--rollout.partial_rollouts=true", "--rollout.max_new_tokens=8",
               "--model.seq_length=16"]
    separate = ["--rollout.placement=separate", "--rollout.ranks=1"]
    gspo_train(tmp_path / "colocated", *partial, "--trainer.steps=3")
    gspo_train(tmp_path / "separate0", *partial, *separate, "--rollout.max_staleness=0",
               "--trainer.steps=3", nproc=2)
    a = read_metrics(tmp_path / "colocated" / "metrics.jsonl")
    b = read_metrics(tmp_path / "separate0" / "metrics.jsonl")
    for key in SAME[:-1] + ("rollout/partial_in_flight",):
        assert [m[key] for m in a] == [m[key] for m in b], key
    for keep_kv in ("false", "true"):  # with the KV cache held on the rollout rank too
        a, b = kill_and_resume(tmp_path / f"stale1_keep_{keep_kv}", *partial, *separate,
                               "--rollout.max_staleness=1", f"--rollout.partial_keep_kv={keep_kv}",
                               nproc=2)
        assert any(m["rollout/partial_carried_share"] > 0 for m in a)
        for key in SAME[:-1] + ("rollout/partial_in_flight", "sampling/staleness"):
            assert [m[key] for m in a] == [m[key] for m in b], (keep_kv, key)
