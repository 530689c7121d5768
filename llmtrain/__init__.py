"""llmtrain: train Llama-style language models with DeepSpeed, from one CPU to a GPU cluster."""

import os
import re
import sys

__version__ = "0.1.0"


def _ops_inside_the_venv() -> None:
    """DeepSpeed JIT-builds its ops into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Inside a
    virtual environment keep them in it: two checkouts then never rebuild each other's ops (their
    build.ninja paths differ) nor wait on a lock the other's killed build left behind.

    And build them with the venv's own ninja, whatever PATH this process started with: torch runs the
    first `ninja` on PATH, and two ninja versions do not read each other's build log ("build log version
    is too old; starting over"), so a process that found the system's ninja (Debian's 1.11) rebuilt every
    op the venv's (1.13) had built, and the next process rebuilt it back: measured, a loopback two-node
    run (its workers put the venv first on PATH) cost two rebuilds of the shared-memory op, 130 s of CPU,
    while every multi-process run on the machine waited on the build lock."""
    inside_venv = sys.prefix != sys.base_prefix
    if inside_venv and "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    if inside_venv and os.access(os.path.join(venv_bin, "ninja"), os.X_OK) and path[0] != venv_bin:
        os.environ["PATH"] = os.pathsep.join([venv_bin, *(p for p in path if p != venv_bin)])


def _arch_list_deepspeed_can_read() -> None:
    """DeepSpeed's JIT builder (0.19) reads TORCH_CUDA_ARCH_LIST as numbers and fails on the
    architecture-specific entries torch accepts ("9.0a", "10.0f"): `invalid literal for int() with base 10:
    '0a'` at the first FusedAdam, so no GPU run starts. Measured on an H200 whose CUDA image sets such a
    list. The suffix only enables features of one architecture that DeepSpeed's ops do not use, so the
    plain number builds the same op; entries that are already plain, and "+PTX", are kept."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch_list:
        return
    entries = arch_list.replace(";", " ").split()
    readable = [re.sub(r"^(\d+\.\d+)[af]", r"\1", entry) for entry in entries]
    if readable != entries:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(readable))


_ops_inside_the_venv()
_arch_list_deepspeed_can_read()
