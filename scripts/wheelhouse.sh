#!/usr/bin/env bash
# Install llmtrain where there is no network access (an air-gapped cluster): build a wheelhouse of
# everything it needs on a machine with access, carry the folder over, install from it alone.
#
#   scripts/wheelhouse.sh build DIR [--python-version X.Y] [--platform TAG]    (make wheelhouse)
#   scripts/wheelhouse.sh install DIR                                         (make install-offline)
#
# build: llmtrain's own wheel, DeepSpeed's (an sdist on PyPI, built here as pure Python: its ops are
# compiled on first use on the target), and every dependency of llmtrain[test] as wheels for the target:
# this machine's python3 ($PYTHON) and platform by default, or --python-version 3.12 --platform
# manylinux_2_28_x86_64 (older compatible manylinux tags are accepted too). pip's own settings decide
# where torch comes from (PyPI's Linux torch is its CUDA build; PIP_INDEX_URL or PIP_EXTRA_INDEX_URL
# name another index, such as PyTorch's CPU one). DIR/wheelhouse.txt records the target.
# install: creates .venv with $PYTHON (default python3, which must match the target's version) and
# installs llmtrain[test] from DIR with pip's --no-index, editable as `make install` does.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    echo "usage: $0 build DIR [--python-version X.Y] [--platform TAG] | $0 install DIR" >&2
    exit 2
}
[ $# -ge 2 ] || usage
MODE=$1 DIR=$2
shift 2
PYTHON=${PYTHON:-python3}

# manylinux_2_28_x86_64 -> itself and every older manylinux tag a machine of that glibc accepts
# (pip downloads for exactly the tags it is given).
platform_flags() {
    local tag=$1
    if [[ $tag =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
        local minor=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]} m
        for ((m = minor; m >= 5; m--)); do echo "--platform manylinux_2_${m}_${arch}"; done
        [ "$minor" -ge 17 ] && echo "--platform manylinux2014_${arch}"
        [ "$minor" -ge 12 ] && echo "--platform manylinux2010_${arch}"
        echo "--platform manylinux1_${arch}"
    else
        echo "--platform $tag"
    fi
}

build() {
    local pyver="" platform="" target=()
    while [ $# -gt 0 ]; do
        case $1 in
            --python-version) pyver=${2:?--python-version needs X.Y}; shift 2 ;;
            --platform) platform=${2:?--platform needs a tag such as manylinux_2_28_x86_64}; shift 2 ;;
            *) usage ;;
        esac
    done
    # No target given: this machine's own (pip then accepts every tag this python3 accepts).
    [ -z "$pyver" ] || target+=(--python-version "$pyver" --implementation cp)
    # shellcheck disable=SC2207
    [ -z "$platform" ] || target+=($(platform_flags "$platform"))
    [ -n "$pyver" ] || pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ -n "$platform" ] || platform="this machine's ($("$PYTHON" -c 'import sysconfig; print(sysconfig.get_platform())'))"
    mkdir -p "$DIR"
    local deepspeed
    deepspeed=$(grep -o '"deepspeed==[^"]*"' pyproject.toml | tr -d '"')
    echo "building llmtrain's and ${deepspeed}'s wheels"
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps -w "$DIR" . "$deepspeed"
    local own
    own=$(ls -t "$DIR"/llmtrain-*.whl | head -1)
    echo "downloading llmtrain[test]'s dependencies for Python $pyver on $platform"
    "$PYTHON" -m pip download -q --only-binary=:all: "${target[@]}" --find-links "$DIR" -d "$DIR" \
        "${own}[test]" "setuptools>=68"
    rm -f "$own"  # install-offline installs the checkout itself (editable); its wheel would go stale
    printf 'python %s\nplatform %s\n' "$pyver" "$platform" >"$DIR/wheelhouse.txt"
    echo "wheelhouse $DIR: $(find "$DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1); on the target: make install-offline WHEELHOUSE=$DIR"
}

install() {
    [ $# -eq 0 ] || usage
    [ -d "$DIR" ] || { echo "error: WHEELHOUSE $DIR: no such directory; build one with make wheelhouse" >&2; exit 2; }
    local want have
    want=$(sed -n 's/^python //p' "$DIR/wheelhouse.txt" 2>/dev/null || true)
    have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ -n "$want" ] && [ "$want" != "$have" ]; then
        echo "error: WHEELHOUSE $DIR holds wheels for Python $want, $PYTHON is $have: name a Python $want with PYTHON=" >&2
        exit 2
    fi
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install -q --no-index --find-links "$DIR" -e ".[test]"
    .venv/bin/python -c "import torch, deepspeed, transformers, llmtrain" \
        || { echo "error: installation incomplete (import check failed)" >&2; exit 1; }
    echo "installed into .venv from $DIR (DeepSpeed builds its ops on first use: a C++ compiler is needed)"
}

case $MODE in
    build) build "$@" ;;
    install) install "$@" ;;
    *) usage ;;
esac
