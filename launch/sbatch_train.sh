#!/usr/bin/env bash
# Multi-node GSPO training under SLURM: one srun task per node, each running torchrun for that
# node's GPUs. Submit with launch/submit.sh (validates, then sets nodes/GPUs/time from the model
# file), or directly:  MODEL=qwen3-30b-a3b sbatch --nodes=2 launch/sbatch_train.sh [overrides]
#   launch/sbatch_train.sh --dry-run [overrides]   checks and prints the srun command, runs nothing
# Overrides are gspo-train's --section.field=value; the layout is the recipe's parallel: section
# (--parallel.expert_model_parallel_size=16 ...), checked by gspo-plan before srun.
#
# Preemption / time limit: SLURM sends SIGUSR1 to this batch shell 300 s before the limit
# (--signal=B:USR1@300). The trap below forwards it to srun, srun to every node's task
# (torchrun_node.sh), which forwards it to the trainer processes; they finish the current step,
# write a checkpoint and exit 75. Then this script requeues the job (scontrol requeue, needs
# --requeue) and the restarted job resumes from the checkpoint in SAVE_DIR.
#
#SBATCH --job-name=gspo-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# shellcheck disable=SC2317  # functions called from traps look unreachable to shellcheck
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi

# SLURM runs a copy of this file from its spool directory: find the repository through GSPO_ROOT
# (exported by submit.sh), this file's directory, or the submit directory, in that order.
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z "${GSPO_ROOT:-}" ]]; then
    if [[ -f "$script_dir/common.sh" ]]; then
        GSPO_ROOT=$(cd "$script_dir/.." && pwd)
    else
        GSPO_ROOT="${SLURM_SUBMIT_DIR:-$PWD}"
    fi
fi
export GSPO_ROOT
[[ -f "$GSPO_ROOT/launch/common.sh" ]] || {
    echo "launch: error: $GSPO_ROOT is not the gspo_megatron repository (set GSPO_ROOT)" >&2
    exit 2
}
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$GSPO_ROOT/launch/common.sh"

export MODEL="${MODEL:-qwen3-30b-a3b}"
load_model "$MODEL"
# Inside an allocation the node count is the allocation's, whatever the model file says.
export NNODES="${SLURM_NNODES:-$NNODES}"
trainer_args "$@"
if (( DRY_RUN )) && [[ "${LAUNCH_CHECKED:-0}" == 1 ]]; then
    # submit.sh --dry-run checked the launch and printed the plan: only read the layout here.
    plan_layout "$((NNODES * GPUS_PER_NODE))" "${TRAINER_ARGS[@]}" 2>/dev/null || true
else
    validate_launch
fi
# The checked layout, for torchrun_node.sh's environment (CUDA_DEVICE_MAX_CONNECTIONS).
export GPUS_PER_NODE TP PP EP ETP CP

# Rank 0's node: the first host of the allocation (mapfile, not `| head -n1`: head closing the pipe
# early can fail scontrol with SIGPIPE under pipefail).
if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    [[ ${#hosts[@]} -ge 1 ]] || die "scontrol show hostnames returned no host for '$SLURM_JOB_NODELIST'"
    export MASTER_ADDR="${hosts[0]}"
else
    export MASTER_ADDR="<first node of the allocation>"
fi
# One port per job, so two jobs sharing a node do not collide.
export MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
unset NODE_RANK   # each task takes its own from SLURM_NODEID

srun_args=(--nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1
           # 0: a node whose torchrun exits first (e.g. after the preemption checkpoint) must not
           # kill rank 0 before it records the exit status; NCCL error handling ends real hangs.
           --kill-on-bad-exit="${KILL_ON_BAD_EXIT:-0}")
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    # pyxis/enroot: the repository is mounted at the same path; add data and checkpoint
    # directories with CONTAINER_MOUNTS=/data:/data,/checkpoints:/checkpoints.
    srun_args+=(--container-image="$CONTAINER_IMAGE"
                --container-mounts="$GSPO_ROOT:$GSPO_ROOT${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
                --container-workdir="$GSPO_ROOT")
fi
# SRUN_ARGS: extra srun flags, word-split on purpose (e.g. "--cpu-bind=none").
# shellcheck disable=SC2206
srun_args+=(${SRUN_ARGS:-})
cmd=(srun "${srun_args[@]}" bash "$GSPO_ROOT/launch/torchrun_node.sh" "${TRAINER_ARGS[@]}")

if (( DRY_RUN )); then
    log "dry run: checks passed; would run:"
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi

log "job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}): $MODEL on $NNODES x $GPUS_PER_NODE, TP=$TP PP=$PP EP=$EP ETP=$ETP CP=$CP, master $MASTER_ADDR:$MASTER_PORT"
if [[ -f "$SAVE_DIR/latest_checkpointed_iteration.txt" ]]; then
    log "resuming from $SAVE_DIR at step $(cat "$SAVE_DIR/latest_checkpointed_iteration.txt")"
fi
mkdir -p "$RUN_DIR"
stamp="$RUN_DIR/.launch-${SLURM_JOB_ID:-0}-$$"
touch "$stamp"

srun_pid=""
# shellcheck disable=SC2329  # invoked from a trap
on_stop_signal() {
    log "SIGUSR1: forwarding the checkpoint-and-exit request to the job step"
    if [[ -n "$srun_pid" ]]; then
        kill -s USR1 "$srun_pid" 2>/dev/null || true   # srun forwards it to every task
    fi
}
trap on_stop_signal USR1
# scancel / time limit / preemption: SLURM signals the step itself; this shell just waits.
trap 'log "SIGTERM: the job is being ended by SLURM"' TERM

"${cmd[@]}" &
srun_pid=$!
rc=0
wait_for_child "$srun_pid" || rc=$?
log "srun exited with $rc"

if requeue_requested "$rc" "$RUN_DIR" "$stamp"; then
    rm -f "$stamp"
    if (( ${SLURM_RESTART_COUNT:-0} >= ${MAX_REQUEUES:-50} )); then
        log "trainer checkpointed for requeue, but the job was already requeued ${SLURM_RESTART_COUNT} times (MAX_REQUEUES=${MAX_REQUEUES:-50}): not requeueing"
        exit 75
    fi
    log "trainer checkpointed and exited for requeue (75): scontrol requeue $SLURM_JOB_ID"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        log "scontrol requeue failed (submitted without --requeue?): resubmit to resume from $SAVE_DIR"
        exit 75
    fi
    exit 0
fi
rm -f "$stamp"
exit "$rc"
