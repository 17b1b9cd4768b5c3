# shellcheck shell=bash
# Qwen3-30B-A3B GSPO: one node of 8 x 80 GB for the recipe's TP4 EP8 layout with trainer.offload
# (the EP group is the node: the MoE all-to-all stays on NVLink); NNODES=2 runs the same layout at
# DP 4 with more room. The layout itself is the recipe's parallel: section (change it with
# --parallel.<field>=N arguments). Sourced by launch/common.sh; every value here can be
# overridden from the environment.
export RECIPE="${RECIPE:-examples/configs/qwen3_30b_a3b_gspo.yaml}"
export NNODES="${NNODES:-1}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# Seconds before the time limit at which SLURM asks for a checkpoint (SIGUSR1): one step (4096-token rollouts) plus a ~0.5 TB checkpoint write (weights + fp32 Adam state).
export SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-600}"
export TIME_LIMIT="${TIME_LIMIT:-04:00:00}"
export RUN_DIR="${RUN_DIR:-runs/qwen3-30b-a3b-gspo}"
export SAVE_DIR="${SAVE_DIR:-/checkpoints/qwen3-30b-a3b-gspo}"
