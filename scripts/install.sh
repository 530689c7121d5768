#!/usr/bin/env bash
# Creates .venv in the repo and installs llmtrain with its test dependencies.
# torch is installed first, pinned, so nothing later resolves it to a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! { [ -e /usr/include/libaio.h ] || dpkg -s libaio-dev >/dev/null 2>&1; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing libaio-dev (NVMe offload)"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null \
            || echo "warning: libaio-dev could not be installed; NVMe offload will be unavailable"
    else
        echo "warning: libaio-dev is missing and cannot be installed without root; NVMe offload is unavailable"
    fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, deepspeed, transformers, llmtrain" 2>/dev/null \
    || { echo "error: installation incomplete (import check failed)"; exit 1; }
# DeepSpeed JIT-builds its CPU ops (about a minute each) on first use; build them once here so the
# first training run or test does not pay for it (and parallel first uses do not race on the build).
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "building DeepSpeed's CPU ops (cpu_adam, fused_adam, async_io) once"
    DS_ACCELERATOR=cpu .venv/bin/python - <<'PY' || echo "warning: prebuilding DeepSpeed ops failed; they will build on first use"
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder
from deepspeed.ops.op_builder import AsyncIOBuilder

CPUAdamBuilder().load(verbose=False)
FusedAdamBuilder().load(verbose=False)
if AsyncIOBuilder().is_compatible(verbose=False):
    AsyncIOBuilder().load(verbose=False)
PY
fi
echo "installed into .venv"
