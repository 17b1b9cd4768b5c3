#!/usr/bin/env bash
# shellcheck disable=SC2317  # functions called from traps look unreachable to shellcheck
# One node's share of a run: `torchrun` with this node's rank, then the trainer on GPUS_PER_NODE
# local processes. sbatch_train.sh starts it once per node (srun, inside the container when one is
# set); torchrun_single_node.sh starts it directly. Arguments go to gspo-train
# (`python -m gspo_megatron.cli`).
#
#   NNODES=1 NODE_RANK=0 GPUS_PER_NODE=8 MASTER_ADDR=host MASTER_PORT=29500 \
#       launch/torchrun_node.sh --config recipe.yaml [--section.field=value ...]
#
# Signals: SIGUSR1 is the "checkpoint and exit for requeue" request. torchrun itself treats every
# signal it handles as fatal (it forwards it, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT, then SIGKILLs
# the workers), and an unhandled SIGUSR1 would kill it outright; so torchrun is started with
# SIGUSR1 ignored, and this script forwards SIGUSR1 to the trainer processes (torchrun's children,
# found by parent pid), which finish the step, checkpoint and exit 75. SIGTERM (scancel, time
# limit) is left to torchrun's own handling: forwarded to the workers, which also checkpoint on it.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ROOT=$(gspo_root)

NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"
# The layout: exported by the launcher that checked it (sbatch_train.sh, torchrun_single_node.sh);
# when this script is run by hand, read from the trainer arguments the same way (no verdict here:
# the trainer validates the layout itself).
if [[ -z "${TP:-}" || -z "${CP:-}" ]]; then
    plan_layout "$((NNODES * GPUS_PER_NODE))" "$@" 2>/dev/null || true
fi

# --- environment of a Megatron MoE job on Hopper (each overridable from the environment) -------
# Megatron's tensor/context-parallel communication overlap relies on kernels reaching the GPU in
# issue order, i.e. one hardware work queue per device; with TP = CP = 1 there is nothing to order
# and more queues let the data-parallel overlap run concurrently.
if (( ${TP:-1} > 1 || ${CP:-1} > 1 )); then
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
fi
# Rollouts of varying length allocate tensors of ever-changing sizes: expandable segments let the
# caching allocator grow blocks in place instead of fragmenting memory into unusable pieces.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# Release NCCL's input buffers by event synchronisation instead of recordStream, which keeps
# them alive until the communication stream catches up (peak-memory spikes with many collectives).
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
# A hung or failed collective aborts the process group, so a dead node fails the job instead of
# holding the allocation until the wall-clock limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# NVLink SHARP allocates extra buffers per communicator; an MoE layout has many (TP, EP, DP,
# expert-DP, PP groups), costing GBs of GPU memory for little gain at these message sizes.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
# InfiniBand: a longer retransmit timeout (4.096 us x 2^22 ~ 17 s) and the maximum retry count ride
# out transient fabric congestion at scale instead of failing the collective.
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export NCCL_IB_RETRY_CNT="${NCCL_IB_RETRY_CNT:-7}"
# Spread each connection over several queue pairs so the EP all-to-all uses every IB rail's
# adaptive routing (one QP per connection can pin a flow to a single path).
export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-2}"
# Warnings only; set NCCL_DEBUG=INFO to see the topology and transports NCCL picked.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# torchrun's grace period between forwarding SIGTERM and SIGKILLing the workers: long enough to
# finish a step and write a checkpoint (the default 30 s is not, for a 235B model).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}"
# The package from this checkout, installed or not (a container mounts the repository).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The workers of torchrun $1: its direct children (parent pid from /proc, no pgrep needed).
# shellcheck disable=SC2329  # invoked from a trap
children_of() {
    local stat rest fields
    for stat in /proc/[0-9]*/stat; do
        rest=$(cat "$stat" 2>/dev/null) || continue
        rest=${rest##*) }              # drop "pid (comm) ", comm may contain spaces
        read -r -a fields <<<"$rest"   # fields[0] = state, fields[1] = ppid
        if [[ "${fields[1]:-}" == "$1" ]]; then
            stat=${stat#/proc/}
            printf '%s\n' "${stat%/stat}"
        fi
    done
}

torchrun_pid=""
# shellcheck disable=SC2329  # invoked from a trap
forward_stop() {
    local pid
    log "node $NODE_RANK: SIGUSR1: asking the trainer processes to checkpoint and exit"
    [[ -n "$torchrun_pid" ]] || return 0
    for pid in $(children_of "$torchrun_pid"); do
        kill -s USR1 "$pid" 2>/dev/null || true
    done
}
trap forward_stop USR1
# SIGTERM reaches torchrun directly (same process group); this shell only waits for it.
trap 'log "node $NODE_RANK: SIGTERM"' TERM

log "node $NODE_RANK/$NNODES: torchrun with $GPUS_PER_NODE processes, master $MASTER_ADDR:$MASTER_PORT"
# SIGUSR1 ignored in torchrun (and inherited by the workers until the trainer installs its handler).
(trap '' USR1; exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS_PER_NODE" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    -m gspo_megatron.cli "$@") &
torchrun_pid=$!
rc=0
wait_for_child "$torchrun_pid" || rc=$?
log "node $NODE_RANK: torchrun exited with $rc"
exit "$rc"
