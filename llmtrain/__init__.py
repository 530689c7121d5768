"""llmtrain: train Llama-style language models with DeepSpeed, from one CPU to a GPU cluster."""

import os
import sys

__version__ = "0.1.0"


def _ops_inside_the_venv() -> None:
    """DeepSpeed JIT-builds its ops into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Inside a
    virtual environment keep them in it: two checkouts then never rebuild each other's ops (their
    build.ninja paths differ) nor wait on a lock the other's killed build left behind."""
    inside_venv = sys.prefix != sys.base_prefix
    if inside_venv and "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")


_ops_inside_the_venv()
