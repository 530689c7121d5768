"""Crash-safe checkpoints on top of DeepSpeed: save, verify, choose, safe load, prune, universal conversion.

DeepSpeed's own `save_checkpoint` is not crash-safe (rank 0 writes `latest` before every rank is known to
have finished) and `load_checkpoint` silently starts from scratch when it finds nothing. Here:

- Every rank writes into a staging directory `ckpt_root/.incoming/<tag>`. A checkpoint exists only after
  every rank reported success (all-gathered), every file was fsynced and checksummed, rank 0 wrote
  `manifest.json` and renamed the staging dir to `ckpt_root/<tag>`. Then `latest` is replaced atomically:
  it is the commit point. A failure anywhere leaves `latest` and older checkpoints untouched.
- llmtrain's own state (step, counters, sampler, guard, RNG) is JSON, one file per rank: never pickled.
- Nothing read from a checkpoint may execute code. DeepSpeed 0.19.8 calls `torch.load(weights_only=False)`
  explicitly everywhere (its checkpoint engine, zero_to_fp32, ds_to_universal, the universal loader), with
  no option to change it. So (a) every `.pt` file is scanned first with `weights_only` rules and an
  explicit allow-list, naming the file and the global it refuses, and (b) DeepSpeed's own loads run with
  TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 and the same allow-list, which turns its `weights_only=False` into True.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmtrain.errors import BadInput
from llmtrain.fsutil import fsync_dir, write_atomic

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


@dataclass(frozen=True)
class Choice:
    tag: str
    info: CheckpointInfo
    warnings: list[str] = field(default_factory=list)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------- collectives (no-ops without a group)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# ---------------------------------------------------------------- durable file writes


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- RNG states as JSON


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


# ---------------------------------------------------------------- save


def save(
    engine: Any,
    ckpt_root: Path,
    step: int,
    client_state: dict[str, Any],
    rank: int,
    world_size: int,
    keep: int | None,
    keep_every: int | None,
) -> SaveResult:
    """Save on every rank; returns the same SaveResult everywhere. Never raises for I/O failures."""
    ckpt_root = Path(ckpt_root)
    tag = tag_for(step)
    staging = ckpt_root / STAGING / tag
    if rank == 0:
        _prepare_staging(ckpt_root, staging)
    _barrier()
    errors = _all_gather(_write_rank_files(engine, ckpt_root, tag, client_state, rank, world_size))
    failed = [e for e in errors if e]
    hashes: list[dict[str, Any]] = []
    if not failed:
        # One listing (rank 0's) for all, so no file is hashed twice or missed; each rank hashes a share.
        files, list_error = _broadcast(_list_files(staging) if rank == 0 else None)
        shares = _all_gather(_hash_share(staging, files[rank::world_size], rank) if files else ({}, None))
        hashes = [share for share, _ in shares]
        failed = [e for e in [list_error, *(err for _, err in shares)] if e]
    if failed:
        return _abort(ckpt_root, staging, tag, rank, failed)
    outcome = _commit(engine, ckpt_root, staging, tag, step, world_size, hashes) if rank == 0 else None
    outcome = _broadcast(outcome)
    if outcome is not None:
        return SaveResult(ok=False, tag=tag, error=outcome)
    pruned = prune(ckpt_root, keep, keep_every) if rank == 0 else []
    return SaveResult(ok=True, tag=tag, path=ckpt_root / tag, pruned=_broadcast(pruned))


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
    """DeepSpeed's files and this rank's JSON state; the error text (naming rank and path) or None."""
    if RNG_KEY in client_state:
        return f"rank {rank}: client_state must not use the reserved key {RNG_KEY!r}"
    staging_root = ckpt_root / STAGING
    errors: list[str] = []
    written: list[Path] = []
    try:
        with _capture_io_errors(engine, errors, written):
            engine.save_checkpoint(str(staging_root), tag=tag, client_state={}, save_latest=False)
    except Exception as exc:  # a non-I/O failure inside DeepSpeed: report it, the others may hang
        errors.append(f"{staging_root / tag}: {type(exc).__name__}: {exc}")
    if errors:
        return f"rank {rank}: " + "; ".join(errors)
    state_path = staging_root / tag / STATE_FILE.format(rank=rank)
    record = {"format": FORMAT, "rank": rank, "world_size": world_size, "client_state": client_state}
    record[RNG_KEY] = rng_state()
    try:
        write_atomic(state_path, json.dumps(record))
        for path in written:
            _fsync_file(path)
    except (OSError, TypeError, ValueError) as exc:
        return f"rank {rank}: {state_path}: {type(exc).__name__}: {exc}"
    return None


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


def _files_in(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _list_files(staging: Path) -> tuple[list[str], str | None]:
    try:
        return _files_in(staging), None
    except OSError as exc:
        return [], f"rank 0: {staging}: {type(exc).__name__}: {exc}"


def _hash_share(staging: Path, share: list[str], rank: int) -> tuple[dict[str, Any], str | None]:
    """(relative path -> {size, sha256}) for this rank's share of the files, or an error."""
    out: dict[str, Any] = {}
    try:
        for rel in share:
            path = staging / rel
            out[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    except OSError as exc:
        return {}, f"rank {rank}: {staging}: {type(exc).__name__}: {exc}"
    return out, None


def _abort(ckpt_root: Path, staging: Path, tag: str, rank: int, failed: list[str]) -> SaveResult:
    _barrier()  # every rank is done touching the staging dir
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier()
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
            "zero_stage": int(engine.zero_optimization_stage()),
            "partitioned": any(rel.endswith("optim_states.pt") for rel in files),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": [{"path": rel, **files[rel]} for rel in sorted(files)],
        }
        write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1))  # also fsyncs `staging`
        final = ckpt_root / tag
        _replace_dir(staging, final)
        write_atomic(ckpt_root / LATEST, tag + "\n")
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return f"checkpoint {tag}: rank 0: {getattr(exc, 'filename', None) or ckpt_root}: {exc}"
    return None


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` (the same step saved again) goes to the trash first."""
    if dst.exists():
        _delete_checkpoint_dir(dst)
    os.rename(src, dst)
    fsync_dir(dst.parent)


def _delete_checkpoint_dir(path: Path) -> None:
    """Out of the tag namespace in one rename, then removed: a crash never leaves a half-deleted tag."""
    trash = path.parent / TRASH
    trash.mkdir(exist_ok=True)
    target = trash / f"{path.name}.{os.getpid()}.{time.monotonic_ns()}"
    os.rename(path, target)
    shutil.rmtree(target, ignore_errors=True)


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
                    _delete_checkpoint_dir(path)
                except OSError:
                    continue  # pruning is best effort; the next save retries
        deleted.append(tag)
    return deleted


def _latest_or_none(ckpt_root: Path) -> str | None:
    try:
        return read_latest(ckpt_root)
    except CheckpointError:
        return None


# ---------------------------------------------------------------- reading


def read_latest(ckpt_root: Path) -> str | None:
    """The tag `latest` names, validated: `step_NNNNNNNN`, a directory inside ckpt_root. None if absent."""
    path = Path(ckpt_root) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text(encoding="utf-8", errors="replace").strip()
    if not TAG_RE.match(tag):
        raise CheckpointError(
            f"{path}: names {tag[:80]!r}, not a checkpoint tag (step_NNNNNNNN); refusing it"
        )
    _check_inside(ckpt_root, Path(ckpt_root) / tag, path)
    return tag


def _check_inside(ckpt_root: Path, target: Path, named_by: Path) -> None:
    root = Path(ckpt_root).resolve()
    if target.resolve().parent != root:
        raise CheckpointError(f"{named_by}: {target} resolves outside {root}; refusing it")


def _read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    with open(ckpt_dir / MANIFEST, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ValueError("not a manifest")
    return data


def _info(ckpt_dir: Path) -> CheckpointInfo | None:
    try:
        m = _read_manifest(ckpt_dir)
        return CheckpointInfo(
            tag=ckpt_dir.name,
            path=ckpt_dir,
            step=int(m["step"]),
            world_size=int(m["world_size"]),
            zero_stage=int(m["zero_stage"]),
            partitioned=bool(m["partitioned"]),
            created=str(m["created"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_complete(ckpt_root: Path) -> list[CheckpointInfo]:
    """Checkpoints with a readable manifest, oldest first (symlinked tag dirs are ignored)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    infos = [_info(p) for p in root.iterdir() if TAG_RE.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted((i for i in infos if i is not None), key=lambda i: i.step)


def verify(ckpt_dir: Path) -> list[str]:
    """Problems with a checkpoint against its manifest, each naming the file; [] when intact."""
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = _read_manifest(ckpt_dir)
    except (OSError, ValueError) as exc:
        return [f"{ckpt_dir / MANIFEST}: missing or unreadable ({exc})"]
    problems: list[str] = []
    listed: set[str] = set()
    for entry in manifest["files"]:
        rel = str(entry.get("path", ""))
        listed.add(rel)
        problems += _verify_entry(ckpt_dir, rel, entry)
    for rel in _files_in(ckpt_dir):
        if rel != MANIFEST and rel not in listed:
            problems.append(f"{ckpt_dir / rel}: not in the manifest (added after the save)")
    return problems


def _verify_entry(ckpt_dir: Path, rel: str, entry: dict[str, Any]) -> list[str]:
    path = ckpt_dir / rel
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        return [f"{ckpt_dir / MANIFEST}: lists {rel!r} outside the checkpoint"]
    if not path.is_file():
        return [f"{path}: missing"]
    size = path.stat().st_size
    if size != entry["size"]:
        return [f"{path}: truncated or resized ({size} bytes, manifest says {entry['size']})"]
    if _sha256(path) != entry["sha256"]:
        return [f"{path}: corrupt (sha256 differs from the manifest)"]
    return []


def choose_checkpoint(ckpt_root: Path, strict: bool) -> Choice:
    """The checkpoint to resume from: `latest` if intact, else the newest older intact one (warned).

    With `strict`, any damage is an error instead of a fallback.
    """
    ckpt_root = Path(ckpt_root)
    complete = list_complete(ckpt_root)
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {ckpt_root}")
    warnings: list[str] = []
    candidates = _candidates(ckpt_root, complete, warnings, strict)
    for info in candidates:
        problems = verify(info.path)
        if not problems:
            return Choice(tag=info.tag, info=info, warnings=warnings)
        message = f"checkpoint {info.tag} is damaged: " + "; ".join(problems)
        if strict:
            raise CheckpointError(message + " (strict: refusing to fall back)")
        warnings.append(message + "; falling back to the previous checkpoint")
    raise CheckpointError(f"no intact checkpoint in {ckpt_root}: " + " | ".join(warnings))


def _candidates(
    ckpt_root: Path, complete: list[CheckpointInfo], warnings: list[str], strict: bool
) -> list[CheckpointInfo]:
    """Newest first, starting at `latest` (the commit point); later dirs never were committed."""
    latest = read_latest(ckpt_root)
    newest_first = complete[::-1]
    if latest is None:
        warnings.append(f"{ckpt_root / LATEST} missing; using the newest complete checkpoint")
        return newest_first
    by_tag = {i.tag: i for i in complete}
    if latest in by_tag:
        return [i for i in newest_first if i.step <= by_tag[latest].step]
    message = f"{ckpt_root / LATEST} names {latest}, which is not a complete checkpoint"
    if strict:
        raise CheckpointError(message + " (strict: refusing to fall back)")
    warnings.append(message)
    latest_step = int(latest.removeprefix("step_"))
    return [i for i in newest_first if i.step < latest_step]


# ---------------------------------------------------------------- safe loading


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
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def checkpoint_dir(ckpt_root: Path, tag: str) -> Path:
    """`ckpt_root/tag` after checking the tag's form and that it stays inside ckpt_root."""
    base = tag.removesuffix(UNIVERSAL_SUFFIX)
    if not TAG_RE.match(base):
        raise CheckpointError(f"{ckpt_root}: {tag!r} is not a checkpoint tag (step_NNNNNNNN)")
    path = Path(ckpt_root) / tag
    _check_inside(ckpt_root, path, Path(ckpt_root))
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint")
    return path


def load(engine: Any, ckpt_root: Path, tag: str, load_optimizer: bool = True) -> dict[str, Any]:
    """Load model + optimizer into `engine`; return this rank's client state, RNG under `rng`.

    For a universal tag (`step_N_universal`, from `convert_to_universal`) the engine's DS config must
    carry `"checkpoint": {"load_universal": true}`. A rank beyond the saved world size gets rank 0's
    client state and `rng` None (RNG streams are per rank; they do not map onto a new world size).
    """
    path = checkpoint_dir(ckpt_root, tag)
    scan_pickles(path)
    with weights_only_loads():
        loaded, _ = engine.load_checkpoint(
            str(ckpt_root), tag=tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=False
        )
    if loaded is None:
        raise CheckpointError(f"{path}: DeepSpeed found no model state to load (it would start from scratch)")
    return read_client_state(path, dist.get_rank() if dist.is_initialized() else 0)


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


# ---------------------------------------------------------------- different world size


def needs_universal(info: CheckpointInfo, world_size: int) -> bool:
    """True when the optimizer state is sharded per rank and the world size changed."""
    return info.partitioned and info.world_size != world_size


def convert_to_universal(ckpt_root: Path, tag: str, workers: int = 1) -> Path:
    """`ckpt_root/{tag}_universal` via DeepSpeed's ds_to_universal: once, atomically, by rank 0.

    Every rank must call it; others wait at a barrier. Raises CheckpointError on every rank when the
    conversion fails. `workers` > 1 forks DeepSpeed's process pools (faster for big models).
    """
    ckpt_root = Path(ckpt_root)
    out = ckpt_root / f"{tag}{UNIVERSAL_SUFFIX}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0 and _info(out) is None:
        error = _convert(ckpt_root, tag, out, workers)
    error = _broadcast(error)
    if error:
        raise CheckpointError(error)
    return out


def _convert(ckpt_root: Path, tag: str, out: Path, workers: int) -> str | None:
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    source = checkpoint_dir(ckpt_root, tag)
    info = _info(source)
    if info is None or not info.partitioned:
        return f"{source}: not a complete checkpoint with sharded optimizer state; nothing to convert"
    work = ckpt_root / STAGING / f"convert_{tag}"
    shutil.rmtree(work, ignore_errors=True)
    # ds_to_universal writes `latest_universal` next to its output folder: keep it inside `work`.
    inner = work / out.name
    args = Namespace(
        input_folder=str(source),
        output_folder=str(inner),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        scan_pickles(source)
        with weights_only_loads():
            ds_to_universal.main(args)
        _finish_universal(source, inner, info)
        _replace_dir(inner, out)
    except Exception as exc:
        return f"cannot convert {source} to a universal checkpoint for a new world size: {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return None


def _finish_universal(source: Path, inner: Path, info: CheckpointInfo) -> None:
    """Copy the llmtrain state files and write a manifest, so the result verifies and loads like a tag."""
    for state in source.glob(STATE_FILE.format(rank="*")):
        shutil.copy2(state, inner / state.name)
    files = _files_in(inner)
    for rel in files:
        _fsync_file(inner / rel)
    manifest = {
        "format": FORMAT,
        "tag": inner.name,
        "universal_of": info.tag,
        "step": info.step,
        "world_size": info.world_size,
        "zero_stage": info.zero_stage,
        "partitioned": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": [
            {"path": rel, "size": (inner / rel).stat().st_size, "sha256": _sha256(inner / rel)}
            for rel in files
        ],
    }
    write_atomic(inner / MANIFEST, json.dumps(manifest, indent=1))


# ---------------------------------------------------------------- consolidated weights


def consolidated_fp32_state_dict(ckpt_root: Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights from a checkpoint of any ZeRO stage (for `llmtrain export`)."""
    path = checkpoint_dir(ckpt_root, tag)
    info = _info(path)
    if info is None:
        raise CheckpointError(f"{path}: no manifest, not a complete checkpoint")
    scan_pickles(path)
    with weights_only_loads():
        if not info.partitioned:
            return _unpartitioned_fp32(path)
        if _is_bf16_optimizer_checkpoint(path):
            return _sliced_fp32(path)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_root), tag=tag)
        return {k: v.float().contiguous() for k, v in state.items()}


def _optim_files(path: Path) -> list[Path]:
    def rank_of(p: Path) -> int:
        return int(re.search(r"zero_pp_rank_(\d+)_", p.name).group(1))  # type: ignore[union-attr]

    return sorted(path.glob("*zero_pp_rank_*_optim_states.pt"), key=rank_of)


def _is_bf16_optimizer_checkpoint(path: Path) -> bool:
    """ZeRO-1 with bf16 weights and fp32 accumulation uses DeepSpeed's BF16_Optimizer, whose shards
    carry no `zero_stage`: zero_to_fp32 0.19.8 rejects them ("is not a zero checkpoint")."""
    sd = torch.load(_optim_files(path)[0], map_location="cpu", weights_only=True, mmap=True)
    return "zero_stage" not in sd["optimizer_state_dict"]


def _sliced_fp32(path: Path) -> dict[str, torch.Tensor]:
    """Reassemble each parameter from the per-rank fp32 partitions via their `param_slice_mappings`
    (name -> fragment_address(start, numel) in that rank's flat group), as ds_to_universal does."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for file in _optim_files(path):
        osd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)["optimizer_state_dict"]
        flats = osd["single_partition_of_fp32_groups"]
        for group, mapping in enumerate(osd["param_slice_mappings"]):
            for name, frag in mapping.items():
                pieces.setdefault(name, []).append(flats[group].narrow(0, frag.start, frag.numel))
    model = torch.load(_single_model_file(path), map_location="cpu", weights_only=True)
    shapes = {name: shape for group in model["param_shapes"] for name, shape in group.items()}
    out = {name: v.float().clone() for name, v in model["module"].items()}  # buffers, untrained params
    for name, parts in pieces.items():
        out[name] = torch.cat(parts).view(shapes[name]).clone()
    for alias, source in (model.get("shared_params") or {}).items():
        out[alias] = out[source]
    return out


def _single_model_file(path: Path) -> Path:
    files = sorted(path.glob("mp_rank_*_model_states.pt"))
    if len(files) != 1:
        raise CheckpointError(f"{path}: expected one mp_rank_*_model_states.pt, found {len(files)}")
    return files[0]


def _unpartitioned_fp32(path: Path) -> dict[str, torch.Tensor]:
    """Stage 0: the module state; in bf16 the fp32 master copy from the optimizer when it maps one-to-one."""
    sd = torch.load(_single_model_file(path), map_location="cpu", weights_only=True)
    module = {k: v for k, v in sd["module"].items() if k not in set(sd.get("buffer_names") or [])}
    master = _fp32_master(sd, module)
    out = {k: v.float() for k, v in sd["module"].items()}
    out.update(master)
    return out


def _fp32_master(sd: dict[str, Any], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 master copy a stage-0 bf16/fp16 optimizer keeps, by name; {} when it does not map.

    DeepSpeed keeps it per parameter (`fp32_groups`, unfused optimizer) or as one flat tensor per group
    (`fp32_groups_flat`), in model.parameters() order: the module state's order, shared ones once.
    """
    optim = sd.get("optimizer")
    if not isinstance(optim, dict):
        return {}
    if optim.get("fp32_groups"):
        masters = [t for group in optim["fp32_groups"] for t in group]
    elif optim.get("fp32_groups_flat") and len(optim["fp32_groups_flat"]) == 1:
        masters = _split_flat(optim["fp32_groups_flat"][0], list(params.values()))
    else:
        return {}
    names = list(params)
    if len(masters) != len(names) or any(
        m.shape != params[n].shape for m, n in zip(masters, names, strict=True)
    ):
        return {}
    return {n: m.float().clone() for n, m in zip(names, masters, strict=True)}


def _split_flat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    if sum(t.numel() for t in like) != flat.numel():
        return []
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Choice",
    "SaveResult",
    "choose_checkpoint",
    "consolidated_fp32_state_dict",
    "convert_to_universal",
    "list_complete",
    "load",
    "needs_universal",
    "plan_prune",
    "prune",
    "read_client_state",
    "read_latest",
    "restore_rng",
    "rng_state",
    "save",
    "scan_pickles",
    "tag_for",
    "verify",
    "weights_only_loads",
]
