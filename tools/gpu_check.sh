#!/usr/bin/env bash
# All the GPU work in one invocation on a fresh GPU machine (Python 3.12 + CUDA torch, no
# megatron-core, no Transformer Engine): install the carried wheels, then run tools/gpu_check.py,
# which writes OUT/gpu_check.json (figures per stage) and OUT/gpu_check.log (all output).
#
#   tools/gpu_check.sh [OUT] [extra args for tools.gpu_check, e.g. --size smoke --parallel 6
#                                   --deadline 230, or --only slice_mfu]
#
# Wheels: put a cp312 megatron-core wheel in .whl/ first (docs/benchmarks.md section 6), and
# carry .whl to the GPU machine (it is git-ignored: without it every stage fails on
# "No module named 'megatron'"):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
set -euo pipefail

OUT="${1:-runs/gpu_check}"
shift || true
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/gspo_site}"
PYTHON="${PYTHON:-python3}"

cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import megatron.core" 2> /dev/null; then  # before any device time is spent
    echo "gpu_check: megatron-core does not import: put a cp312 wheel in $WHEELS/ and carry it" >&2
    exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PYTHON" -m tools.gpu_check --out "$OUT" "$@"
