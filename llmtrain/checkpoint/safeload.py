"""Loading a checkpoint without letting it execute code.

DeepSpeed 0.19.8 calls `torch.load(weights_only=False)` explicitly everywhere (its checkpoint engine,
zero_to_fp32, ds_to_universal, the universal loader), with no option to change it, and DeepSpeed's
`load_checkpoint` silently starts from scratch when it finds nothing. So (a) every `.pt` file is scanned
first with `weights_only` rules and an explicit allow-list, naming the file and the global it refuses,
(b) DeepSpeed's own loads run with TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 and the same allow-list, which turns
its `weights_only=False` into True, and (c) loading nothing is an error. llmtrain's own state is JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.checkpoint.common import RNG_KEY, STATE_FILE, CheckpointError
from llmtrain.checkpoint.reading import checkpoint_dir
from llmtrain.envvar import set_for_block


# What DeepSpeed 0.19.8 pickles into its .pt files beyond tensors and builtins, found by saving ZeRO
# 0/1/2/3 in fp32 and bf16, with and without CPU offload, and listing what `weights_only` rejects
# (torch.serialization.get_unsafe_globals_in_checkpoint). Each is inert data: an int enum, a two-int
# dataclass, and the static loss scaler (two attributes; no __setstate__/__reduce__, so unpickling
# only fills its __dict__). The ZeRO-1/2/3 optimizer shards hold all three; stage 0 files hold none.
def _allowed_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _unsafe_globals(path: Path) -> list[str]:
    """Globals a weights-only load of `path` would refuse (read from the pickle, nothing executed)."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _allowed_globals()}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:  # not a zip checkpoint: fall back to a full weights-only load
        return _unsafe_by_loading(path, exc)
    return sorted(set(found) - allowed)


def _unsafe_by_loading(path: Path, reason: Exception) -> list[str]:
    import pickle

    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.findall(r"GLOBAL ([\w.]+)", str(exc))
        return found or [f"unreadable ({str(exc).splitlines()[0]})"]
    except Exception as exc:
        return [f"unreadable ({type(exc).__name__}: {exc}; {reason})"]
    return []


def scan_pickles(ckpt_dir: Path) -> None:
    """Refuse a checkpoint whose `.pt` files hold anything but tensors, builtins and allow-listed records."""
    for path in sorted(Path(ckpt_dir).rglob("*.pt")):
        bad = _unsafe_globals(path)
        if bad:
            raise CheckpointError(
                f"{path}: refusing to load, it holds objects a weights-only load does not allow: "
                + ", ".join(bad)
            )


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside, DeepSpeed's `weights_only=False` calls included, is weights-only."""
    with (
        set_for_block("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1"),
        torch.serialization.safe_globals(_allowed_globals()),
    ):
        yield


def load(engine: Any, ckpt_root: Path, tag: str) -> dict[str, Any]:
    """Load model + optimizer into `engine` (its `load`); return this rank's client state, RNG under
    `rng`. A rank beyond the saved world size gets rank 0's client state and `rng` None (RNG streams
    are per rank; they do not map onto a new world size)."""
    path = checkpoint_dir(ckpt_root, tag)
    scan_pickles(path)  # whatever the engine's format: no .pt file may hold code
    engine.load(ckpt_root, tag)
    return read_client_state(path, dist.get_rank() if dist.is_initialized() else 0)


def load_deepspeed_files(ds: Any, ckpt_root: Path, tag: str, load_optimizer: bool = True) -> None:
    """DeepSpeed's `load_checkpoint`, pickle-scanned first and weights-only. For a universal tag
    (`step_N_universal`, from `convert_to_universal`) the engine's DS config must carry
    `"checkpoint": {"load_universal": true}`. `load` has scanned the pickles already."""
    path = checkpoint_dir(ckpt_root, tag)
    with weights_only_loads():
        loaded, _ = ds.load_checkpoint(
            str(ckpt_root), tag=tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=False
        )
    if loaded is None:
        raise CheckpointError(f"{path}: DeepSpeed found no model state to load (it would start from scratch)")


def read_client_state(ckpt_dir: Path, rank: int) -> dict[str, Any]:
    """The client state `save` wrote for `rank` (rank 0's, without RNG, for a rank that did not exist)."""
    own = ckpt_dir / STATE_FILE.format(rank=rank)
    source = own if own.is_file() else ckpt_dir / STATE_FILE.format(rank=0)
    try:
        record = json.loads(source.read_text(encoding="utf-8"))
        state = dict(record["client_state"])
        state[RNG_KEY] = record[RNG_KEY] if source == own else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{source}: llmtrain state missing or unreadable ({exc})") from exc
    return state
