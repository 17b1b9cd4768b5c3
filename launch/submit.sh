#!/usr/bin/env bash
# Validate, then submit launch/sbatch_train.sh. Nothing reaches sbatch unless every check passes:
# the model has an argument file, the container image exists (local .sqsh), and the recipe's
# layout (with the overrides) divides the GPUs, heads and experts and fits in memory (gspo-plan).
#
#   MODEL=qwen3-30b-a3b launch/submit.sh [--dry-run] [--section.field=value ...]
#   MODEL=qwen3-30b-a3b NNODES=4 launch/submit.sh --parallel.expert_model_parallel_size=16
#   MODEL=qwen3-235b-a22b CONTAINER_IMAGE=/shared/images/pytorch.sqsh \
#       CONTAINER_MOUNTS=/data:/data,/checkpoints:/checkpoints launch/submit.sh --data.train_path=/data/train.parquet
#
# Account, partition, QoS: the usual SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_QOS environment
# variables, or SBATCH_ARGS="--account=x --partition=y".
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
GSPO_ROOT=$(gspo_root)
export GSPO_ROOT

dry_run=()
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=(--dry-run)
    shift
fi

export MODEL="${MODEL:-qwen3-30b-a3b}"
load_model "$MODEL"
trainer_args "$@"
validate_launch

log_dir="${LOG_DIR:-$RUN_DIR/slurm-logs}"   # with the run (runs/ is git-ignored)
sbatch_args=(--nodes="$NNODES" --gpus-per-node="$GPUS_PER_NODE" --time="$TIME_LIMIT"
             --signal="B:USR1@${SIGNAL_LEAD_S:-300}" --requeue
             --job-name="${JOB_NAME:-gspo-$MODEL}" --output="$log_dir/%x-%j.out"
             --chdir="$GSPO_ROOT" --export=ALL)
# shellcheck disable=SC2206  # word-split on purpose
sbatch_args+=(${SBATCH_ARGS:-})

if (( ${#dry_run[@]} )); then
    # Everything the run would read (gspo-train --check: data, reward, tokenizer, checkpoint,
    # memory), then the srun command line the batch script would run; nothing is submitted.
    check_run "$((NNODES * GPUS_PER_NODE))"
    log "dry run: would submit: sbatch ${sbatch_args[*]} $GSPO_ROOT/launch/sbatch_train.sh $*"
    LAUNCH_CHECKED=1 exec bash "$GSPO_ROOT/launch/sbatch_train.sh" --dry-run "$@"
fi
mkdir -p "$log_dir"
log "submitting $MODEL: $NNODES node(s) x $GPUS_PER_NODE GPUs, TP=$TP PP=$PP EP=$EP ETP=$ETP CP=$CP, run dir $RUN_DIR"
exec sbatch "${sbatch_args[@]}" "$GSPO_ROOT/launch/sbatch_train.sh" "$@"
