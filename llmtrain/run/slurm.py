"""Slurm: ranks from `srun`, and the batch script `train --sbatch FILE` writes.

Ranks. `srun llmtrain train ...` inside an allocation, one task per device.

srun starts every task of a job step with the step's shape in SLURM_* variables, and with none of the
variables torch.distributed reads. Each task of a step of several tasks becomes one rank, as under
torchrun: RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the step, MASTER_ADDR the step's first
node (`scontrol show hostnames`), MASTER_PORT derived from the job id (both kept when already set, so a
site's own choice wins). From there the run is prepared and launched as under any outside launcher:
rank 0 takes the run directory's lock and every rank takes rank 0's config.

A step of one task (`srun -n1 llmtrain train --gpus 8`), and the batch script itself (which is no step),
launch as on any machine. Each task is named by its Slurm node (SLURMD_NODENAME), and its output reaches
the user through srun, as plain lines.

The batch script (`batch_script`) runs the same `train` under srun with `--resume auto`, asks to be
requeued on preemption, and is signalled before the time limit. Slurm sends SIGTERM to every task on
preemption, `scontrol requeue` and scancel: each finishes its step, all save together and exit 0 (the
job's KillWait is the time they have). The time-limit signal (USR1) goes to the script alone; it asks
the tasks to save the same way (scancel --signal, since srun itself would end the step on a SIGTERM)
and requeues the job once they have. A requeued job starts the script again and continues from the
checkpoint. Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from llmtrain.config import ConfigError, LaunchConfig, flag_for
from llmtrain.parallel.node import NODE_ENV

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
    out[NODE_ENV] = _variable(env, "SLURMD_NODENAME")
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


# ---------------------------------------------------------------- the batch script of `train --sbatch`

SCRIPT_MARK = "# Written by `llmtrain train --sbatch`"
# Seconds before the time limit that the script is told to save: room for a step and a checkpoint.
SIGNAL_BEFORE_LIMIT_S = 300
# Settings of DeepSpeed's runner, which a job has no use for: srun starts its tasks on the nodes Slurm
# allocates, with the environment sbatch passes on.
RUNNER_SETTINGS = (
    "launch.hostfile",
    "launch.launcher",
    "launch.launcher_args",
    "launch.master_addr",
    "launch.master_port",
    "launch.forward_env",
)


def check_job_launch(launch: LaunchConfig) -> None:
    """A job is sized by --nodes and --gpus alone; a runner's setting is refused (one line, exit 2)."""
    default = LaunchConfig()
    for key in RUNNER_SETTINGS:
        name = key.removeprefix("launch.")
        if getattr(launch, name) != getattr(default, name):
            raise ConfigError(
                f"{flag_for(key)}: not for a Slurm job, whose tasks srun starts on the nodes Slurm "
                f"allocates, with the environment sbatch passes on; drop {flag_for(key)} (--nodes and "
                "--gpus size the job)"
            )


def check_script_path(path: Path) -> None:
    """A job script of ours may be written again; any other file is left alone (one line, exit 2)."""
    if path.is_dir():
        raise ConfigError(f"--sbatch {path}: is a directory; give the path of the job script to write")
    if path.exists() and SCRIPT_MARK not in path.read_text(errors="replace")[:200]:
        raise ConfigError(
            f"--sbatch {path}: exists and was not written by llmtrain; nothing was changed; choose "
            "another path or remove it"
        )
    if not path.parent.is_dir():
        raise ConfigError(f"--sbatch {path}: the folder {path.parent} does not exist; create it first")


def job_shape(nodes: int, tasks_per_node: int) -> str:
    """`2 nodes x 8 tasks per node`."""
    return f"{nodes} node{'s' * (nodes != 1)} x {tasks_per_node} task{'s' * (tasks_per_node != 1)} per node"


def train_arguments(cfg_args: Mapping[str, Any], run_dir: Path, debug: bool) -> list[str]:
    """The `llmtrain` arguments each task of the job runs: this command's config, sets and flags,
    without --gpus and --nodes (the job's tasks are the ranks), on RUN_DIR (absolute) with --resume auto."""
    args = ["--debug", "train"] if debug else ["train"]
    if cfg_args["config_file"] is not None:
        args += ["--config", str(cfg_args["config_file"])]
    for item in cfg_args["sets"]:
        args += ["--set", item]
    for key, value in cfg_args["flags"].items():
        if value is None or key in LAUNCH_FLAGS or key == "run_dir":
            continue
        flag = flag_for(key)
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            args += [token for item in value for token in (flag, str(item))]
        else:
            args += [flag, str(value)]
    return [*args, "--run-dir", str(run_dir.resolve()), "--resume", "auto"]


def batch_script(
    train_args: list[str], nodes: int, tasks_per_node: int, gpus: bool, run_dir: Path, output: Path,
    env: Mapping[str, str],
) -> str:  # fmt: skip
    """The sbatch script that trains RUN_DIR under srun until done, through preemptions, requeues and
    time limits. `gpus`: ask for one GPU per task; `env`: the variables every task needs."""
    gpu_line = f"#SBATCH --gpus-per-node={tasks_per_node}\n" if gpus else ""
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())
    python = shlex.quote(sys.executable)
    return f"""#!/bin/bash
{SCRIPT_MARK} for {run_dir}. Submit it with `sbatch FILE`, adding
# --time=HH:MM:SS, --partition or --account as your cluster asks (options given to sbatch win).
#SBATCH --job-name=llmtrain-{run_dir.name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={tasks_per_node}
{gpu_line}#SBATCH --requeue
#SBATCH --signal=B:USR1@{SIGNAL_BEFORE_LIMIT_S}
#SBATCH --output={output}
#SBATCH --open-mode=append

# Every task is one rank. SIGTERM (preemption, scontrol requeue, scancel) reaches every task from
# Slurm: each finishes its step, all save together and exit 0 within the job's KillWait, and a
# requeued job continues from that checkpoint (--resume auto). USR1, {SIGNAL_BEFORE_LIMIT_S} s before the
# time limit, reaches this script alone: it has the tasks save the same way (through scancel: srun
# would end the step on a SIGTERM of its own) and requeues the job once they have.
cd {shlex.quote(str(Path.cwd()))}
{exports}export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"

time_up=""
save_and_stop() {{ scancel --signal=TERM "$SLURM_JOB_ID"; }}
trap 'time_up=1; echo "llmtrain: job $SLURM_JOB_ID nears its time limit: saving, then requeueing"; save_and_stop' USR1
trap save_and_stop TERM
echo "llmtrain: job $SLURM_JOB_ID, attempt $((${{SLURM_RESTART_COUNT:-0}} + 1)), on $SLURM_JOB_NODELIST"
srun --kill-on-bad-exit=1 {python} -u -m llmtrain {shlex.join(train_args)} &
srun_pid=$!
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done  # a trap ends `wait` early
wait "$srun_pid"
code=$?
echo "llmtrain: srun exited $code"
if [ -n "$time_up" ] && [ "$code" = 0 ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""
