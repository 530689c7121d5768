"""RNG states as JSON: python, numpy, torch CPU and CUDA generators of one process.

Saved per rank next to DeepSpeed's files so a resumed run draws the same random numbers (dropout, data
order) as an uninterrupted one. JSON rather than pickle: nothing read from a checkpoint may execute code.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU (and CUDA) RNG states as JSON-safe data."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [np_name, [int(k) for k in np_keys], int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `rng_state`."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()
