"""What the multi-process benchmarks share: a free rendezvous port, the environment torch.distributed
reads (as a launcher would set it, all ranks on this machine), the rank processes of one setup driven
over their stdin and stdout (`RankGroup` on the parent's side, `serve_commands` on the rank's), and
writing a result file."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent


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


class RankGroup:
    """The ranks of one setup, each `python -m MODULE --worker SETUP_JSON` (a dataclass with a `name`),
    reading one command a line and answering one JSON line each; every command goes to all ranks."""

    def __init__(self, module: str, setup: Any, world_size: int, log_dir: Path) -> None:
        self.module, self.setup = module, setup
        port = free_port()
        slug = setup.name.replace(" ", "-")
        self.logs = [log_dir / f"{slug}-rank{rank}.log" for rank in range(world_size)]
        self.procs = [self._start(rank, world_size, port) for rank in range(world_size)]

    def _start(self, rank: int, world_size: int, port: int) -> subprocess.Popen[str]:
        with open(self.logs[rank], "w") as log:  # the worker keeps its own copy of the descriptor
            return subprocess.Popen(
                [sys.executable, "-m", self.module, "--worker", json.dumps(asdict(self.setup))],
                cwd=REPO,
                env=rank_env(rank, world_size, port),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def send(self, command: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()

    def replies(self) -> list[dict[str, Any]]:
        """Every rank's answer, rank 0's first; a rank that died is named with the tail of its log."""
        out = []
        for rank, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                tail = "".join(self.logs[rank].read_text().splitlines(keepends=True)[-30:])
                raise RuntimeError(f"bench worker {self.setup.name} rank {rank} died:\n{tail}")
            out.append(json.loads(line))
        return out

    def ask(self, command: str) -> list[dict[str, Any]]:
        self.send(command)
        return self.replies()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.send("quit")
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serve_commands(build: Callable[[], Callable[[str, list[str]], dict[str, Any]]]) -> None:
    """A rank's side of RankGroup: build what answers (`build()`, after stdout is redirected), say
    `ready`, then answer each `COMMAND [ARGS...]` line with one JSON line until `quit`. Replies go to
    the original stdout; everything libraries print goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    answer = build()
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        replies.write(json.dumps(answer(command, args)) + "\n")


Group = TypeVar("Group", bound=RankGroup)


@contextlib.contextmanager
def all_ready(groups: Iterable[Group]) -> Iterator[list[Group]]:
    """Start the groups (a generator: a failure to start one still closes those started), wait for
    every rank's ready line, and close them all at the end."""
    started: list[Group] = []
    try:
        for group in groups:
            started.append(group)
        for group in started:
            group.replies()
        yield started
    finally:
        for group in started:
            group.close()


def write_result(result: dict[str, Any], out: Path) -> None:
    """The result on stdout as one JSON line, and kept in `out` (bench/results/NAME.json)."""
    print(json.dumps(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
