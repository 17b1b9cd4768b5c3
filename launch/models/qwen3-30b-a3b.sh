# shellcheck shell=bash
# Qwen3-30B-A3B GSPO: 2 nodes x 8 H100 80GB, TP2 EP8 (one EP group per node, the MoE all-to-all
# stays on NVLink). Sourced by launch/common.sh; every value can be overridden from the environment.
export RECIPE="${RECIPE:-examples/configs/qwen3_30b_a3b_gspo.yaml}"
export PLAN_MODEL="${PLAN_MODEL:-qwen3-30b-a3b}"   # tools/plan.py preset
export NNODES="${NNODES:-2}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
export TP="${TP:-2}"
export PP="${PP:-1}"
export EP="${EP:-8}"
export ETP="${ETP:-1}"
export CP="${CP:-1}"
# Seconds before the time limit at which SLURM asks for a checkpoint (SIGUSR1): one step (4096-token rollouts) plus a ~0.5 TB checkpoint write (weights + fp32 Adam state).
export SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-600}"
export TIME_LIMIT="${TIME_LIMIT:-04:00:00}"
export RUN_DIR="${RUN_DIR:-runs/qwen3-30b-a3b-gspo}"
export SAVE_DIR="${SAVE_DIR:-/checkpoints/qwen3-30b-a3b-gspo}"
