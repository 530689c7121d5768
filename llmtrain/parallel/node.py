"""The node a worker runs on, as the user's hostfile names it, and whether a launcher started this
process. Free of torch: a worker learns both before torch is imported."""

from __future__ import annotations

import os
import socket

NODE_ENV = "LLMTRAIN_NODE"  # set only in the workers of a hostfile launch and in srun tasks


def node_name() -> str:
    """This worker's node as the hostfile names it; the host name outside a hostfile launch."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def output_relayed() -> bool:
    """A worker of a hostfile launch reaches the user's screen through the runner (pdsh prefixes each
    line with its node; mpirun hands the workers a pseudo-terminal of its own), never directly: it
    prints plain lines, as into a file, whatever the user's terminal."""
    return NODE_ENV in os.environ


def inside_launcher() -> bool:
    """True when a launcher (deepspeed, torchrun, Slurm via DeepSpeed, srun once run.slurm adopted the
    step) started this process: it is one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
