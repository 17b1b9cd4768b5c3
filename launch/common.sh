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

# Source the model's argument file: exports RECIPE, NNODES, GPUS_PER_NODE, RUN_DIR, SAVE_DIR, ...
# (each only when not already set in the environment). The parallel layout is not among them: it
# is the recipe's `parallel:` section, changed with --parallel.<field>=N arguments (plan_layout).
load_model() {
    local root model=${1:-} var
    root=$(gspo_root)
    [[ -n "$model" ]] || die "MODEL is not set; known models: $(known_models)"
    if [[ "$model" == */* || ! -f "$root/launch/models/$model.sh" ]]; then
        die "unknown model '$model': no launch/models/$model.sh; known models: $(known_models)"
    fi
    # These variables used to set the layout; now they would be silently ignored.
    for var in TP PP EP ETP CP; do
        [[ -z "${!var:-}" ]] || die "$var=${!var} is not used: the layout is the recipe's parallel: section; pass --$(layout_field "$var")=${!var} instead"
    done
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

# The recipe field of a layout size: TP -> parallel.tensor_model_parallel_size, ...
layout_field() {
    case $1 in
        TP) echo parallel.tensor_model_parallel_size ;;
        PP) echo parallel.pipeline_model_parallel_size ;;
        EP) echo parallel.expert_model_parallel_size ;;
        ETP) echo parallel.expert_tensor_parallel_size ;;
        CP) echo parallel.context_parallel_size ;;
    esac
}

# The trainer's arguments: the recipe, then the run and checkpoint directories (so the requeued job
# finds its checkpoint), then the caller's --section.field=value overrides ($@), which win.
trainer_args() {
    TRAINER_ARGS=(--config "$RECIPE" "--logging.run_dir=$RUN_DIR" "--checkpoint.save_dir=$SAVE_DIR" "$@")
}

# The run's layout, read by gspo-plan from the trainer's own arguments ($2...: --config RECIPE and
# the overrides, parsed as gspo-train parses them) and checked on $1 GPUs: the sizes divide the
# GPUs, heads and experts, and the memory estimate fits in GPU_MEMORY_GIB. Sets TP PP EP ETP CP
# (ETP resolved: the recipe's, else TP), or leaves them empty when the arguments do not load.
# Returns the planner's status (0: the layout works); its report goes to stderr.
# `python -m` from the checkout (PYTHONPATH), not the gspo-plan script: the submit host need not
# have the package installed, only its dependencies.
plan_layout() {
    local gpus=$1 line rc=0
    shift
    line=$(PYTHONPATH="$(gspo_root)${PYTHONPATH:+:$PYTHONPATH}" "${PLAN_PYTHON:-${PYTHON:-python3}}" \
               -m gspo_megatron.tools.plan --print-layout --gpus "$gpus" \
               --gpu-memory "${GPU_MEMORY_GIB:-80}" "$@") || rc=$?
    read -r TP PP EP ETP CP <<<"$line" || true
    if ! [[ "$TP $PP $EP $ETP $CP" =~ ^[0-9]+( [0-9]+){4}$ ]]; then
        TP="" PP="" EP="" ETP="" CP=""
        return 2
    fi
    return "$rc"
}

# Checks that must pass before anything is submitted or started; each failure is one clear
# message and a non-zero exit. Needs the variables load_model sets and TRAINER_ARGS
# (trainer_args); sets the layout variables (plan_layout).
validate_launch() {
    local gpus rc=0
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
    plan_layout "$gpus" "${TRAINER_ARGS[@]}" || rc=$?
    [[ -n "$TP" ]] || die "gspo-plan could not read the layout from $RECIPE and the arguments (message above)"
    (( rc == 0 )) && return 0
    if [[ "${SKIP_PLAN:-0}" == 1 ]]; then
        log "SKIP_PLAN=1: going ahead although gspo-plan refused the layout"
        return 0
    fi
    die "layout TP=$TP PP=$PP EP=$EP ETP=$ETP CP=$CP does not work on $NNODES node(s) x $GPUS_PER_NODE GPUs = $gpus GPUs for $RECIPE (gspo-plan above); change the recipe's parallel: section or pass --parallel.<field>=N, or NNODES/GPUS_PER_NODE"
}

# gspo-train --check on $1 GPUs with the trainer's arguments (TRAINER_ARGS): the data, reward,
# tokenizer and checkpoint reachable from this host, the memory plan; one line per problem and a
# verdict; a failed check stops the launch (exit 2). Like the planner, run from the checkout.
check_run() {
    PYTHONPATH="$(gspo_root)${PYTHONPATH:+:$PYTHONPATH}" GPU_MEMORY_GIB="${GPU_MEMORY_GIB:-80}" \
        "${PLAN_PYTHON:-${PYTHON:-python3}}" -m gspo_megatron.cli --check --gpus "$1" \
        "${TRAINER_ARGS[@]}" >&2 || die "gspo-train --check refused the run (lines above)"
}

# Wait for the background child $1 and return its exit status. A trapped signal makes `wait`
# return early (status > 128) while the child still runs: wait again then.
wait_for_child() {
    local pid=$1 rc
    while :; do
        rc=0
        wait "$pid" || rc=$?
        if (( rc > 128 )) && kill -0 "$pid" 2>/dev/null; then
            continue
        fi
        return "$rc"
    done
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
