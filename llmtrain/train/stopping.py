"""SIGTERM / SIGINT to a training process: a request to stop. The trainer's loop finishes the step, every
rank agrees, saves and exits 0 (train.trainer).

A process listens from the moment it knows it will train: before the run directory's lock (which
`--resume auto` may wait for), before torch and DeepSpeed are imported, the process group joined and
the engine built, which takes minutes for a large model. A preemption or a job's time-limit signal in
that window is kept: the run stops after its first step with a checkpoint and exits 0. Without it the
signal's default action would kill the process, which a Slurm job script takes for a failure and does
not requeue. Torch-free, so that listening costs nothing before the imports.
"""

from __future__ import annotations

import signal
from types import FrameType


class StopSignal:
    """The process's request to stop: set by SIGTERM or SIGINT, with the signal's name."""

    def __init__(self) -> None:
        self.requested = False
        self.name = ""

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.name = signal.Signals(signum).name


_listener: StopSignal | None = None


def listen() -> StopSignal:
    """This process's listener, with any request it has had since the first call; the handlers are
    installed again on every call (a fault injected by a test may have replaced them)."""
    global _listener
    if _listener is None:
        _listener = StopSignal()
    _listener.install()
    return _listener
