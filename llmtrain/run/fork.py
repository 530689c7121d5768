"""`llmtrain fork RUN_DIR --step N --run-dir NEW [changes]`: a new run that continues RUN from its
checkpoint at step N with the whole training state (weights, optimizer, data position, counters, RNG),
under a config that may differ where a fork is for: the schedule's tail (a WSD cooldown starting now:
`--steps N+K --set schedule.decay_steps=K`), the run's length, and whatever a resume may change.

RUN is only read. NEW receives the step-N checkpoint as `checkpoints/<tag>` (hard links where the
filesystem allows: a committed checkpoint's files are never written again, and pruning in NEW unlinks
NEW's names only; copies otherwise) with `latest` naming it, RUN's tokenizer.json and metrics.jsonl
(the resume keeps the records up to step N, so NEW's curves start with its parent's), and
`fork.json`: the parent, the step and the checkpoint it came from. Then NEW resumes as any run does,
so its first step uses the batch RUN would have used at step N+1.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from llmtrain import checkpoint, rundir
from llmtrain.config import ConfigError, flag_for
from llmtrain.config import resolve as resolve_config
from llmtrain.fsutil import write_atomic
from llmtrain.planning.layout import check_resume
from llmtrain.run.prepare import (
    RESUME_MAY_CHANGE,
    ConfigChanges,
    PreparedRun,
    check_launch,
    refuse_breaking_changes,
)
from llmtrain.train import schedule

# What a fork may change besides what a resume may: the learning-rate schedule (its tail), and a
# data mixture's weights (its sources stay: data.mixture.refuse_changed_sources).
FORK_MAY_CHANGE = (*RESUME_MAY_CHANGE, "schedule.", "data.mixture")
COPIED_FILES = (rundir.TOKENIZER_FILE, rundir.TOKENIZER_CONFIG_FILE, rundir.METRICS_FILE)


def prepare_fork(parent: Path, step: str, new_dir: Path, changes: ConfigChanges) -> PreparedRun:
    """Check everything, then write NEW's starting files; the PreparedRun resumes NEW."""
    saved = rundir.load_saved_config(parent)
    tag, info = _checkpoint_at(parent, step)
    _refuse_destination(parent, new_dir)
    cfg = resolve_config(changes.config_file, changes.sets, changes.flags, base=saved)
    refuse_breaking_changes(saved, cfg, parent, FORK_MAY_CHANGE)
    if saved.data.mixture != cfg.data.mixture:
        from llmtrain.data.mixture import refuse_changed_sources

        refuse_changed_sources(saved.data, cfg.data, f"fork {parent}")
    cfg.run_dir = str(new_dir)
    if cfg.total_steps <= info.step:
        raise ConfigError(
            f"{flag_for('train.steps')}: the fork starts after step {info.step} of {parent}; give more "
            f"steps than that (e.g. --steps {info.step + max(1, info.step // 5)})"
        )
    check_launch(cfg)
    layout = cfg.layout()
    check_resume(
        layout,
        checkpoint.saved_layout(info, layout),
        cfg.zero.stage,
        info.partitioned,
        cfg.model.num_key_value_heads,
        engine=info.engine,
    )
    schedule.check_schedule(cfg)
    try:
        _write_start(parent, new_dir, tag, info.step)
    except BaseException:
        discard(new_dir, made=False)
        raise
    return PreparedRun(cfg, new_dir, resume=True, new_dir=True)


def _checkpoint_at(parent: Path, step: str) -> tuple[str, checkpoint.CheckpointInfo]:
    """The intact, complete checkpoint of `parent` at `step` (a step number or a tag)."""
    text = step.strip()
    tag = checkpoint.tag_for(int(text)) if text.isdigit() else text
    complete = {info.tag: info for info in checkpoint.list_complete(rundir.checkpoint_root(parent))}
    if tag not in complete:
        have = ", ".join(str(info.step) for info in complete.values()) or "none"
        raise ConfigError(
            f"--step {step}: {parent} has no complete checkpoint there (checkpoints at steps: {have}); "
            f"fork from one of them (list them with `llmtrain runs {parent}`)"
        )
    problems = checkpoint.verify(complete[tag].path)
    if problems:
        raise ConfigError(f"--step {step}: checkpoint {tag} of {parent} is damaged: {'; '.join(problems)}")
    return tag, complete[tag]


def _refuse_destination(parent: Path, new_dir: Path) -> None:
    if new_dir.resolve() == parent.resolve():
        raise ConfigError(
            f"--run-dir {new_dir}: is the run being forked; give the fork a directory of its own"
        )
    rundir.refuse_fresh_run_over_checkpoints(new_dir)
    rundir.refuse_foreign_files(new_dir)


def _write_start(parent: Path, new_dir: Path, tag: str, step: int) -> None:
    """NEW's checkpoint (linked or copied), `latest`, tokenizer, metrics and fork.json."""
    source = rundir.checkpoint_root(parent) / tag
    root = rundir.checkpoint_root(new_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{tag}.fork{os.getpid()}"
    shutil.copytree(source, staging, copy_function=_link_or_copy)
    os.replace(staging, root / tag)
    write_atomic(root / checkpoint.LATEST, tag + "\n")
    for name in COPIED_FILES:
        if (parent / name).is_file():
            shutil.copyfile(parent / name, new_dir / name)
    record = {
        "parent": str(parent.resolve()),
        "step": step,
        "checkpoint": tag,
        "forked_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_atomic(new_dir / rundir.FORK_FILE, json.dumps(record, indent=2) + "\n")


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(source, destination)


def discard(new_dir: Path, made: bool) -> None:
    """After `prepare_fork` has written NEW's start (never before: NEW may be a directory the checks
    refused), a fork refused for bad input leaves nothing: the directory if this command made it,
    else what the fork wrote into it (the run's own files are removed by the resume's undo)."""
    if made:
        shutil.rmtree(new_dir, ignore_errors=True)
        return
    shutil.rmtree(rundir.checkpoint_root(new_dir), ignore_errors=True)
    for name in (*COPIED_FILES, rundir.FORK_FILE):
        (new_dir / name).unlink(missing_ok=True)
