"""Ports for rank 0's rendezvous store. Free of torch: the launcher picks one before any worker starts.

A port from the kernel's ephemeral range (what binding port 0 hands out) is free only until some process
on the machine opens an outgoing connection: the kernel may give that connection the same local port,
and gloo listens and connects on dozens per process group. Seen with two DeepSpeed jobs side by side on
one machine: between the pick and rank 0's listen (seconds: the workers import torch first) the port was
taken, and the other ranks' connects to it were reset. A port below the ephemeral range is never handed
out that way: only another process asking for that very port can take it.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

LOWEST = 20000  # the conventional services (29500 aside) stay below; Slurm jobs' ports share this range
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 200


def in_use(port: int, address: str = "") -> bool:
    """Whether torch's store could not listen on `port`. SO_REUSEADDR as the store sets it: a port a
    finished run's connections leave in TIME_WAIT is free; one a process listens on is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def free_port(address: str = "127.0.0.1") -> int:
    """A port nobody uses on `address`, below the ephemeral range when the kernel leaves room there
    (else one the kernel picks). Drawn from the system's entropy, not `random`'s seeded state: runs
    started side by side with the same seed must not draw the same port."""
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral > LOWEST:
        draw = random.SystemRandom()
        for _ in range(_TRIES):
            port = draw.randrange(LOWEST, first_ephemeral)
            if not in_use(port, address):
                return port
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here
