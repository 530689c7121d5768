"""Workers end when the `llmtrain` command that launched them dies.

`llmtrain train --gpus 2` runs DeepSpeed's runner in a session of its own, so that a Ctrl-C or a
SIGTERM reaches only the command, which lets the workers finish the step and save (run.launch). The
cost: when the command is SIGKILLed (kill -9 of its process group, the OOM killer) nothing tells the
runner, DeepSpeed's launch.py or the workers, and they trained on without the run directory's lock,
which the kernel released with the command (run.lock), holding the master port, so the next run failed
with EADDRINUSE.

DeepSpeed's runner, the command's child, gets SIGTERM when the command dies (Linux's parent-death
signal): it ends at once, and under pdsh its handler stops the remote launchers. DeepSpeed starts the
processes below it, so that signal cannot be asked for them: the command names itself in its workers'
environment (LLMTRAIN_LAUNCHER: pid, start time, machine) and every worker on the same machine watches
it from a thread, as torchrun's agent watches its workers. The watch is a pidfd, readable the moment
the process exits (Linux >= 5.3), else a look twice a second. A pipe whose write end the command holds
would be as prompt, but DeepSpeed's runner and launch.py close every inherited descriptor when they
start their children. The start time tells the command from a later process given the same pid.

A worker whose command has died SIGKILLs its own children and itself, without a save: the run
directory's lock is gone, so a save now could race the next command writing the same directory, and a
command killed with SIGKILL was meant to stop now. The last complete checkpoint stands and `llmtrain
resume` continues from it. DeepSpeed's launch.py sees its workers fail and exits, and its runner with
it. Workers on the other nodes of a hostfile launch (where the pid means nothing) are not watched; their
next collective fails once this node's ranks are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from llmtrain.envvar import set_for_block
from llmtrain.parallel import shm

LAUNCHER_ENV = "LLMTRAIN_LAUNCHER"
POLL_S = 0.5  # where no pidfd can be had: how often the command is looked for
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child sent SIGTERM when this process dies (None off Linux). Only
    the child's part runs after the fork: libc is looked up here, before it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # libc's, through the program's own symbols
    parent = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # died before the signal was asked for
            os._exit(1)

    return in_child


@contextlib.contextmanager
def named_as_launcher() -> Iterator[None]:
    """In the command, around the launch: the workers inherit the variable (on the nodes of a hostfile
    launch through its env.json, which forwards llmtrain's variables). Put back as it was afterwards,
    for a process (a test) that goes on to run something else."""
    pid = os.getpid()
    with set_for_block(
        LAUNCHER_ENV, json.dumps({"pid": pid, "start": _start_mark(pid), "machine": machine()})
    ):
        yield


def watch_launcher() -> None:
    """In a worker: end it when the command named in the environment dies (nothing when none is named,
    or it runs on another machine)."""
    launcher = _launcher_here()
    if launcher is not None:
        watch = threading.Thread(target=_end_when_gone, args=launcher, name="launcher-watch", daemon=True)
        watch.start()


def machine() -> str:
    """This machine and pid namespace: a pid names the same process only where this is equal."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts) or socket.gethostname()


def _launcher_here() -> tuple[int, str] | None:
    """(pid, start mark) of the launching command when the environment names one on this machine."""
    try:
        named = json.loads(os.environ.get(LAUNCHER_ENV, ""))
        pid, start, where = int(named["pid"]), str(named["start"]), str(named["machine"])
    except (ValueError, KeyError, TypeError):
        return None
    return (pid, start) if where == machine() else None


def _start_mark(pid: int) -> str | None:
    """What tells process `pid` from a later one given the same pid (its start time in clock ticks
    since boot, from /proc; elsewhere psutil's start time); None when it has ended (a zombie too)."""
    if not os.path.isdir("/proc/self"):
        try:
            process = psutil.Process(pid)
            return None if process.status() == psutil.STATUS_ZOMBIE else repr(process.create_time())
        except psutil.Error:
            return None
    try:
        # After the command name (which may hold spaces and parentheses): state, ..., starttime (field 22).
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else fields[18]


def _end_when_gone(pid: int, start: str) -> None:
    _wait_until_gone(pid, start)
    _end_this_worker(pid)


def _wait_until_gone(pid: int, start: str) -> None:
    pidfd = _open_pidfd(pid)
    try:
        # Checked after the pidfd is open: the command started before it, so a match means the
        # pidfd is the command's.
        if _start_mark(pid) != start:
            return
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()  # readable once the process has exited
            return
        while _start_mark(pid) == start:
            time.sleep(POLL_S)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or the process is gone (its mark says so)
        return None


def _end_this_worker(launcher_pid: int) -> None:
    """SIGKILL this worker's children and itself, its shared-memory buffer's name removed first (every
    peer here is ending too; the next run's sweep would find it otherwise)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        note = (
            f"warning: the llmtrain command that launched this run (pid {launcher_pid}) has died; "
            "its workers stop without saving (`llmtrain resume` continues from the last checkpoint)\n"
        )
        # Straight to the descriptor: sys.stderr's lock may be held by the thread this one ends, and
        # the terminal may be gone with the command.
        with contextlib.suppress(OSError):
            os.write(2, note.encode())
    shm.remove_own_buffer(rank)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os.kill(os.getpid(), signal.SIGKILL)
