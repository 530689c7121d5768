"""Reading a checkpoint root: what `latest` names, which checkpoints are complete and intact, which to use.

Everything named by files on disk (`latest`, a tag given on the command line, a manifest's paths) is
validated before use: a tag must look like `step_NNNNNNNN` and resolve to a directory directly inside
the root, so a tampered `latest` or manifest cannot make llmtrain read files elsewhere. A checkpoint is
complete when it has a readable manifest, intact when every file matches the manifest's size and sha256.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.common import (
    LATEST,
    MANIFEST,
    TAG_RE,
    UNIVERSAL_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    Choice,
    files_in,
    sha256,
)
from llmtrain.planning.layout import Layout


def read_latest(ckpt_root: Path) -> str | None:
    """The tag `latest` names, validated: `step_NNNNNNNN`, a directory inside ckpt_root. None if absent."""
    path = Path(ckpt_root) / LATEST
    if path.is_symlink():  # llmtrain writes `latest` as a plain file (atomically): a link is not its own
        raise CheckpointError(f"{path}: is a symbolic link, not the file llmtrain writes; refusing it")
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


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    with open(ckpt_dir / MANIFEST, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ValueError("not a manifest")
    return data


def read_info(ckpt_dir: Path) -> CheckpointInfo | None:
    try:
        m = read_manifest(ckpt_dir)
        return CheckpointInfo(
            tag=ckpt_dir.name,
            path=ckpt_dir,
            step=int(m["step"]),
            world_size=int(m["world_size"]),
            zero_stage=int(m["zero_stage"]),
            partitioned=bool(m["partitioned"]),
            created=str(m["created"]),
            engine=str(m.get("engine", "deepspeed")),
            layout=_layout(m.get("layout")),
            kv_replicas=int(m.get("kv_replicas", 1)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _layout(recorded: Any) -> dict[str, int] | None:
    if recorded is None:
        return None
    return {axis: int(recorded[axis]) for axis in ("tp", "sp", "pp")}


def list_complete(ckpt_root: Path) -> list[CheckpointInfo]:
    """Checkpoints with a readable manifest, oldest first (symlinked tag dirs are ignored)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    infos = [
        read_info(p) for p in root.iterdir() if TAG_RE.match(p.name) and p.is_dir() and not p.is_symlink()
    ]
    return sorted((i for i in infos if i is not None), key=lambda i: i.step)


def verify(ckpt_dir: Path) -> list[str]:
    """Problems with a checkpoint against its manifest, each naming the file; [] when intact."""
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except (OSError, ValueError) as exc:
        return [f"{ckpt_dir / MANIFEST}: missing or unreadable ({exc})"]
    problems: list[str] = []
    listed: set[str] = set()
    for entry in manifest["files"]:
        rel = str(entry.get("path", ""))
        listed.add(rel)
        problems += _verify_entry(ckpt_dir, rel, entry)
    for rel in files_in(ckpt_dir):
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
    if sha256(path) != entry["sha256"]:
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


def saved_layout(info: CheckpointInfo, current: Layout) -> Layout:
    """The layout that saved `info`; a manifest written before layouts were recorded had the run's own
    model-parallel degrees (they could not change on a resume then)."""
    axes = info.layout or {"tp": current.tp, "sp": current.sp, "pp": current.pp}
    return Layout(info.world_size, **axes)


def needs_universal(info: CheckpointInfo, layout: Layout) -> bool:
    """True when the optimizer state is sharded per rank and the layout changed: another world size, or
    other tp / pp degrees on the same one."""
    return info.partitioned and saved_layout(info, layout) != layout
