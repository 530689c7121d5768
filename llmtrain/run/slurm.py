"""Ranks from Slurm: `srun llmtrain train ...` inside an allocation, one task per device.

srun starts every task of a job step with the step's shape in SLURM_* variables, and with none of the
variables torch.distributed reads. Each task of a step of several tasks becomes one rank, as under
torchrun: RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the step, MASTER_ADDR the step's first
node (`scontrol show hostnames`), MASTER_PORT derived from the job id (both kept when already set, so a
site's own choice wins). From there the run is prepared and launched as under any outside launcher:
rank 0 takes the run directory's lock and every rank takes rank 0's config.

A step of one task (`srun -n1 llmtrain train --gpus 8`), and the batch script itself (which is no step),
launch as on any machine. Torch-free.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from llmtrain.config import ConfigError, flag_for

# Derived ports stay below Linux's ephemeral range (32768-60999), where outgoing connections take theirs.
PORT_BASE, PORT_SPAN = 20000, 12000
# Flags that size a launch llmtrain makes itself; under a step the step's tasks are the ranks.
LAUNCH_FLAGS = ("launch.gpus", "launch.nodes", "launch.hostfile")


def in_step(env: Mapping[str, str]) -> bool:
    """True inside an srun step of several tasks that no launcher of its own has given ranks."""
    if "SLURM_STEP_ID" not in env or "RANK" in env:
        return False
    return _number(env, "SLURM_STEP_NUM_TASKS", fallback="SLURM_NTASKS") > 1


def rank_environment(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> dict[str, str]:
    """torch.distributed's variables for this task of the step; `hostnames` expands a Slurm node list."""
    tasks = _number(env, "SLURM_STEP_NUM_TASKS", fallback="SLURM_NTASKS")
    rank = _number(env, "SLURM_PROCID")
    if not 0 <= rank < tasks:
        raise ConfigError(f"SLURM_PROCID: {rank} is not a rank of a step of {tasks} tasks")
    node = _number(env, "SLURM_NODEID")
    per_node = tasks_per_node(_variable(env, "SLURM_STEP_TASKS_PER_NODE", fallback="SLURM_TASKS_PER_NODE"))
    if not 0 <= node < len(per_node):
        raise ConfigError(f"SLURM_NODEID: {node} is not a node of a step on {len(per_node)} nodes")
    out = {
        "RANK": str(rank),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(_number(env, "SLURM_LOCALID")),
        "LOCAL_WORLD_SIZE": str(per_node[node]),
    }
    if "MASTER_ADDR" not in env:
        nodes = hostnames(_variable(env, "SLURM_STEP_NODELIST", fallback="SLURM_JOB_NODELIST"))
        if not nodes:
            raise ConfigError("SLURM_STEP_NODELIST: names no node")
        out["MASTER_ADDR"] = nodes[0]
    if "MASTER_PORT" not in env:
        out["MASTER_PORT"] = str(PORT_BASE + _number(env, "SLURM_JOB_ID") % PORT_SPAN)
    return out


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list, node by node: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: {text!r} is not a list like `2(x3),1`")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`: `node[1-2]` -> ["node1", "node2"]."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise ConfigError(
            "MASTER_ADDR: not set, and no `scontrol` here to find the step's first node; set MASTER_ADDR "
            "to that node's address"
        )
    done = subprocess.run(
        [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise ConfigError(
            f"SLURM_STEP_NODELIST: `scontrol show hostnames {nodelist}` failed: {done.stderr.strip()}"
        )
    return done.stdout.split()


def adopt_step(flags: Mapping[str, Any]) -> None:
    """Inside an srun step of several tasks: this task's rank variables into the environment, before
    the run directory's lock (only rank 0 takes it) and before anything launches. `flags` are the
    command line's: a launch it would size itself is refused, since the step's tasks are the ranks."""
    if not in_step(os.environ):
        return
    for key in LAUNCH_FLAGS:
        if flags.get(key) is not None:
            tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
            raise ConfigError(
                f"{flag_for(key)}: under srun every task is one rank (this step has {tasks} tasks); drop "
                f"{flag_for(key)}, or start one task (srun -n1) to launch the processes from it"
            )
    os.environ.update(rank_environment(os.environ, scontrol_hostnames))


def _variable(env: Mapping[str, str], name: str, fallback: str | None = None) -> str:
    value = env.get(name) or (env.get(fallback) if fallback else None)
    if not value:
        raise ConfigError(
            f"{name}: not set inside an srun step (SLURM_STEP_ID is); run the command under srun"
        )
    return value


def _number(env: Mapping[str, str], name: str, fallback: str | None = None) -> int:
    value = _variable(env, name, fallback)
    if not value.isdigit():
        raise ConfigError(f"{name}: {value!r} is not a number")
    return int(value)
