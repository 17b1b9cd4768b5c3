"""Rollouts on their own ranks (``rollout.placement: separate``, :mod:`gspo_megatron.rollouts.remote`):
one trainer rank and one rollout rank on 2 gloo processes, the rollout of step t sampled with the
weights of step t - k.

* ``max_staleness: 0`` alternates as the colocated loop does: the same samples and the same run,
  bitwise, as one colocated process (the rollout rank's replica loads the trainer's weights after
  every optimizer step);
* ``max_staleness: 1`` overlaps: every step after the first samples one version behind
  (``sampling/staleness``), and a run killed after its step-2 checkpoint (the rollout of step 2,
  in flight, is in it) resumes to the uninterrupted run's metrics bitwise;
* a TP=2 trainer (two ranks, each sending its own pieces of the weights in buckets) feeds a TP=1
  replica: at staleness 0 the colocated TP=2 run's samples and updates, bitwise.
"""

import os
import time

import pytest

from tests.e2e.test_train_e2e import (ROLLOUT_KL_TOL, ROOT, gspo_train, kill_and_resume,
                                      read_metrics)

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


def test_staleness_0_with_dynamic_sampling_and_evaluation_is_the_colocated_run(tmp_path):
    """DAPO's dynamic sampling (the rollout rank redraws tied groups: its own collectives), the
    overlong penalty, a user reward in worker processes (``reward.num_workers``; the built-in
    exact match would run inline) and the sampled evaluation (the trainer's engine) under
    ``placement: separate`` at staleness 0: every logged value but timings equals the colocated
    run's."""
    (tmp_path / "plain_reward.py").write_text(
        "def score(response, answer, example=None):\n"
        "    return 1.0 if response.strip() == answer else 0.0\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    features = ["--trainer.steps=3", "--dynamic_sampling.enabled=true",
                "--dynamic_sampling.max_extra_batches=2", "--overlong.mask_truncated=true",
                "--overlong.buffer_tokens=1", "--evaluation.num_samples=4",
                "--evaluation.temperature=1.0", "--trainer.eval_interval=2",
                "--reward.fn=plain_reward:score", "--reward.num_workers=2"]
    gspo_train(tmp_path / "colocated", *features, env_extra=env)
    gspo_train(tmp_path / "separate", *features, *SEPARATE, "--rollout.max_staleness=0", nproc=2,
               env_extra=env)
    a = read_metrics(tmp_path / "colocated" / "metrics.jsonl")
    b = read_metrics(tmp_path / "separate" / "metrics.jsonl")
    assert sum(m["sampling/rollout_batches"] for m in a) > 3  # tied groups were redrawn
    assert "eval/pass@4" in a[1] and all(m["reward/errors"] == 0 for m in a)
    assert max(m["reward/std"] for m in a) > 0  # the user reward scored (with the penalty)
    for x, y in zip(a, b, strict=True):
        keys = [k for k in x if not k.startswith("perf/") and k != "time"]
        assert {k: y.get(k) for k in keys} == {k: x[k] for k in keys}


def test_a_tp2_trainer_feeds_a_tp1_replica_as_the_colocated_tp2_run(tmp_path):
    """Two trainer ranks at TP=2 (each sends its halves of the TP-sharded tensors, rank 0 the
    TP-replicated ones: the main replicas) and one rollout rank whose TP=1 replica loads them
    whole: at staleness 0 every logged value but timings equals the colocated TP=2 run's (the
    rollouts sample the same tokens from the same weights), except ``kl/rollout_vs_train``: the
    replica scores the sampled tokens at TP=1, the colocated engine at TP=2 (another order of
    the fp32 sums), ~1e-14 both."""
    # 2 warm-up steps, not 0: without one the colocated TP=2 run fails at 3788b2b (Megatron's
    # sequence-parallel gather buffer is first allocated in the rollout's inference mode, then
    # written by the update: "Inplace update to inference tensor outside InferenceMode")
    # Megatron's per-step decoding on both sides: a TP=2 engine decodes there, and the TP=1
    # replica's multi-step rounds would draw other samples from the same distribution.
    tp2 = ["--trainer.steps=2", "--sft.steps=2", "--parallel.tensor_model_parallel_size=2",
           "--parallel.sequence_parallel=true", "--rollout.decode_steps_per_sync=0"]
    colocated = tmp_path / "colocated"
    gspo_train(colocated, *tp2, nproc=2)
    separate = tmp_path / "separate"
    gspo_train(separate, *tp2, *SEPARATE, "--rollout.max_staleness=0",
               "--rollout.weight_bucket_mb=0.01", nproc=3)  # 10 KiB: tensors split
    a, b = read_metrics(colocated / "metrics.jsonl"), read_metrics(separate / "metrics.jsonl")
    assert [m["step"] for m in b] == [0, 1]
    for ma, mb in zip(a, b, strict=True):
        for key in ma:
            if key == "kl/rollout_vs_train":
                assert 0 <= ma[key] < ROLLOUT_KL_TOL and 0 <= mb[key] < ROLLOUT_KL_TOL
            elif key.startswith("mismatch/"):  # the same gap counted: TP=1 vs TP=2 sums
                assert all(0 <= m[key] <= m["response/num_tokens"] for m in (ma, mb))
            elif not key.startswith(("perf/", "time")):
                assert ma[key] == mb[key], (ma["step"], key)
