#!/usr/bin/env bash
# `make gpu-check`: one quick check of a GPU machine (one H200 or similar), under 8 minutes.
# Writes gpu_check_report.json into $OUT when set, else the repo root (see bench/gpu_check.py).
#
# The environment: the project's .venv when it imports torch with CUDA and DeepSpeed. Otherwise (an
# offline GPU machine, where `make install` cannot fetch torch 2.13.0, whose image provides a CUDA build
# of torch for python3), a venv over the system site-packages, with the packages the image lacks
# (deepspeed, hjson, pydantic, datasets, ...) installed from wheels carried in .whl/ (`bash
# scripts/gpu_check.sh --wheels` fills it on a machine with pip access; copy `.whl` to the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null 2>&1 && export DS_ACCELERATOR=cuda
TIME_LIMIT_S=${GPU_CHECK_TIME_LIMIT_S:-470}  # the whole script, set-up included

# Python 3.12 manylinux wheels of what a GPU machine's image lacks, pinned to this project's versions.
WHEELS=(hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        dill==0.4.1 multiprocess==0.70.19 datasets==5.2.0 deepspeed==0.19.8)
if [ "${1:-}" = "--wheels" ]; then
    mkdir -p .whl
    # deepspeed is an sdist on PyPI: build its (pure Python) wheel here, the others are downloaded.
    python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 || exit 1
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]:0:8}" || exit 1
    ls .whl
    exit 0
fi

DRY_RUN=0
[[ " $* " == *" --dry-run "* ]] && DRY_RUN=1  # writes the plan; any machine, no CUDA needed

usable() {
    NEED_CUDA=$((1 - DRY_RUN)) "$1" - <<'PY' 2>/dev/null
import os, torch, deepspeed, datasets, llmtrain
assert torch.cuda.is_available() or os.environ["NEED_CUDA"] == "0"
PY
}

PY=.venv/bin/python
if ! { [ -x "$PY" ] && usable "$PY"; }; then
    VENV=${GPU_CHECK_VENV:-/tmp/llmtrain-gpu-venv}
    PY="$VENV/bin/python"
    if ! { [ -x "$PY" ] && usable "$PY"; }; then
        echo "setting up $VENV over the system python's CUDA torch"
        python3 -m venv --system-site-packages "$VENV" || exit 1
        if compgen -G ".whl/*.whl" >/dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . || exit 1
        if ! usable "$PY"; then
            echo "error: no usable environment: $PY cannot import torch (with CUDA), deepspeed, datasets and llmtrain;"
            echo "       carry the wheels from 'bash scripts/gpu_check.sh --wheels' in .whl/, or run 'make install' where pip can fetch"
            "$PY" -c "import torch, deepspeed, datasets, llmtrain; print(torch.cuda.is_available())"
            exit 1
        fi
    fi
fi
echo "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"

# DeepSpeed JIT-builds FusedAdam on first use; once here, so the parallel runs below do not race on it.
if [ "$DRY_RUN" = 0 ]; then
    timeout 240 "$PY" -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" \
        || echo "warning: prebuilding FusedAdam failed; the runs will try themselves"
fi

timeout $(( TIME_LIMIT_S - SECONDS )) "$PY" -m bench.gpu_check "$@"
