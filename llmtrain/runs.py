"""`llmtrain runs`: what runs exist and how far they got; one run's checkpoints.

Everything is read from the run directories themselves (config.yaml, metrics.jsonl, checkpoints/ with
their manifests): nothing is loaded into a model and no process group is needed. `listing(path)` returns
plain JSON-ready data (what --json prints); `render(doc)` draws the same data as a rich table.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmtrain import checkpoint as ckpt
from llmtrain import rundir, units
from llmtrain.config import ConfigError
from llmtrain.train.metrics import METRICS_FILE, read_metrics


@dataclass
class RunSummary:
    name: str
    path: str
    preset: str | None
    step: int | None  # last logged optimizer step
    total_steps: int | None
    latest_checkpoint: str | None  # the tag `latest` names (the commit point), else the newest complete
    checkpoints: int  # complete checkpoints on disk
    last_loss: float | None
    best_val_loss: float | None
    modified: str  # ISO time of the newest file the run wrote
    error: str | None = None  # config.yaml unreadable


@dataclass
class CheckpointRow:
    tag: str
    step: int
    size_bytes: int
    files: int
    verified: bool
    problems: list[str]
    latest: bool
    world_size: int
    zero_stage: int
    created: str
    engine: str


def is_run_dir(path: Path) -> bool:
    return (path / rundir.CONFIG_FILE).is_file()


def listing(path: str | Path) -> dict[str, Any]:
    """{"root", "runs": [...]} for a directory of runs; {"run", "checkpoints": [...]} for one run."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory; pass a directory of runs (default runs/) or a RUN_DIR")
    if is_run_dir(path):
        return {
            "run": asdict(summarize_run(path)),
            "checkpoints": [asdict(row) for row in list_checkpoints(path)],
        }
    return {"root": str(path), "runs": [asdict(s) for s in find_runs(path)]}


def find_runs(root: Path) -> list[RunSummary]:
    """Run directories directly under `root` (or one level deeper), newest first."""
    found = [p for p in sorted(root.iterdir()) if p.is_dir() and is_run_dir(p)]
    for group in sorted(root.iterdir()):
        if group.is_dir() and not is_run_dir(group):
            found += [p for p in sorted(group.iterdir()) if p.is_dir() and is_run_dir(p)]
    summaries = [summarize_run(p, name=str(p.relative_to(root))) for p in found]
    return sorted(summaries, key=lambda s: s.modified, reverse=True)


def summarize_run(run_dir: Path, name: str | None = None) -> RunSummary:
    from llmtrain.config import load_run_config

    preset: str | None = None
    total: int | None = None
    error: str | None = None
    try:
        cfg = load_run_config(run_dir / rundir.CONFIG_FILE)
        preset, total = cfg.preset, cfg.total_steps
    except (ConfigError, OSError, ValueError) as exc:
        error = f"config.yaml unreadable: {exc}"
    records = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
    train = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if _finite(r.get("val_loss"))]
    complete = ckpt.list_complete(rundir.checkpoint_root(run_dir))
    return RunSummary(
        name=name or run_dir.name,
        path=str(run_dir),
        preset=preset,
        step=int(train[-1]["step"]) if train else None,
        total_steps=total,
        latest_checkpoint=_latest_tag(run_dir, complete),
        checkpoints=len(complete),
        last_loss=train[-1]["loss"] if train and _finite(train[-1]["loss"]) else None,
        best_val_loss=min(val) if val else None,
        modified=_iso(_last_modified(run_dir)),
        error=error,
    )


def list_checkpoints(run_dir: Path, verify: bool = True) -> list[CheckpointRow]:
    """Complete checkpoints, oldest first, each checked against its manifest when `verify`."""
    root = rundir.checkpoint_root(run_dir)
    complete = ckpt.list_complete(root)
    latest = _latest_tag(run_dir, complete)
    rows = []
    for info in complete:
        problems = ckpt.verify(info.path) if verify else []
        files = ckpt.read_manifest(info.path)["files"]
        rows.append(
            CheckpointRow(
                tag=info.tag,
                step=info.step,
                size_bytes=sum(int(f.get("size", 0)) for f in files),
                files=len(files),
                verified=verify and not problems,
                problems=problems,
                latest=info.tag == latest,
                world_size=info.world_size,
                zero_stage=info.zero_stage,
                created=info.created,
                engine=info.engine,
            )
        )
    return rows


def _latest_tag(run_dir: Path, complete: list[ckpt.CheckpointInfo]) -> str | None:
    root = rundir.checkpoint_root(run_dir)
    try:
        latest = ckpt.read_latest(root)
    except ckpt.CheckpointError:
        latest = None
    if latest is not None and any(i.tag == latest for i in complete):
        return latest
    return complete[-1].tag if complete else None


def _last_modified(run_dir: Path) -> float:
    candidates = [
        run_dir / METRICS_FILE,
        run_dir / rundir.CONFIG_FILE,
        rundir.checkpoint_root(run_dir) / ckpt.LATEST,
    ]
    times = [p.stat().st_mtime for p in candidates if p.exists()]
    return max(times) if times else run_dir.stat().st_mtime


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(timestamp))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# ---------------------------------------------------------------- rendering


def render(doc: dict[str, Any]) -> None:
    from llmtrain.terminal import console as make_console

    console = make_console()
    if "runs" in doc:
        if not doc["runs"]:
            console.print(f"no runs in {doc['root']}")
            return
        console.print(_runs_table(doc["runs"], doc["root"]))
    else:
        console.print(_runs_table([doc["run"]], None))
        console.print(_checkpoints_table(doc["checkpoints"], doc["run"]["path"]))


def _runs_table(runs: list[dict[str, Any]], root: str | None) -> Any:
    from rich.table import Table

    table = Table(title=f"runs in {root}" if root else None)
    for column in ("run", "preset", "steps", "checkpoint", "loss", "best val", "modified"):
        numeric = column in ("steps", "loss", "best val")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column != "run")
    table.columns[0].min_width = min(30, max([len("run")] + [len(r["name"]) for r in runs]))
    for r in runs:
        steps = f"{_or_dash(r['step'])} / {_or_dash(r['total_steps'])}"
        table.add_row(
            r["name"],
            r["preset"] or "?",
            steps,
            r["latest_checkpoint"] or "-",
            _number(r["last_loss"]),
            _number(r["best_val_loss"]),
            _when(r["modified"]),
        )
    return table


def _zero_and_world(row: dict[str, Any]) -> str:
    """`2 / 4` on DeepSpeed; FSDP2's checkpoints name their engine (`fsdp2 3 / 2`)."""
    engine = "" if row["engine"] == "deepspeed" else f"{row['engine']} "
    return f"{engine}{row['zero_stage']} / {row['world_size']}"


def _checkpoints_table(rows: list[dict[str, Any]], path: str) -> Any:
    from rich.table import Table

    table = Table(title=f"checkpoints of {path}")
    for column in ("tag", "step", "size", "verified", "zero/world", "created"):
        numeric = column in ("step", "size")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column != "verified")
    table.columns[3].min_width = len("verified")
    for row in rows:
        verified = "yes" if row["verified"] else "NO: " + "; ".join(row["problems"])
        tag = row["tag"] + (" (latest)" if row["latest"] else "")
        table.add_row(
            tag,
            str(row["step"]),
            units.human(row["size_bytes"], units.SHORT, decimals=1),
            verified,
            _zero_and_world(row),
            _when(row["created"]),
        )
    if not rows:
        table.add_row("(none complete)", "", "", "", "", "")
    return table


def _when(iso: str) -> str:
    """2026-11-29T10:15:20+0000 -> 11-29 10:15 (the table is for glancing; --json has the full time)."""
    return iso[5:16].replace("T", " ")


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
