#!/usr/bin/env bash
# One machine, no SLURM: validate the recipe's layout for GPUS_PER_NODE GPUs, then torchrun.
#
#   MODEL=qwen3-30b-a3b launch/torchrun_single_node.sh [--section.field=value ...]
#   MODEL=tiny GPUS_PER_NODE=2 PYTHON=.venv/bin/python launch/torchrun_single_node.sh \
#       --parallel.expert_model_parallel_size=2   # CPU
#
# Exit code 75: the trainer got SIGUSR1 or SIGTERM (send either to this script), wrote a checkpoint and
# stopped; run the same command again to resume.
# shellcheck disable=SC2317  # functions called from traps look unreachable to shellcheck
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
GSPO_ROOT=$(gspo_root)
export GSPO_ROOT

export MODEL="${MODEL:-qwen3-30b-a3b}"
load_model "$MODEL"
export NNODES=1 NODE_RANK=0
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
trainer_args "$@"
validate_launch
# The checked layout, for torchrun_node.sh's environment (CUDA_DEVICE_MAX_CONNECTIONS).
export GPUS_PER_NODE TP PP EP ETP CP

mkdir -p "$RUN_DIR"
stamp="$RUN_DIR/.launch-local-$$"
touch "$stamp"
node_pid=""
# shellcheck disable=SC2329  # invoked from a trap
forward() {
    [[ -n "$node_pid" ]] && kill -s "$1" "$node_pid" 2>/dev/null
    return 0
}
# Both mean "checkpoint and exit" to the trainer; forwarded as SIGUSR1, which torchrun leaves to
# the workers (a SIGTERM would make torchrun shut them down after TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
trap 'forward USR1' USR1 TERM
bash "$GSPO_ROOT/launch/torchrun_node.sh" "${TRAINER_ARGS[@]}" &
node_pid=$!
rc=0
wait_for_child "$node_pid" || rc=$?
if requeue_requested "$rc" "$RUN_DIR" "$stamp"; then
    rc=75
fi
rm -f "$stamp"
exit "$rc"
