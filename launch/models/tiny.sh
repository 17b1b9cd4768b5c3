# shellcheck shell=bash
# The tiny CPU recipe (2-layer, 4-expert MoE on gloo, fp32): smoke tests of the launch path itself,
# e.g. the fake-SLURM tests in tests/e2e/test_launch.py. GPUS_PER_NODE counts CPU processes here;
# the recipe has no model parallelism (more processes are data parallel), and
# --parallel.expert_model_parallel_size=2 splits the experts over two.
export RECIPE="${RECIPE:-examples/configs/tiny_gspo.yaml}"
export NNODES="${NNODES:-1}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-1}"
# Seconds before the time limit at which SLURM asks for a checkpoint (SIGUSR1): a CPU step and checkpoint take seconds.
export SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-60}"
export TIME_LIMIT="${TIME_LIMIT:-00:30:00}"
export RUN_DIR="${RUN_DIR:-runs/tiny_gspo}"
export SAVE_DIR="${SAVE_DIR:-$RUN_DIR/checkpoints}"
