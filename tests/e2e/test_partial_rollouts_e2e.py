"""Partial rollouts end to end (``rollout.partial_rollouts``): the tiny recipe with R3, groups
carried from step to step (``rollout/partial_carried_share`` > 0), and a run killed after its
step-2 checkpoint (the groups in flight are in it) resumes to the uninterrupted run's metrics
bitwise."""

import json

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


def stop_and_resume(tmp_path, *overrides, nproc=1) -> tuple[list[dict], list[dict]]:
    """5 steps straight, and the same run sent SIGTERM at the start of step 2 (the stop SLURM
    sends before a requeue: a checkpoint after that step, exit 75) then resumed; returns both
    runs' metrics. No interval checkpoint: the stop's is the only one, so the uninterrupted run
    never prefills what it holds, and neither may the resumed one."""
    from tests.e2e.test_train_e2e import gspo_train, read_metrics

    steps = ["--trainer.steps=5", *overrides]
    gspo_train(tmp_path / "straight", *steps, nproc=nproc)
    run = tmp_path / "stopped"
    stopped = gspo_train(run, *steps, nproc=nproc, env_extra={"GSPO_FAULT": "stop_signal:2"},
                         check=False)
    # (several ranks: the launcher, as torchrun, reports a failed rank as 1; the launch scripts
    # read the run's own exit code from summary.json)
    assert stopped.returncode == (75 if nproc == 1 else 1), stopped.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 75
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert "resumed from" in gspo_train(run, *steps, nproc=nproc).stdout
    a, b = (read_metrics(r / "metrics.jsonl") for r in (tmp_path / "straight", run))
    assert [m["step"] for m in b] == [0, 1, 2, 3, 4]
    return a, b


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_stop_signal_under_kept_kv_resumes_bitwise(tmp_path, placement):
    """The SLURM requeue path with the KV cache held between steps: the checkpoint a stop
    signal writes keeps the engine's held requests whole (their KV blocks, the context's
    tables, R3 routes), since the run that was not stopped continues them without a prefill;
    the resumed run continues them too, to the same metrics bitwise (on c24cbcc it prefilled
    them: the steps after the stop differed)."""
    where = ([] if placement == "colocated" else
             ["--rollout.placement=separate", "--rollout.ranks=1", "--rollout.max_staleness=1"])
    a, b = stop_and_resume(tmp_path, "--rollout.partial_rollouts=true",
                           "--rollout.partial_keep_kv=true", "--rollout.max_new_tokens=8",
                           "--model.seq_length=16", *(["--routing.replay=r3"] if placement ==
                                                       "colocated" else []), *where,
                           nproc=1 if placement == "colocated" else 2)
    assert any(m["rollout/partial_carried_share"] > 0 for m in a[3:])
    for key in SAME + ("rollout/partial_in_flight",):
        if key in a[0]:
            assert [m[key] for m in a] == [m[key] for m in b], key


@pytest.mark.distributed
def test_colocated_partial_checkpoint_resumes_on_rollout_ranks(tmp_path):
    """A change of ``rollout.placement`` across a resume that can be honoured is: the groups in
    flight of a colocated run's checkpoint go to the rollout rank, and at staleness 0 (the
    colocated run's samples) the resumed run is the uninterrupted colocated one, bitwise
    (c24cbcc: ``KeyError: 'received'``)."""
    from tests.e2e.test_train_e2e import gspo_train, read_metrics

    partial = ["--rollout.partial_rollouts=true", "--rollout.max_new_tokens=8",
               "--model.seq_length=16"]
    steps = ["--trainer.steps=4", "--checkpoint.save_interval=2", *partial]
    straight, run = tmp_path / "straight", tmp_path / "moved"
    gspo_train(straight, *steps)
    killed = gspo_train(run, *steps, env_extra={"GSPO_FAULT": "step_start:3"}, check=False)
    assert killed.returncode != 0
    resumed = gspo_train(run, *steps, "--rollout.placement=separate", "--rollout.ranks=1",
                         "--rollout.max_staleness=0", nproc=2)
    assert "resumed from" in resumed.stdout
    a, b = (read_metrics(r / "metrics.jsonl") for r in (straight, run))
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    for key in SAME[:-1] + ("rollout/partial_in_flight",):
        assert [m[key] for m in a] == [m[key] for m in b], key
