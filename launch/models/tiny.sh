# shellcheck shell=bash
# The tiny CPU recipe (2-layer, 4-expert MoE on gloo): smoke tests of the launch path itself, e.g.
# the fake-SLURM tests in tests/e2e/test_launch.py. GPUS_PER_NODE counts CPU processes here.
export RECIPE="${RECIPE:-examples/configs/tiny_gspo.yaml}"
export PLAN_MODEL="${PLAN_MODEL:-tiny}"   # tools/plan.py preset
export PLAN_ARGS="${PLAN_ARGS:---fp32}"   # the tiny recipe runs fp32
export NNODES="${NNODES:-1}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-1}"
export TP="${TP:-1}"
export PP="${PP:-1}"
export EP="${EP:-1}"
export CP="${CP:-1}"
# Seconds before the time limit at which SLURM asks for a checkpoint (SIGUSR1): a CPU step and checkpoint take seconds.
export SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-60}"
export TIME_LIMIT="${TIME_LIMIT:-00:30:00}"
export RUN_DIR="${RUN_DIR:-runs/tiny_gspo}"
export SAVE_DIR="${SAVE_DIR:-$RUN_DIR/checkpoints}"
