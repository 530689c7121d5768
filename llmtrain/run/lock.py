"""One writer per run directory: RUN_DIR/run.lock, held for the whole run.

Two `train` / `resume` processes on one run directory (a Slurm requeue while the old job is still
alive, a command typed twice) would write the same metrics.jsonl and checkpoints. The process the user
started takes an exclusive `flock` on RUN_DIR/run.lock before anything in the run directory is written
and before `--resume auto` decides between resuming and starting afresh, and keeps the descriptor open
until it ends. Under an outside launcher (torchrun, srun: RANK set) only global rank 0 takes it;
DeepSpeed's relaunched `llmtrain worker` processes never do. The kernel releases the lock on any exit,
SIGKILL included; on NFSv4 it holds across hosts. The descriptor is close-on-exec, so no child process
(DeepSpeed's launcher, its workers) keeps a dead run's lock.

The file names its holder (JSON: host, pid, command, start time), so a refused run can say whom it
waits for. A clean end empties it; a file that still names a holder when the lock is taken was left by
a process that died holding it, and taking it over is reported. A filesystem that cannot lock gets a
warning and the run goes on unguarded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmtrain import rundir
from llmtrain.errors import EXIT_BAD_INPUT, BadInput, ConfigError

POLL_S = 0.5  # how often a waiting run looks again
AUTO_WAIT_S = 120.0  # `train --resume auto` (a requeue): time for the old job to save and exit
# flock on a filesystem without locks (some NFS mounts, FUSE): ENOTSUP is EOPNOTSUPP on Linux.
_CANNOT_LOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


class RunDirInUse(ConfigError):
    """Another llmtrain process holds the run directory's lock (exit 2)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: what RUN_DIR/run.lock says."""

    host: str
    pid: int
    command: str
    started: str

    @classmethod
    def this_process(cls) -> Holder:
        program = "llmtrain" if Path(sys.argv[0]).name in ("llmtrain", "__main__.py") else sys.argv[0]
        command = shlex.join([program, *sys.argv[1:]])
        return cls(socket.gethostname(), os.getpid(), command, time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names; None for an empty (released) or unreadable one."""
        try:
            data = json.loads(text)
            return cls(str(data["host"]), int(data["pid"]), str(data["command"]), str(data["started"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, since {self.started}"


def wait_seconds(lock_wait: float | None, resume_auto: bool) -> float:
    """--lock-wait, or its default: none for a plain `train` / `resume` (a second one is a mistake), two
    minutes for `train --resume auto` (a requeued job whose old one is still saving)."""
    if lock_wait is None:
        return AUTO_WAIT_S if resume_auto else 0.0
    if lock_wait < 0:
        raise ConfigError(f"--lock-wait: must be 0 or more seconds, got {lock_wait:g}")
    return lock_wait


def takes_the_lock() -> bool:
    """The process the user started does; under an outside launcher only global rank 0 (as for
    run.prepare.freeze)."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class HeldLock:
    """The run directory's lock as this process holds it (`fd` None: not held, by another rank's turn or
    a filesystem that cannot lock), and what was made to hold it."""

    path: Path
    fd: int | None = None
    made_file: bool = False
    found: bytes = b""  # what the file held before this process took it, and its times
    found_times: tuple[int, int] = (0, 0)
    made_dirs: list[Path] = field(default_factory=list)  # innermost first
    refused: bool = False  # the run was refused for bad input: leave nothing the lock made

    @property
    def made_dir(self) -> bool:
        return bool(self.made_dirs)

    def note(self, code: int) -> int:
        """Record a run's exit code (2: its workers refused their input) and pass it on."""
        self.refused = self.refused or code == EXIT_BAD_INPUT
        return code

    def release(self) -> None:
        """Empty the file (a clean end names no holder), or, for a refused run, remove what the lock made
        and put back what the file held; then close: the kernel releases the lock."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                if not self.refused:
                    _rewrite(self.fd, b"")
                elif self.made_file and _is_open_at(self.fd, self.path):
                    self.path.unlink()
                elif not self.made_file:
                    _rewrite(self.fd, self.found)
                    os.utime(self.fd, ns=self.found_times)
            os.close(self.fd)
            self.fd = None
        if self.refused:
            _remove_empty(self.made_dirs)


@contextlib.contextmanager
def hold(run_dir: Path, label: str, wait_s: float, *, create: bool) -> Iterator[HeldLock]:
    """Hold `run_dir`'s lock around a run. `label` names the run directory as the user gave it
    (`--run-dir runs/x`); `create`: make the directory (train) or leave a missing one to be refused
    (resume). A run refused for bad input (BadInput, or `note(2)`) leaves nothing the lock made."""
    held = acquire(run_dir, label, wait_s, create=create)
    try:
        yield held
    except BadInput:
        held.refused = True
        raise
    finally:
        held.release()


def acquire(run_dir: Path, label: str, wait_s: float, *, create: bool) -> HeldLock:
    """Take the lock, waiting up to `wait_s` for a holder to end; RunDirInUse when it does not."""
    path = run_dir / rundir.LOCK_FILE
    if not takes_the_lock() or (not create and not run_dir.is_dir()):
        return HeldLock(path)
    held = HeldLock(path, made_dirs=_make_dirs(run_dir, label) if create else [])
    try:
        return _take(held, run_dir, label, wait_s, create=create)
    except BaseException:
        _remove_empty(held.made_dirs)  # refused, or interrupted while waiting: take nothing away but those
        raise


def _take(held: HeldLock, run_dir: Path, label: str, wait_s: float, *, create: bool) -> HeldLock:
    path, waiting = held.path, _Waiting(label, wait_s)
    while True:
        opened = _open(path, label)
        if opened is None:  # the directory was removed (a refused run cleaning up) while we waited
            if not create:
                return held
            held.made_dirs += _make_dirs(run_dir, label)
            continue
        fd, made = opened
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            waiting.for_holder_of(path)
            continue
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _CANNOT_LOCK:
                raise
            _warn(f"{label}: this filesystem cannot lock files ({exc.strerror}); nothing stops a second run")
            if made:
                path.unlink(missing_ok=True)
            return held
        if not _is_open_at(fd, path):  # removed (a refused run cleaning up) while we waited: open it anew
            os.close(fd)
            continue
        before = os.fstat(fd)
        held.fd, held.made_file, held.found_times = fd, made, (before.st_atime_ns, before.st_mtime_ns)
        held.found = _take_over(fd, run_dir)
        return held


class _Waiting:
    """A held lock met: one line saying whom we wait for, then a look every POLL_S until the deadline;
    past it, RunDirInUse naming the holder."""

    def __init__(self, label: str, wait_s: float) -> None:
        self.label, self.wait_s = label, wait_s
        self.deadline = time.monotonic() + wait_s
        self.announced = False

    def for_holder_of(self, path: Path) -> None:
        who = _who(_holder_of(path))
        if time.monotonic() >= self.deadline:
            after = f" after waiting {self.wait_s:g} s" if self.wait_s else ""
            raise RunDirInUse(f"{self.label}: in use by {who}{after}; wait for it to end or stop it")
        if not self.announced:
            print(
                f"waiting up to {self.wait_s:g} s for {self.label}: in use by {who}",
                file=sys.stderr,
                flush=True,
            )
            self.announced = True
        time.sleep(POLL_S)


def _take_over(fd: int, run_dir: Path) -> bytes:
    """Name this process in the file; a holder still named there died holding the lock. Returns what
    the file held."""
    found = os.pread(fd, 1 << 16, 0)
    _rewrite(fd, (json.dumps(asdict(Holder.this_process())) + "\n").encode())
    previous = Holder.parse(found.decode("utf-8", "replace"))
    if previous is not None:
        _warn(
            f"taking over the lock of {run_dir} left by pid {previous.pid} on host {previous.host} "
            f"(started {previous.started}); that process is gone"
        )
    return found


def _rewrite(fd: int, data: bytes) -> None:
    """In place: a rename would leave the lock on the old file."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _who(holder: Holder | None) -> str:
    if holder is None:
        return f"another llmtrain process (not yet named in {rundir.LOCK_FILE})"
    return f"llmtrain ({holder.describe()})"


def _holder_of(path: Path) -> Holder | None:
    """The holder named in `path`; a holder that has just taken the lock writes its name right after,
    so an empty file is read again for a moment."""
    for _ in range(10):
        with contextlib.suppress(OSError):
            holder = Holder.parse(path.read_text(encoding="utf-8", errors="replace"))
            if holder is not None:
                return holder
        time.sleep(0.05)
    return None


def _open(path: Path, label: str) -> tuple[int, bool] | None:
    """The lock file's descriptor, close-on-exec, and whether this call made the file; None when the
    directory is gone."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            return os.open(path, flags), False
    except FileNotFoundError:
        return None if not path.parent.is_dir() else _open(path, label)  # the file, removed meanwhile
    except OSError as exc:
        raise ConfigError(
            f"{label}: cannot open {path} ({exc.strerror}); pass a run directory you can write to"
        ) from None


def _is_open_at(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _make_dirs(run_dir: Path, label: str) -> list[Path]:
    """Make `run_dir` and missing parents; returns those made, innermost first."""
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{label}: cannot make the directory ({exc.strerror}); pass a writable path"
        ) from None
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    for directory in dirs:
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue  # already removed (launch._undo removes a new run directory whole)
        except OSError:
            return  # not empty: something else lives there now


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
