"""Which DeepSpeed accelerator this machine runs: "cuda" or "cpu", exported as DS_ACCELERATOR.

DeepSpeed picks its accelerator when first imported, and on a machine without a GPU it guesses CUDA;
`select_accelerator()` must run before that, so a CPU machine gets DeepSpeed's `cpu` accelerator and
gloo without the user setting DS_ACCELERATOR. Free of torch where DS_ACCELERATOR is already set: the
launching `llmtrain` process, which trains nothing, then never imports it (1.4 s of CPU per launch on a
2-core AMD EPYC).
"""

from __future__ import annotations

import os


def select_accelerator() -> str:
    """ "cuda" when a GPU is usable, else "cpu"; a DS_ACCELERATOR already set wins."""
    chosen = os.environ.get("DS_ACCELERATOR")
    if not chosen:
        import torch

        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ["DS_ACCELERATOR"] = chosen
    return chosen
