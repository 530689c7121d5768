"""What the multi-process benchmarks share to start their ranks: a free rendezvous port and the
environment torch.distributed reads (as a launcher would set it, all ranks on this machine)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
