# shellcheck shell=bash
# Shared helpers for the launch scripts (sourced, never run). Every setting is an environment
# variable with a default; see docs/launch.md for the list.

# The repository root: GSPO_ROOT when set (submit.sh exports it, because SLURM runs a *copy* of the
# batch script from its spool directory), else the parent of this file's directory.
gspo_root() {
    if [[ -n "${GSPO_ROOT:-}" ]]; then
        printf '%s\n' "$GSPO_ROOT"
    else
        (cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    fi
}

log() { printf '[launch %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'launch: error: %s\n' "$*" >&2; exit 2; }

# Model argument files: launch/models/<name>.sh.
known_models() {
    local root f names=()
    root=$(gspo_root)
    for f in "$root"/launch/models/*.sh; do
        [[ -e "$f" ]] || continue
        f=${f##*/}
        names+=("${f%.sh}")
    done
    printf '%s\n' "${names[*]}"
}

# Source the model's argument file: exports RECIPE, NNODES, GPUS_PER_NODE, TP/PP/EP/ETP/CP,
# PLAN_MODEL, RUN_DIR, SAVE_DIR (each only when not already set in the environment).
load_model() {
    local root model=${1:-}
    root=$(gspo_root)
    [[ -n "$model" ]] || die "MODEL is not set; known models: $(known_models)"
    if [[ "$model" == */* || ! -f "$root/launch/models/$model.sh" ]]; then
        die "unknown model '$model': no launch/models/$model.sh; known models: $(known_models)"
    fi
    # shellcheck source=/dev/null
    source "$root/launch/models/$model.sh"
    : "${RECIPE:?launch/models/$model.sh must set RECIPE}"
    # Relative paths are relative to the repository, whatever directory a node starts in.
    [[ "$RECIPE" == /* ]] || RECIPE="$root/$RECIPE"
    : "${RUN_DIR:?launch/models/$model.sh must set RUN_DIR}" "${SAVE_DIR:=$RUN_DIR/checkpoints}"
    [[ "$RUN_DIR" == /* ]] || RUN_DIR="$root/$RUN_DIR"
    [[ "$SAVE_DIR" == /* ]] || SAVE_DIR="$root/$SAVE_DIR"
    export RECIPE RUN_DIR SAVE_DIR
}

# Checks that must pass before anything is submitted or started; each failure is one clear
# message and a non-zero exit. Needs the variables load_model sets.
validate_launch() {
    local root gpus
    root=$(gspo_root)
    [[ -f "$RECIPE" ]] || die "recipe $RECIPE does not exist (model ${MODEL:-?})"
    [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
    [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE must be a positive integer, got '$GPUS_PER_NODE'"
    if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
        # A local path (a squashfs made by `enroot import`) must exist on the submit host; a
        # registry reference (nvcr.io#nvidia/pytorch:25.01-py3, docker://...) is pulled by pyxis.
        if [[ "$CONTAINER_IMAGE" == /* || "$CONTAINER_IMAGE" == ./* || "$CONTAINER_IMAGE" == *.sqsh ]]; then
            [[ -f "$CONTAINER_IMAGE" ]] || die "container image $CONTAINER_IMAGE does not exist (CONTAINER_IMAGE); build it with 'enroot import -o $CONTAINER_IMAGE docker://nvcr.io#nvidia/pytorch:<tag>'"
        fi
    fi
    gpus=$((NNODES * GPUS_PER_NODE))
    if [[ "${SKIP_PLAN:-0}" == 1 ]]; then
        log "SKIP_PLAN=1: layout not checked"
        return 0
    fi
    local plan_args=(--model "$PLAN_MODEL" --gpus "$gpus" --gpu-memory "${GPU_MEMORY_GIB:-80}"
                     --tp "$TP" --pp "$PP" --ep "$EP" --cp "$CP")
    [[ -n "${ETP:-}" ]] && plan_args+=(--etp "$ETP")
    # PLAN_ARGS: extra planner flags from the model file (word-split on purpose, e.g. "--fp32").
    # shellcheck disable=SC2206
    plan_args+=(${PLAN_ARGS:-})
    if ! PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "${PLAN_PYTHON:-python3}" \
            "$root/tools/plan.py" "${plan_args[@]}" >&2; then
        die "layout TP=$TP PP=$PP EP=$EP CP=$CP${ETP:+ ETP=$ETP} does not work on $NNODES node(s) x $GPUS_PER_NODE GPUs = $gpus GPUs for $PLAN_MODEL (tools/plan.py above); set TP/PP/EP/CP/NNODES/GPUS_PER_NODE"
    fi
}

# The trainer's layout, checkpoint and run directory as --section.field overrides, so the layout
# the planner checked is the one that runs and the requeued job finds its checkpoint.
trainer_overrides() {
    TRAINER_ARGS=(--config "$RECIPE"
                  "--parallel.tensor_model_parallel_size=$TP"
                  "--parallel.pipeline_model_parallel_size=$PP"
                  "--parallel.expert_model_parallel_size=$EP"
                  "--parallel.context_parallel_size=$CP"
                  "--logging.run_dir=$RUN_DIR"
                  "--checkpoint.save_dir=$SAVE_DIR")
    [[ -n "${ETP:-}" ]] && TRAINER_ARGS+=("--parallel.expert_tensor_parallel_size=$ETP")
    return 0
}

# Whether the trainer asked to be requeued: exit code 75 directly (single process), or rank 0's
# summary.json (written after the launch stamp) saying so. torchrun reports any non-zero worker
# exit as its own exit code 1, so the worker's 75 only survives in summary.json.
requeue_requested() {
    local rc=$1 summary="$2/summary.json" stamp=$3
    [[ "$rc" == 75 ]] && return 0
    [[ -f "$summary" && "$summary" -nt "$stamp" ]] || return 1
    grep -Eq '"exit_code": *75\b' "$summary"
}
