# shellcheck shell=bash
# Qwen3-235B-A22B GSPO: 16 nodes x 8 H100 80GB = 128 GPUs, TP4 PP2 EP32 (see the recipe's header
# for why 128 GPUs is the smallest count with headroom). Sourced by launch/common.sh; every value
# can be overridden from the environment.
export RECIPE="${RECIPE:-examples/configs/qwen3_235b_a22b_gspo.yaml}"
export PLAN_MODEL="${PLAN_MODEL:-qwen3-235b-a22b}"   # tools/plan.py preset
export NNODES="${NNODES:-16}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
export TP="${TP:-4}"
export PP="${PP:-2}"
export EP="${EP:-32}"
export ETP="${ETP:-1}"
export CP="${CP:-1}"
# Seconds before the time limit at which SLURM asks for a checkpoint (SIGUSR1): one step (4096-token rollouts, PP=2) plus a ~3 TB checkpoint write (weights + fp32 Adam state).
export SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-900}"
export TIME_LIMIT="${TIME_LIMIT:-04:00:00}"
export RUN_DIR="${RUN_DIR:-runs/qwen3-235b-a22b-gspo}"
export SAVE_DIR="${SAVE_DIR:-/checkpoints/qwen3-235b-a22b-gspo}"
