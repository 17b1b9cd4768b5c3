"""Rollouts on their own ranks (``rollout.placement: separate``, :mod:`gspo_megatron.overlap`):
one trainer rank and one rollout rank on 2 gloo processes, the rollout of step t sampled with the
weights of step t - k.

* ``max_staleness: 0`` alternates as the colocated loop does: the same samples and the same run,
  bitwise, as one colocated process (the rollout rank's replica loads the trainer's weights after
  every optimizer step);
* ``max_staleness: 1`` overlaps: every step after the first samples one version behind
  (``sampling/staleness``), and a run killed after its step-2 checkpoint (the rollout of step 2,
  in flight, is in it) resumes to the uninterrupted run's metrics bitwise.
"""

import time

import pytest

from tests.e2e.test_train_e2e import gspo_train, kill_and_resume, read_metrics

pytestmark = pytest.mark.distributed

SEPARATE = ["--rollout.placement=separate", "--rollout.ranks=1"]
SAME = ("reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm",
        "response/mean_length")


def test_staleness_0_is_the_colocated_run(tmp_path):
    steps = ["--trainer.steps=3"]
    colocated = tmp_path / "colocated"
    gspo_train(colocated, *steps)
    separate = tmp_path / "separate"
    gspo_train(separate, *steps, *SEPARATE, "--rollout.max_staleness=0", nproc=2)
    a, b = read_metrics(colocated / "metrics.jsonl"), read_metrics(separate / "metrics.jsonl")
    assert [m["step"] for m in b] == [0, 1, 2]
    for key in SAME:
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert all(m["sampling/staleness"] == 0.0 for m in b)
    assert all("sampling/staleness" not in m for m in a)


def test_staleness_1_overlaps_and_resumes_bitwise(tmp_path):
    a, b = kill_and_resume(tmp_path, *SEPARATE, "--rollout.max_staleness=1", nproc=2)
    assert [m["sampling/staleness"] for m in a] == [0.0, 1.0, 1.0, 1.0]
    for key in (*SAME, "sampling/staleness"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    # stale samples, trainer-recomputed old log-probs: the rollout's log-probs differ from them
    assert all(m["kl/rollout_vs_train"] > 1e-9 for m in a[1:])


def test_a_rollout_rank_that_dies_stops_the_job(tmp_path):
    """The rollout rank SIGKILLs itself before sampling step 2: the job ends (the launcher
    stops the trainer, or the trainer's ``PeerLost`` does: whichever comes first), never hangs,
    and the steps trained before are logged. (Which side says what: the bridge test.)"""
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = gspo_train(run, "--trainer.steps=4", *SEPARATE, "--rollout.max_staleness=1", nproc=2,
                      env_extra={"GSPO_FAULT": "rollout_sample:2"}, check=False, timeout=180)
    assert proc.returncode != 0 and time.monotonic() - t0 < 180
    if "job rank 1 is gone" in proc.stderr:  # the trainer saw it before the launcher stopped it
        assert "gspo-train: error: job rank 1 is gone (waiting for the samples of step" \
            in proc.stderr
    steps = [m["step"] for m in read_metrics(run / "metrics.jsonl")]
    assert steps == [0, 1][:len(steps)]  # steps 0 and 1 were sampled before the kill
