"""Before a save: is there room? A checkpoint that cannot fit is refused before anything is written.

The expected size is the latest complete checkpoint's (its manifest lists every file's size), or,
before the first one, the estimate the caller passes (the trainer's, from the parameter count and
precision). Every rank compares the free space of its own checkpoint root (a node-local disk may be
the full one) with that size plus `checkpoint.min_free`; the answers are all-gathered, so every rank
refuses or proceeds together and returns the same SaveResult. Nothing is created to measure: a root
that does not exist yet is measured on its nearest existing parent, the filesystem it will be on.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from llmtrain.checkpoint.collective import all_gather
from llmtrain.checkpoint.common import CheckpointError
from llmtrain.checkpoint.reading import read_latest, read_manifest
from llmtrain.units import human


@dataclass(frozen=True)
class SizeEstimate:
    bytes: int
    basis: str  # what it was estimated from, as the message says it: "step 30's checkpoint"


@dataclass(frozen=True)
class SpaceRule:
    min_free: int = 0  # bytes every save must leave free (checkpoint.min_free)
    first_save: SizeEstimate | None = None  # the expected size while the run has no checkpoint


def refusal(ckpt_root: Path, rank: int, world_size: int, rule: SpaceRule) -> str | None:
    """Collective: why the next checkpoint does not fit on some rank's disk, the same text on every
    rank, or None when it fits everywhere (or no rank could measure)."""
    expected = expected_size(ckpt_root, rule.first_save) if rank == 0 else None
    reports: list[tuple[int | None, int, SizeEstimate | None]] = all_gather(
        (free_bytes(ckpt_root), rule.min_free, expected)
    )
    need = reports[0][2]  # rank 0's: it reads the checkpoints' manifests
    assert need is not None
    by_text: dict[str, list[int]] = {}  # ranks sharing a disk say the same: named once
    for r, (free, keep, _) in enumerate(reports):
        if free is not None and free - keep < need.bytes:  # None: unmeasurable, a failed write will tell
            by_text.setdefault(_short_of_space(ckpt_root, need, free, keep), []).append(r)
    if not by_text:
        return None
    return " | ".join(_ranks(ranks, world_size) + text for text, ranks in by_text.items())


def expected_size(ckpt_root: Path, first_save: SizeEstimate | None) -> SizeEstimate:
    """The total size of the files of the checkpoint `latest` names, else `first_save` (else 0)."""
    try:
        tag = read_latest(ckpt_root)
        if tag is not None:
            files = read_manifest(Path(ckpt_root) / tag)["files"]
            total = sum(int(entry["size"]) for entry in files)
            return SizeEstimate(total, f"step {int(tag.removeprefix('step_'))}'s checkpoint")
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        pass  # an unreadable latest checkpoint: the estimate still guards the save
    return first_save or SizeEstimate(0, "nothing: no checkpoint yet and no estimate")


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem `path` is (or will be) on; None
    when it cannot be measured (the save then goes ahead, and a failed write is reported as such)."""
    try:
        existing = next(p for p in [Path(path), *Path(path).absolute().parents] if p.exists())
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def _short_of_space(ckpt_root: Path, need: SizeEstimate, free: int, min_free: int) -> str:
    return (
        f"not enough free space on {ckpt_root}: needs ~{human(need.bytes, decimals=1)} "
        f"(estimated from {need.basis}), {human(free, decimals=1)} free, "
        f"keeping {human(min_free, decimals=1)} free (checkpoint.min_free)"
    )


def _ranks(ranks: list[int], world_size: int) -> str:
    if world_size == 1:
        return ""
    return f"rank {ranks[0]}: " if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}: "
