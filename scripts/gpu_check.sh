#!/usr/bin/env bash
# `make gpu-check`: the GPU check (bench/gpu_check.py) of an installed llmtrain, on any machine with a
# CUDA device. Results: bench/results/gpu.json, or DIR/gpu.json with --out DIR.
#
#   scripts/gpu_check.sh [--out DIR] [--time-limit SECONDS] [--only SECTION ...] [--dry-run]
#
# It uses the environment llmtrain is installed in: .venv (make install, or make install-offline
# WHEELHOUSE=DIR on a machine without network access), or the Python named by $PYTHON. It installs
# nothing. Without a CUDA device it says so in one line and exits 2 (--dry-run needs none).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ " $* " == *" --dry-run "* ]] && DRY_RUN=1

# No NVIDIA driver at all: say so before looking for an environment.
if [ "$DRY_RUN" = 0 ] && ! command -v nvidia-smi >/dev/null 2>&1 \
    && ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && ! compgen -G "/proc/driver/nvidia/gpus/*" >/dev/null; then
    echo "error: no CUDA device is present (no NVIDIA driver: no nvidia-smi, no /dev/nvidia*); make gpu-check needs an NVIDIA GPU" >&2
    exit 2
fi

PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import torch, llmtrain" >/dev/null 2>&1; then
    echo "error: llmtrain is not installed for $PY: run make install (or make install-offline WHEELHOUSE=DIR without network), or name its Python with PYTHON=" >&2
    exit 2
fi

# bench.gpu_check checks torch's view of the device (a CPU-only torch build, CUDA_VISIBLE_DEVICES) itself.
exec "$PY" -m bench.gpu_check "$@"
