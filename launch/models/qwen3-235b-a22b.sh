# shellcheck shell=bash
# Qwen3-235B-A22B GSPO: 16 nodes x 8 H100 80GB = 128 GPUs for the recipe's TP4 PP1 EP64 layout (see
# the recipe's header for why 128 GPUs is the smallest count with headroom). The layout itself is
# the recipe's parallel: section (change it with --parallel.<field>=N arguments). Sourced by
# launch/common.sh; every value here can be overridden from the environment.
export RECIPE="${RECIPE:-examples/configs/qwen3_235b_a22b_gspo.yaml}"
export NNODES="${NNODES:-16}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# Seconds before the time limit at which SLURM asks for a checkpoint (SIGUSR1): one step (4096-token rollouts) plus a ~3 TB checkpoint write (weights + fp32 Adam state).
export SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-900}"
export TIME_LIMIT="${TIME_LIMIT:-04:00:00}"
export RUN_DIR="${RUN_DIR:-runs/qwen3-235b-a22b-gspo}"
export SAVE_DIR="${SAVE_DIR:-/checkpoints/qwen3-235b-a22b-gspo}"
