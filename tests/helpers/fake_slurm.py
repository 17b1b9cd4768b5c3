"""Stand-ins for SLURM's ``sbatch`` / ``srun`` / ``scontrol`` that emulate a 2-node allocation on
this machine (both "nodes" are localhost, one CPU process each, gloo), and the environment the
launch scripts (``launch/``) run under with them: the ``fake_slurm`` fixture of
``tests/e2e/test_launch.py`` (the scripts, bad input, preemption) and
``tests/e2e/test_launch_recipes.py`` (each shipped recipe launched and resumed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "launch")
SUBMIT = os.path.join(LAUNCH, "submit.sh")

# As tests/e2e/test_train_e2e.py: the arithmetic task, a short warm-up, small rollouts.
SMALL = [
    "--data.num_train_examples=200", "--data.num_eval_examples=20", "--model.seq_length=16",
    "--rollout.max_new_tokens=4", "--data.max_prompt_length=8", "--rollout.group_size=4",
    "--rollout.prompts_per_step=4", "--trainer.num_minibatches=2", "--trainer.micro_batch_size=4",
    "--sft.steps=20", "--sft.batch_size=32", "--logging.progress=false",
]
EP2 = "--parallel.expert_model_parallel_size=2"

# --------------------------------------------------------------------------- fake SLURM
# sbatch: records its arguments, then runs the batch script in the foreground (exec: the test's
# process is the batch shell, as SLURM's signals reach it) with the job's SLURM_* variables.
FAKE_SBATCH = r"""#!/usr/bin/env bash
set -euo pipefail
printf '%s\n' "$*" >> "$FAKE_SLURM_DIR/sbatch_calls"
nodes=1
while [[ $# -gt 0 && "$1" == --* ]]; do
    case "$1" in --nodes=*) nodes=${1#--nodes=} ;; esac
    shift
done
script=$1
shift
export SLURM_JOB_ID="${FAKE_JOB_ID:-1000}" SLURM_NNODES="$nodes" SLURM_JOB_NUM_NODES="$nodes"
export SLURM_JOB_NODELIST="node[1-$nodes]" SLURM_SUBMIT_DIR="$PWD"
export SLURM_RESTART_COUNT="${FAKE_RESTART_COUNT:-0}"
exec bash "$script" "$@"
"""

# srun: one task per node, each in its own process group (SLURM's proctrack/pgid: a signal for
# the step goes to each task's process group, so torchrun's workers, in their own sessions, are
# reached only through the launch scripts' forwarding). Forwards SIGUSR1/SIGTERM/SIGINT like srun;
# exits with the highest task exit code.
FAKE_SRUN = r"""#!{python}
import os, signal, subprocess, sys
args, nodes = sys.argv[1:], int(os.environ.get("SLURM_NNODES", "1"))
while args and args[0].startswith("--"):
    if args[0].startswith("--nodes="):
        nodes = int(args[0].split("=", 1)[1])
    args = args[1:]
with open(os.path.join(os.environ["FAKE_SLURM_DIR"], "srun_calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
tasks = [subprocess.Popen(args, start_new_session=True,
                          env=dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i),
                                   SLURM_LOCALID="0", SLURM_NTASKS=str(nodes),
                                   SLURM_STEP_NUM_TASKS=str(nodes)))
         for i in range(nodes)]
def forward(signum, frame):
    for t in tasks:
        try:
            os.killpg(t.pid, signum)
        except ProcessLookupError:
            pass
for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, forward)
sys.exit(max(t.wait() for t in tasks))
"""

# scontrol: `show hostnames` -> localhost per node; `requeue ID` -> recorded.
FAKE_SCONTROL = r"""#!/usr/bin/env bash
set -euo pipefail
case "$1 ${2:-}" in
    "show hostnames")
        for _ in $(seq "${SLURM_NNODES:-2}"); do echo localhost; done ;;
    requeue*)
        printf '%s\n' "$*" >> "$FAKE_SLURM_DIR/requeue_calls" ;;
    *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """PATH with the stand-ins, and an environment for `MODEL=tiny` on 2 nodes x 1 process (the
    layout comes with the arguments: EP2)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN.replace("{python}", sys.executable)),
                       ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    from gspo_megatron.backends.megatron.parallel import _free_port

    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SLURM_DIR=str(state),
               PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", MODEL="tiny", NNODES="2", GPUS_PER_NODE="1",
               RUN_DIR=str(tmp_path / "run"), LOG_DIR=str(tmp_path / "logs"),
               MASTER_PORT=str(_free_port()))
    for var in ("CONTAINER_IMAGE", "SAVE_DIR", "RECIPE", "TP", "PP", "EP", "CP", "ETP", "NODE_RANK",
                "MASTER_ADDR", "GSPO_ROOT", "SBATCH_ARGS", "SRUN_ARGS", "SKIP_PLAN", "PLAN_PYTHON"):
        env.pop(var, None)
    return env, state, tmp_path / "run"


def submit(env, *args, timeout=300):
    """``launch/submit.sh ARGS``. A refusal or a dry run starts two fresh interpreters (gspo-plan,
    ``gspo-train --check``) that import torch: ~20 s each on a slow 2-core machine under load,
    so the limit is a hang's, not a speed bound."""
    return subprocess.run(["bash", SUBMIT, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def output(proc) -> str:
    return f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
