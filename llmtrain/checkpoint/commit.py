"""The commit protocol: a checkpoint exists only once every rank wrote it and rank 0 moved `latest`.

DeepSpeed's own `save_checkpoint` is not crash-safe (rank 0 writes `latest` before every rank is known to
have finished). Here every rank writes into `ckpt_root/.incoming/<tag>`; after every rank reported success
(all-gathered) and every file was fsynced and checksummed, rank 0 writes `manifest.json`, renames the
staging dir to `ckpt_root/<tag>` and replaces `latest` atomically: that rename is the commit point. A
failure anywhere leaves `latest` and older checkpoints untouched; a checkpoint that would not fit on
some rank's disk (`space.py`) is refused before the staging dir exists. Pruning lives here too because
it runs right after a commit, on rank 0, and must never delete what `latest` names.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmtrain.checkpoint import universal
from llmtrain.checkpoint.collective import all_gather, barrier, broadcast
from llmtrain.checkpoint.common import (
    FORMAT,
    LATEST,
    MANIFEST,
    RNG_KEY,
    STAGING,
    STATE_FILE,
    UNIVERSAL_SUFFIX,
    CheckpointError,
    SaveResult,
    delete_checkpoint_dir,
    files_in,
    fsync_file,
    replace_dir,
    sha256,
    tag_for,
)
from llmtrain.checkpoint.reading import list_complete, read_latest
from llmtrain.checkpoint.rng import rng_state
from llmtrain.checkpoint.space import SpaceRule, refusal
from llmtrain.fsutil import write_atomic


def save(
    engine: Any,
    ckpt_root: Path,
    step: int,
    client_state: dict[str, Any],
    rank: int,
    world_size: int,
    keep: int | None,
    keep_every: int | None,
    space: SpaceRule = SpaceRule(),  # frozen: one shared default is safe
) -> SaveResult:
    """Save on every rank; returns the same SaveResult everywhere. Never raises for I/O failures.
    A checkpoint that would not fit (`space`) is refused before anything is written."""
    ckpt_root = Path(ckpt_root)
    tag = tag_for(step)
    short_of_space = refusal(ckpt_root, rank, world_size, space)
    if short_of_space is not None:
        return SaveResult(ok=False, tag=tag, error=short_of_space)
    staging = ckpt_root / STAGING / tag
    if rank == 0:
        _prepare_staging(ckpt_root, staging)
    barrier()
    errors = all_gather(_write_rank_files(engine, ckpt_root, tag, client_state, rank, world_size))
    failed = [e for e in errors if e]
    hashes: list[dict[str, Any]] = []
    if not failed:
        # One listing (rank 0's) for all, so no file is hashed twice or missed; each rank hashes a share.
        files, list_error = broadcast(_list_files(staging) if rank == 0 else None)
        shares = all_gather(_hash_share(staging, files[rank::world_size], rank) if files else ({}, None))
        hashes = [share for share, _ in shares]
        failed = [e for e in [list_error, *(err for _, err in shares)] if e]
    if failed:
        return _abort(ckpt_root, staging, tag, rank, failed)
    outcome = _commit(engine, ckpt_root, staging, tag, step, world_size, hashes) if rank == 0 else None
    outcome = broadcast(outcome)
    if outcome is not None:
        return SaveResult(ok=False, tag=tag, error=outcome)
    pruned = prune(ckpt_root, keep, keep_every) if rank == 0 else []
    return SaveResult(ok=True, tag=tag, path=ckpt_root / tag, pruned=broadcast(pruned))


def _prepare_staging(ckpt_root: Path, staging: Path) -> None:
    """Leftovers of a save that crashed are removed; creation errors surface in the rank's write step."""
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
    except OSError:
        pass


def _write_rank_files(
    engine: Any, ckpt_root: Path, tag: str, client_state: dict[str, Any], rank: int, world_size: int
) -> str | None:
    """The engine's files and this rank's JSON state; the error text (naming rank and path) or None."""
    if RNG_KEY in client_state:
        return f"rank {rank}: client_state must not use the reserved key {RNG_KEY!r}"
    staging_root = ckpt_root / STAGING
    errors, written = engine.save(staging_root, tag)
    if errors:
        return f"rank {rank}: " + "; ".join(errors)
    state_path = staging_root / tag / STATE_FILE.format(rank=rank)
    record = {"format": FORMAT, "rank": rank, "world_size": world_size, "client_state": client_state}
    record[RNG_KEY] = rng_state()
    try:
        write_atomic(state_path, json.dumps(record))
        for path in written:
            fsync_file(path)
    except (OSError, TypeError, ValueError) as exc:
        return f"rank {rank}: {state_path}: {type(exc).__name__}: {exc}"
    return None


def write_deepspeed_files(ds: Any, staging_root: Path, tag: str) -> tuple[list[str], list[Path]]:
    """DeepSpeed's `save_checkpoint` into `staging_root/tag`: (errors naming their paths, files written)."""
    errors: list[str] = []
    written: list[Path] = []
    try:
        with _capture_io_errors(ds, errors, written):
            # The split of every tensor, for a conversion to the universal format (another layout).
            state = universal.client_state()
            ds.save_checkpoint(str(staging_root), tag=tag, client_state=state, save_latest=False)
    except Exception as exc:  # a non-I/O failure inside DeepSpeed: report it, the others may hang
        errors.append(f"{staging_root / tag}: {type(exc).__name__}: {exc}")
    return errors, written


@contextmanager
def _capture_io_errors(engine: Any, errors: list[str], written: list[Path]) -> Iterator[None]:
    """Catch write failures inside DeepSpeed's checkpoint engine instead of raising.

    `save_checkpoint` ends with a barrier: a rank that raised mid-save would leave the others waiting
    there, and its next collective would pair with the wrong one. Recording the error and carrying on
    keeps every rank on the same sequence of collectives; the all-gather afterwards fails them all.
    """
    ce = engine.checkpoint_engine
    original_save, original_makedirs = ce.save, ce.makedirs
    original_copy = engine._copy_recovery_script

    def save(state_dict: Any, path: str) -> None:
        try:
            original_save(state_dict, path)
            written.append(Path(path))
        except Exception as exc:
            errors.append(f"{path}: {type(exc).__name__}: {exc}")

    def makedirs(path: str, exist_ok: bool = False) -> None:
        try:
            original_makedirs(path, exist_ok=exist_ok)
        except Exception as exc:
            errors.append(f"{path}: {type(exc).__name__}: {exc}")

    def copy_recovery_script(save_path: str) -> None:
        # DeepSpeed copies zero_to_fp32.py next to the tags; a failure there is worth no hang.
        try:
            original_copy(save_path)
        except Exception as exc:
            errors.append(f"{save_path}: {type(exc).__name__}: {exc}")

    ce.save, ce.makedirs, engine._copy_recovery_script = save, makedirs, copy_recovery_script
    try:
        yield
    finally:
        del ce.save, ce.makedirs, engine._copy_recovery_script


def _list_files(staging: Path) -> tuple[list[str], str | None]:
    try:
        return files_in(staging), None
    except OSError as exc:
        return [], f"rank 0: {staging}: {type(exc).__name__}: {exc}"


def _hash_share(staging: Path, share: list[str], rank: int) -> tuple[dict[str, Any], str | None]:
    """(relative path -> {size, sha256}) for this rank's share of the files, or an error."""
    out: dict[str, Any] = {}
    try:
        for rel in share:
            path = staging / rel
            out[rel] = {"size": path.stat().st_size, "sha256": sha256(path)}
    except OSError as exc:
        return {}, f"rank {rank}: {staging}: {type(exc).__name__}: {exc}"
    return out, None


def _abort(ckpt_root: Path, staging: Path, tag: str, rank: int, failed: list[str]) -> SaveResult:
    barrier()  # every rank is done touching the staging dir
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    barrier()
    message = f"checkpoint {tag} in {ckpt_root} failed, previous checkpoint kept: " + " | ".join(failed)
    return SaveResult(ok=False, tag=tag, error=message)


def _commit(
    engine: Any,
    ckpt_root: Path,
    staging: Path,
    tag: str,
    step: int,
    world_size: int,
    hashes: list[dict[str, Any]],
) -> str | None:
    """Rank 0: manifest, rename into place, move `latest`. Returns an error message or None."""
    try:
        files = {rel: meta for share in hashes for rel, meta in share.items()}
        manifest = {
            "format": FORMAT,
            "tag": tag,
            "step": step,
            "world_size": world_size,
            **engine.checkpoint_facts(),  # engine, zero_stage
            "partitioned": any(rel.endswith("optim_states.pt") for rel in files),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": [{"path": rel, **files[rel]} for rel in sorted(files)],
        }
        write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1))  # also fsyncs `staging`
        final = ckpt_root / tag
        replace_dir(staging, final)
        write_atomic(ckpt_root / LATEST, tag + "\n")
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return f"checkpoint {tag}: rank 0: {getattr(exc, 'filename', None) or ckpt_root}: {exc}"
    return None


# ---------------------------------------------------------------- prune


def plan_prune(steps: list[int], keep: int | None, keep_every: int | None, protected: set[int]) -> list[int]:
    """The steps to delete: all but the last `keep`, multiples of `keep_every`, the newest and `protected`."""
    if keep is None or not steps:
        return []
    ordered = sorted(steps)
    retained = set(ordered[-max(keep, 1) :]) | protected | {ordered[-1]}
    if keep_every:
        retained |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in retained]


def prune(ckpt_root: Path, keep: int | None, keep_every: int | None) -> list[str]:
    """Delete old complete checkpoints (and their universal conversions); never the one `latest` names."""
    infos = list_complete(ckpt_root)
    protected: set[int] = set()
    latest = _latest_or_none(ckpt_root)
    if latest is not None:
        protected.add(int(latest.removeprefix("step_")))
    deleted: list[str] = []
    for step in plan_prune([i.step for i in infos], keep, keep_every, protected):
        tag = tag_for(step)
        for path in (ckpt_root / tag, ckpt_root / f"{tag}{UNIVERSAL_SUFFIX}"):
            if path.exists():
                try:
                    delete_checkpoint_dir(path)
                except OSError:
                    continue  # pruning is best effort; the next save retries
        deleted.append(tag)
    return deleted


def _latest_or_none(ckpt_root: Path) -> str | None:
    try:
        return read_latest(ckpt_root)
    except CheckpointError:
        return None
