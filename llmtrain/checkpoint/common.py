"""What every part of the checkpoint package shares: on-disk names, records, the error, durable file helpers.

The layout of a checkpoint root is fixed here and only here, so the writer (`commit`), the readers
(`reading`, `safeload`) and the converters (`universal`, `consolidate`) cannot drift apart:

    ckpt_root/latest                    the tag of the newest committed checkpoint (the commit point)
    ckpt_root/step_NNNNNNNN/            one checkpoint: DeepSpeed's files, llmtrain's JSON state, manifest
    ckpt_root/step_NNNNNNNN_universal/  the same step converted for a different world size
    ckpt_root/.incoming/                saves and conversions in progress
    ckpt_root/.trash/                   checkpoints being deleted
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.errors import BadInput
from llmtrain.fsutil import fsync_dir

LATEST = "latest"
MANIFEST = "manifest.json"
STAGING = ".incoming"  # in-progress saves and conversions; never a complete checkpoint
TRASH = ".trash"  # checkpoints being deleted: out of the tag namespace first, then removed
STATE_FILE = "llmtrain_state_rank{rank}.json"
RNG_KEY = "rng"  # reserved key in the dict `load` returns
FORMAT = 1
TAG_RE = re.compile(r"^step_\d{8}$")
UNIVERSAL_SUFFIX = "_universal"
_HASH_CHUNK = 1 << 22


class CheckpointError(BadInput):
    """A checkpoint cannot be used (missing, corrupt, unsafe, unconvertible)."""


@dataclass(frozen=True)
class SaveResult:
    ok: bool
    tag: str
    path: Path | None = None  # the committed checkpoint directory
    error: str | None = None  # every failing rank with its path and error, same text on every rank
    pruned: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointInfo:
    tag: str
    path: Path
    step: int
    world_size: int
    zero_stage: int
    partitioned: bool  # optimizer state sharded per rank: a different world size needs conversion
    created: str
    engine: str = "deepspeed"  # whose format: "deepspeed" files or "fsdp2" distributed checkpoints
    layout: dict[str, int] | None = None  # the saving run's {"tp", "sp", "pp"}; None if not recorded
    kv_replicas: int = 1  # tp ranks that held each key/value head (planning.partition)


@dataclass(frozen=True)
class Choice:
    tag: str
    info: CheckpointInfo
    warnings: list[str] = field(default_factory=list)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------- durable file writes


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def files_in(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` (the same step saved again) goes to the trash first."""
    if dst.exists():
        delete_checkpoint_dir(dst)
    os.rename(src, dst)
    fsync_dir(dst.parent)


def delete_checkpoint_dir(path: Path) -> None:
    """Out of the tag namespace in one rename, then removed: a crash never leaves a half-deleted tag."""
    trash = path.parent / TRASH
    trash.mkdir(exist_ok=True)
    target = trash / f"{path.name}.{os.getpid()}.{time.monotonic_ns()}"
    os.rename(path, target)
    shutil.rmtree(target, ignore_errors=True)
