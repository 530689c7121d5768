"""Crash-safe file writes shared by run files, prepared data and checkpoints, and the one rule for a
file a verb writes at a path the user gave."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from llmtrain.errors import ConfigError


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable."""
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write, fsync, rename over `path`, fsync the directory: readers see old or new, never half.
    Text is written as UTF-8, bytes as they are. A write that fails leaves no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def check_output_file(path: Path, flag: str, force: bool) -> None:
    """A verb writing one file at `path` never replaces what is there unless told to (`--force`), and
    never a directory: refused in one line before any work is done."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give the path of a file to write")
    if path.exists() and not force:
        raise ConfigError(f"{flag} {path}: already exists; nothing was changed; pass --force to replace it")


def refuse_foreign_names(flag: str, directory: Path, foreign: list[str], writer: str) -> None:
    """A verb writing into `directory` never writes beside files it did not write: one line naming up to
    three of them (`writer`: who would have written them), before any work is done."""
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"{flag} {directory}: holds files {writer} did not write ({shown}); nothing was changed; "
            "give a new or empty directory"
        )
