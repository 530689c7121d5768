"""Crash-safe checkpoints on top of DeepSpeed: save, verify, choose, safe load, prune, universal conversion.

- `commit`: every rank writes into a staging dir; the checkpoint exists only once every rank reported
  success, every file was fsynced and checksummed into `manifest.json`, and rank 0 renamed it into place
  and replaced `latest` atomically (the commit point). Old checkpoints are pruned after a commit.
- `space`: before a save, its expected size against every rank's free disk space (plus
  `checkpoint.min_free`); a checkpoint that cannot fit is refused before anything is written.
- `reading`: `latest`, the complete and intact checkpoints, the one to resume from (falling back past
  damage unless strict), every path validated to stay inside the checkpoint root.
- `safeload`: nothing read from a checkpoint may execute code: `.pt` pickles are scanned against an
  allow-list and DeepSpeed's loads are forced weights-only; llmtrain's own state is JSON per rank.
- `rng`: the per-rank RNG states, as JSON.
- `universal`: conversion for resuming with a different world size.
- `consolidate`: full fp32 weights for export, from any ZeRO stage.
- `common`, `collective`: the on-disk names and records, file helpers, and collectives that are no-ops
  without a process group.

Callers use this package as one module: `from llmtrain import checkpoint; checkpoint.save(...)`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmtrain.checkpoint.common import (
    LATEST,
    MANIFEST,
    RNG_KEY,
    STAGING,
    TAG_RE,
    UNIVERSAL_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    Choice,
    SaveResult,
    tag_for,
)
from llmtrain.checkpoint.reading import (
    checkpoint_dir,
    choose_checkpoint,
    list_complete,
    needs_universal,
    read_latest,
    read_manifest,
    saved_layout,
    verify,
)

if TYPE_CHECKING:
    from llmtrain.checkpoint.commit import plan_prune, prune, save, write_deepspeed_files
    from llmtrain.checkpoint.consolidate import consolidated_fp32_state_dict
    from llmtrain.checkpoint.rng import restore_rng, rng_state
    from llmtrain.checkpoint.safeload import (
        load,
        load_deepspeed_files,
        read_client_state,
        scan_pickles,
        weights_only_loads,
    )
    from llmtrain.checkpoint.space import SizeEstimate, SpaceRule, expected_size, free_bytes
    from llmtrain.checkpoint.universal import convert_to_universal

# The parts that need torch, imported on first use: `llmtrain resume` and `train --resume auto` read
# the checkpoints (common, reading) in the launching process, which trains nothing and imports no torch.
_NEED_TORCH = {
    "commit": ("plan_prune", "prune", "save", "write_deepspeed_files"),
    "consolidate": ("consolidated_fp32_state_dict",),
    "rng": ("restore_rng", "rng_state"),
    "safeload": ("load", "load_deepspeed_files", "read_client_state", "scan_pickles", "weights_only_loads"),
    "space": ("SizeEstimate", "SpaceRule", "expected_size", "free_bytes"),
    "universal": ("convert_to_universal",),
}
_HOME = {name: module for module, names in _NEED_TORCH.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value


__all__ = [
    "LATEST",
    "MANIFEST",
    "RNG_KEY",
    "STAGING",
    "TAG_RE",
    "UNIVERSAL_SUFFIX",
    "CheckpointError",
    "CheckpointInfo",
    "Choice",
    "SaveResult",
    "SizeEstimate",
    "SpaceRule",
    "checkpoint_dir",
    "choose_checkpoint",
    "consolidated_fp32_state_dict",
    "convert_to_universal",
    "expected_size",
    "free_bytes",
    "list_complete",
    "load",
    "load_deepspeed_files",
    "needs_universal",
    "plan_prune",
    "prune",
    "read_client_state",
    "read_latest",
    "read_manifest",
    "restore_rng",
    "rng_state",
    "save",
    "saved_layout",
    "scan_pickles",
    "tag_for",
    "verify",
    "weights_only_loads",
    "write_deepspeed_files",
]
