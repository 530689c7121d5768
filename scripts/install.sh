#!/usr/bin/env bash
# Creates .venv in the repo and installs llmtrain with its test dependencies, then builds DeepSpeed's CPU
# ops into it. torch is installed first, pinned, so nothing later resolves it to a CUDA build.
#
# Packages go in with uv when it can be had (installed into the venv from PyPI first): it resolves and
# unpacks in parallel, which took the install from 6 min 20 s with pip to about 1 min on a 2-core machine
# (pip's cache warm, uv's cold). pip's own find-links (a local folder of wheels) is handed to uv, which
# does not read pip's configuration. Without uv, pip does the same work.
#
# --compile-bytecode: uv, unlike pip, leaves .py files uncompiled, and where PYTHONDONTWRITEBYTECODE is set
# (as on CI machines) no .pyc is ever written, so every process compiled torch, DeepSpeed and transformers
# from source: measured on a 2-core AVX2 EPYC, a 4-step two-process run took 40 s wall / 51 s CPU without
# bytecode and 22 s / 22 s with it; a full test run starts hundreds of such processes.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phase() { echo "$1 ($((SECONDS - started)) s)"; }

python3 -m venv .venv
quiet_pip() { .venv/bin/python -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

uv_install() {
    local links=() link
    for link in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
        links+=(--find-links "$link")
    done
    .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python "${links[@]}" "$@"
}

if quiet_pip uv==0.13.9 && [ -x .venv/bin/uv ] && uv_install torch==2.13.0 && uv_install -e ".[test]"; then
    phase "packages installed with uv"
else
    echo "uv unavailable or failed; installing with pip"
    quiet_pip --upgrade pip
    quiet_pip torch==2.13.0
    quiet_pip -e ".[test]"
    phase "packages installed with pip"
fi
.venv/bin/python -c "import torch, deepspeed, transformers, llmtrain" 2>/dev/null \
    || { echo "error: installation incomplete (import check failed)"; exit 1; }
# libaio-dev (Debian's) is what DeepSpeed's async_io op (NVMe offload) compiles against: needed only for the
# op builds below. An apt-get already running (CI installs system packages in the background) goes first.
while pgrep -x apt-get >/dev/null 2>&1 || pgrep -x dpkg >/dev/null 2>&1; do sleep 2; done
if ! { [ -e /usr/include/libaio.h ] || dpkg -s libaio-dev >/dev/null 2>&1; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing libaio-dev (NVMe offload)"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null 2>&1 \
            || echo "warning: libaio-dev could not be installed; NVMe offload will be unavailable"
    else
        echo "warning: libaio-dev is missing and cannot be installed without root; NVMe offload is unavailable"
    fi
fi
# DeepSpeed JIT-builds its CPU ops (about a minute each) on first use; build them once here so the
# first training run or test does not pay for it (and parallel first uses do not race on the build).
# `import llmtrain` first: it puts the venv's torch_extensions folder and its ninja in use, the ones every
# later run uses (another ninja would rebuild every op: llmtrain/__init__.py).
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "building DeepSpeed's CPU ops (cpu_adam, fused_adam, shared-memory all-reduce, async_io) once"
    DS_ACCELERATOR=cpu .venv/bin/python - <<'PY' || echo "warning: prebuilding DeepSpeed ops failed; they will build on first use"
import llmtrain  # noqa: F401  (puts TORCH_EXTENSIONS_DIR inside the venv before DeepSpeed builds)
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder
from deepspeed.ops.op_builder import AsyncIOBuilder

CPUAdamBuilder().load(verbose=False)
FusedAdamBuilder().load(verbose=False)  # the GPU reference configs' Adam: test_dsconfig initialises them
ShareMemCommBuilder().load(verbose=False)  # every multi-process run on one machine all-reduces through it
if AsyncIOBuilder().is_compatible(verbose=False):
    AsyncIOBuilder().load(verbose=False)
PY
    phase "DeepSpeed ops built"
fi
echo "installed into .venv in $((SECONDS - started)) s"
