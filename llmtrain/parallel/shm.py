"""DeepSpeed's shared-memory all-reduce buffers: each rank's own removed at its end, dead runs' swept at start.

DeepSpeed's CPU all-reduce (its shm comm op, used when all ranks share a machine) creates one file per
rank, /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (ops/csrc/cpu/comm/
shm.cpp, 69 MB in DeepSpeed 0.19.8), and never unlinks it: every multi-process run on a CPU machine
leaked 138 MB of RAM until the machine swapped. The peers have mapped each file since initialisation,
and a mapping outlives the name, so each rank removes its own at shutdown (`remove_own_buffer`).

A run that is killed (SIGKILL, the OOM killer) never reaches shutdown; 300 such files once filled a
machine's /dev/shm. The name carries no pid, so `sweep_dead_buffers` judges a file by its holders: every
rank keeps its own file open and every peer's mapped for as long as it lives, so a file that no process
holds open or maps belongs to a run that is over, and is removed. A live run's files always have a
holder: the creating rank holds the descriptor from the moment the file exists.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

BUFFER_PREFIX = "deepspeed_allreduce_buffer"
SHM_DIR = Path("/dev/shm")


def buffer_name(rank: int) -> str:
    """This process's rank's buffer name, from the rendezvous variables DeepSpeed reads."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{BUFFER_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def remove_own_buffer(rank: int) -> None:
    with contextlib.suppress(OSError):
        (SHM_DIR / buffer_name(rank)).unlink()


def sweep_dead_buffers(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove this user's buffers that no live process holds open or maps; returns those removed.
    Costs one directory listing when there is nothing to sweep."""
    candidates = _own_buffers(shm_dir)
    if not candidates:
        return []
    held = _held_inodes(set(candidates))
    removed = []
    for inode, path in candidates.items():
        if inode not in held and _still_names(path, inode):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def _own_buffers(shm_dir: Path) -> dict[tuple[int, int], Path]:
    """(device, inode) -> path of this user's buffer files (another user's cannot be ours to judge)."""
    prefix = f"{BUFFER_PREFIX}_{os.getuid()}_"
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if entry.name.startswith(prefix) and entry.is_file() and info.st_uid == os.getuid():
                    found[(info.st_dev, info.st_ino)] = Path(entry.path)
    return found


def _held_inodes(wanted: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Those of `wanted` some process holds open or maps. Open descriptors are looked at first (cheap:
    one readlink each); the memory maps only for files no descriptor holds, so that a DeepSpeed that
    closed its descriptors after mapping would still count as holding its buffers."""
    pids = [name for name in os.listdir("/proc") if name.isdigit()] if os.path.isdir("/proc") else []
    held = {inode for pid in pids for inode in _open_buffers(pid) if inode in wanted}
    for pid in pids:
        if held >= wanted:
            break
        held |= _mapped_buffers(pid) & wanted
    return held


def _open_buffers(pid: str) -> set[tuple[int, int]]:
    """(device, inode) of the buffer files process `pid` holds open (none when it cannot be read)."""
    found = set()
    fd_dir = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):  # gone, or another user's process
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                if BUFFER_PREFIX in os.readlink(f"{fd_dir}/{fd}"):
                    info = os.stat(f"{fd_dir}/{fd}")  # the open file itself, even if since unlinked
                    found.add((info.st_dev, info.st_ino))
    return found


def _mapped_buffers(pid: str) -> set[tuple[int, int]]:
    """(device, inode) of the buffer files process `pid` maps (none when it cannot be read). A maps
    line reads `address perms offset major:minor inode path`, the device numbers in hex."""
    found = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if BUFFER_PREFIX in line:
                with contextlib.suppress(ValueError, IndexError):
                    _, _, _, device, inode = line.split(maxsplit=5)[:5]
                    major, minor = device.split(":")
                    found.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
    return found


def _still_names(path: Path, inode: tuple[int, int]) -> bool:
    """The name still leads to the file judged dead (not to a new run's file created since)."""
    try:
        info = path.stat()
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == inode
