"""Reliability end to end: SIGKILL at several points then resume (bitwise equal to an uninterrupted
run), NaN injection at every guarded point, too many faults in a row, SIGTERM/SIGUSR1."""

import json
import os
import signal
import time

import pytest

from gspo_megatron.metrics import read_metrics
from tests.e2e.test_train_e2e import RECIPE, ROOT, SMALL, clean_env, gspo_train
from tests.helpers import warm

pytestmark = pytest.mark.slow

STEPS = ["--trainer.steps=4", "--checkpoint.save_interval=2"]
COMPARED = ("reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    gspo_train(run, *STEPS)
    return read_metrics(run / "metrics.jsonl"), json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("fault", ["mid_update:3", "checkpoint_write:4", "checkpoint_write:2"])
def test_sigkill_then_resume_is_bitwise_equal(tmp_path, uninterrupted, fault):
    from gspo_megatron.backends.megatron import checkpoint as ckpt

    run = tmp_path / "run"
    killed = gspo_train(run, *STEPS, env_extra={"GSPO_FAULT": fault}, check=False)
    assert killed.returncode == -signal.SIGKILL
    save_dir = str(run / "checkpoints")
    expect_latest = {"mid_update:3": 2, "checkpoint_write:4": 2, "checkpoint_write:2": None}[fault]
    assert ckpt.read_latest(save_dir) == expect_latest  # the killed write never became "latest"
    assert ckpt.list_checkpoints(save_dir) == ([expect_latest] if expect_latest else [])

    gspo_train(run, *STEPS)
    metrics, summary = read_metrics(run / "metrics.jsonl"), json.loads((run / "summary.json").read_text())
    straight_metrics, straight_summary = uninterrupted
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for key in COMPARED:
        assert [m[key] for m in metrics] == [m[key] for m in straight_metrics], key
    assert summary["accuracy_after"] == straight_summary["accuracy_after"]


def _figures(metrics):
    """Every logged metric but the clock, the timings and memory (``perf/``)."""
    return [{k: v for k, v in m.items() if not k.startswith("perf/") and k != "time"}
            for m in metrics]


def test_offload_is_bitwise_straight_and_across_a_kill_and_resume(tmp_path, uninterrupted):
    """trainer.offload: the optimizer state and gradient buffer leave for every rollout (freed
    storage, host copy) and come back; steps 0-2 run straight with it, the process is killed in
    step 3's update, resumed from step 2's checkpoint: every metric bitwise the run without."""
    run = tmp_path / "run"
    killed = gspo_train(run, *STEPS, "--trainer.offload=all", check=False,
                        env_extra={"GSPO_FAULT": "mid_update:3"})
    assert killed.returncode == -signal.SIGKILL
    gspo_train(run, *STEPS, "--trainer.offload=all")
    metrics, summary = read_metrics(run / "metrics.jsonl"), json.loads((run / "summary.json").read_text())
    straight_metrics, straight_summary = uninterrupted
    assert _figures(metrics) == _figures(straight_metrics)
    assert summary["accuracy_after"] == straight_summary["accuracy_after"]
    # Moved: the fp32 gradient buffer (140,160 parameters x 4 B) from step 0; Adam's m and v
    # (x 8 B) and fused Adam's float32 step per parameter tensor (33 x 4 B) once they exist.
    # (fp32 training: the weights are the optimizer's main copy; "all" leaves them.)
    moved = [round(m["perf/offloaded_gib"] * 2 ** 30) for m in metrics]
    assert moved == [140_160 * 4] + [140_160 * 12 + 33 * 4] * 3


def test_nan_at_every_guarded_point_skips_that_step(tmp_path):
    faults = {1: "nan_rewards", 2: "nan_advantages", 3: "nan_logprobs", 4: "nan_loss", 5: "nan_grads"}
    spec = ",".join(f"{point}:{step}" for step, point in faults.items())
    run = tmp_path / "nan"
    gspo_train(run, "--trainer.steps=7", "--trainer.max_consecutive_faults=10",
               env_extra={"GSPO_FAULT": spec})
    metrics = {m["step"]: m for m in read_metrics(run / "metrics.jsonl")}
    assert sorted(metrics) == list(range(7))
    expected_key = {1: "faults/nonfinite_rewards", 2: "faults/nonfinite_advantages",
                    3: "faults/nonfinite_logprobs", 4: "faults/skipped_updates",
                    5: "faults/skipped_updates"}
    for step, key in expected_key.items():
        assert metrics[step].get(key, 0) > 0, (step, metrics[step])
        assert metrics[step]["optim/skipped"] > 0
    for step in (0, 6):
        assert metrics[step]["optim/skipped"] == 0 and metrics[step]["faults/skipped_updates"] == 0
    # the step after a fault trains from finite weights
    assert all(isinstance(metrics[6][k], float) for k in ("loss/policy", "optim/grad_norm"))


def test_too_many_faults_in_a_row_stop_the_run_and_keep_the_checkpoint(tmp_path):
    from gspo_megatron.backends.megatron import checkpoint as ckpt

    run = tmp_path / "diverged"
    proc = gspo_train(run, "--trainer.steps=8", "--checkpoint.save_interval=2",
                      "--trainer.max_consecutive_faults=3",
                      env_extra={"GSPO_FAULT": "nan_loss:2,nan_loss:3,nan_loss:4"}, check=False)
    assert proc.returncode == 2
    assert "3 consecutive steps had non-finite values" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Skipped steps leave the weights untouched, so the step-4 checkpoint (after two skipped steps)
    # holds good weights; nothing was saved after the third fault.
    save_dir = str(run / "checkpoints")
    assert ckpt.read_latest(save_dir) == 4 and ckpt.list_checkpoints(save_dir) == [2, 4]
    assert (run / "checkpoints" / "iter_0000004" / "metadata.json").is_file()
    # The count is checkpointed: resumed at step 4 (two faults in a row behind it), one more
    # stops the run again (c24cbcc restarted the count at 0 and trained on).
    proc = gspo_train(run, "--trainer.steps=8", "--checkpoint.save_interval=2",
                      "--trainer.max_consecutive_faults=3",
                      env_extra={"GSPO_FAULT": "nan_loss:4"}, check=False)
    assert proc.returncode == 2 and "3 consecutive steps had non-finite values (last: step 4)" \
        in proc.stderr, proc.stderr[-2000:]


def test_stop_signal_checkpoints_and_exits_for_requeue(tmp_path, sig=signal.SIGTERM):
    """SIGTERM to a real gspo-train: checkpoint, exit 75. (SIGUSR1 takes the same handler:
    tests/unit/test_trainer_stages.py sends both to the trainer; one real run is enough.)"""
    run = tmp_path / "signalled"
    argv = ["-m", "gspo_megatron.cli", "--config", RECIPE, f"--logging.run_dir={run}", *SMALL,
            "--trainer.steps=200"]
    proc = warm.launch(argv, env=clean_env(), cwd=ROOT)
    try:
        metrics_path = run / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics_path.exists() and metrics_path.read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, proc.output()
            time.sleep(0.2)
        proc.send_signal(sig)
        proc.wait(timeout=300)
    finally:
        proc.kill_group()
    assert proc.returncode == 75, proc.output()[1][-3000:]
    step = int((run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= step < 200
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 75


HANGING_REWARD = '''
import os, time

def score(response, answer, example=None):
    with open(os.environ["GSPO_TEST_REWARD_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    if example is not None and example.index % 5 == 0:
        while True:  # never returns: only killing the process stops it
            time.sleep(0.05)
    return 1.0 if response.strip() == answer else 0.0
'''


def test_a_hanging_reward_is_stopped_and_training_goes_on(tmp_path):
    """reward.num_workers=2 with a user reward that never returns for one prompt in five: every
    such call is stopped at reward.timeout_s (its worker killed and replaced), scored 0 and
    counted in reward/timeouts; the run finishes, and no reward worker outlives it."""
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    pids_file = tmp_path / "pids"
    run = tmp_path / "run"
    argv = ["-m", "gspo_megatron.cli", "--config", RECIPE, f"--logging.run_dir={run}", *SMALL,
            "--trainer.steps=2", "--trainer.eval_interval=0", "--sft.steps=0",
            "--data.num_eval_examples=5", "--reward.fn=hanging_reward:score",
            "--reward.timeout_s=2", "--reward.num_workers=2"]
    # Run from tmp_path: the reward module is found in the working directory, by the trainer
    # and by its spawned workers alike (the user's "rewards.py where I launch" case).
    proc = warm.launch(argv, env=clean_env({"GSPO_TEST_REWARD_PIDS": str(pids_file)}), cwd=tmp_path)
    try:
        proc.wait(timeout=600)
        assert proc.returncode == 0, proc.output()[1][-3000:]
        metrics = read_metrics(run / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [0, 1]
        assert sum(m["reward/timeouts"] for m in metrics) >= 1
        assert all(m["reward/hung_threads"] == 0 for m in metrics)
        worker_pids = {int(p) for p in pids_file.read_text().split()}
        assert len(worker_pids) >= 3 and proc.pid not in worker_pids  # killed ones were replaced
        time.sleep(1.0)
        alive = [p for p in worker_pids if _alive(p)]
        assert not alive, f"reward workers outlived the run: {alive}"
    finally:
        proc.kill_group()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not running
        return f.read().split(")")[-1].split()[0] != "Z"
