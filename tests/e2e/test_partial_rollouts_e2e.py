"""Partial rollouts end to end (``rollout.partial_rollouts``): the tiny recipe with R3, groups
carried from step to step (``rollout/partial_carried_share`` > 0), and a run killed after its
step-2 checkpoint (the groups in flight are in it) resumes to the uninterrupted run's metrics
bitwise."""

import pytest

from tests.e2e.test_train_e2e import kill_and_resume

pytestmark = pytest.mark.slow

SAME = ("reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm",
        "rollout/partial_carried_share", "rollout/partial_max_age", "routing/replay_mismatch")


def test_partial_rollouts_with_r3_carry_groups_and_resume_bitwise(tmp_path):
    a, b = kill_and_resume(tmp_path, "--rollout.partial_rollouts=true", "--routing.replay=r3",
                           "--rollout.max_new_tokens=8", "--model.seq_length=16")
    assert any(m["rollout/partial_carried_share"] > 0 for m in a)
    # at most 4 x 4 groups held (rollout.in_flight_groups' default), 4 taken each step
    assert all(0 < m["rollout/partial_in_flight"] <= 12 for m in a)
    assert any(m["rollout/partial_max_age"] >= 1 for m in a)
    for key in SAME:
        if key in a[0]:
            assert [m[key] for m in a] == [m[key] for m in b], key
