"""Multi-node runs from a hostfile, through DeepSpeed's runners (pdsh over ssh, or an MPI's mpirun).

Before any process starts (`check`): the hostfile holds the nodes and slots asked for, the runner's
program is installed, rank 0's address names the first node, and every node answers ssh without a
password. At launch (`write_launch_files`), RUN_DIR/launch/ receives:
- `hostfile`: exactly the nodes and slots used. The MPI runners start one process per listed slot and
  refuse DeepSpeed's --num_nodes/--num_gpus, so the file itself must say it.
- `env.json` (owner-only): the environment the workers need. A remote shell starts with its node's own
  environment and DeepSpeed forwards only a few prefixes (PYTHON*, UCX*, ...): llmtrain's settings,
  DS_ACCELERATOR, wandb's mode or the thread count would silently differ on the other nodes. Names that
  look like secrets (WANDB_API_KEY, HF_TOKEN) go only when --forward-env names them. The file is
  removed when the launch ends.
Each worker applies env.json first thing (`adopt_launch_environment`, before torch is imported); under
mpirun it also takes its rank from the MPI's variables and rank 0's address from the file (DeepSpeed's
own MPI discovery needs mpi4py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmtrain import rundir
from llmtrain.config import ConfigError, LaunchConfig, flag_for
from llmtrain.fsutil import write_atomic
from llmtrain.parallel.node import NODE_ENV

HOSTFILE = "hostfile"
ENV_FILE = "env.json"
WORKERS_DIR = "workers"  # RUN_DIR/launch/workers/rank-N.json: the node and pid of each worker

# The program DeepSpeed looks for before it starts each runner.
RUNNER_PROGRAMS = {
    "pdsh": "pdsh",
    "openmpi": "ompi_info",
    "mpich": "mpirun",
    "impi": "mpirun",
    "mvapich": "mpiname",
}
SSH_RUNNERS = ("pdsh", "openmpi", "mpich", "impi", "mvapich")  # reach the nodes over ssh
SSH_TIMEOUT_S = 20.0

# Settings the workers on every node must share: llmtrain's, DeepSpeed's accelerator, the libraries'
# modes and caches, the communication libraries' tuning, the thread counts.
FORWARD_PREFIXES = (
    "LLMTRAIN_",
    "DS_",
    "DEEPSPEED_",
    "WANDB_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH_",
    "PYTORCH_",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "MKL_",
)
_SECRET_WORDS = {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "AUTH"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---------------------------------------------------------------- checks before any process starts


def check(launch: LaunchConfig, hosts: dict[str, int]) -> None:
    """Everything about the nodes that can be known before launching; one line, exit 2, otherwise."""
    hostfile = launch.hostfile
    used = list(hosts)[: launch.nodes]
    short = [host for host in used if hosts[host] < launch.gpus]
    if short:
        raise ConfigError(
            f"{flag_for('launch.gpus')}: {launch.gpus} processes per node, but {hostfile} gives "
            f"{', '.join(f'{h} slots={hosts[h]}' for h in short)}; raise the slots or lower --gpus"
        )
    forward_names(launch)
    program = RUNNER_PROGRAMS[launch.launcher]
    if shutil.which(program) is None:
        raise ConfigError(
            f"{flag_for('launch.launcher')} {launch.launcher}: `{program}` is not installed on this machine; "
            f"install it or choose another --launcher ({', '.join(RUNNER_PROGRAMS)})"
        )
    if launch.launcher in SSH_RUNNERS:
        _check_ssh(used, str(hostfile))
    _check_master_addr(launch, used[0])


def forward_names(launch: LaunchConfig) -> list[str]:
    names = [n.strip() for n in (launch.forward_env or "").split(",") if n.strip()]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ConfigError(
            f"{flag_for('launch.forward_env')}: {bad[0]!r} is not an environment variable name; "
            "give names separated by commas (e.g. WANDB_API_KEY,HF_TOKEN)"
        )
    return names


def _check_ssh(hosts: list[str], hostfile: str) -> None:
    """Every node answers `ssh HOST true` without a password (the runners ask for none either)."""
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        answers = list(pool.map(_ssh_answer, hosts))
    for host, problem in zip(hosts, answers, strict=True):
        if problem:
            raise ConfigError(
                f"--hostfile {hostfile}: {host} does not answer ssh ({problem}); the runner starts the "
                f"workers over ssh without a password: make `ssh {host} true` work, or remove {host}"
            )


def _ssh_answer(host: str) -> str:
    """'' when `ssh HOST true` works; else what went wrong, in ssh's words."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S:.0f}", host, "true"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        return f"no answer within {SSH_TIMEOUT_S + 10:.0f}s"
    except FileNotFoundError:
        return "no `ssh` command on this machine"
    if done.returncode == 0:
        return ""
    said = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return said[-1].strip() if said else f"ssh exited with {done.returncode}"


def master_addr(launch: LaunchConfig, first_node: str) -> str:
    """Rank 0's address: --master-addr, else the first node's name (rank 0 runs there)."""
    return launch.master_addr or first_node


def _check_master_addr(launch: LaunchConfig, first_node: str) -> None:
    """DeepSpeed's runners put rank 0 (which hosts the rendezvous) on the first node listed, so the
    address the others connect to must be that node's: its name, or an address it resolves to or holds."""
    addr = launch.master_addr
    if addr is None or addr == first_node or _resolved(addr) & _resolved(first_node):
        return
    if addr in _addresses_held_by(first_node):
        return
    raise ConfigError(
        f"{flag_for('launch.master_addr')} {addr}: rank 0 runs on {first_node}, the first node in "
        f"{launch.hostfile}, and {addr} is not one of its names or addresses; pass --master-addr "
        f"{first_node} (or an address of it), or list the node you meant first"
    )


def _resolved(name: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):
        return set()


def _addresses_held_by(host: str) -> set[str]:
    """The node's own addresses (`hostname -I` there), for a --master-addr given as, say, its
    InfiniBand address that its name does not resolve to."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S:.0f}", host, "hostname", "-I"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 10)
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return set()
    return set(done.stdout.split()) if done.returncode == 0 else set()


# ---------------------------------------------------------------- at launch: the files the runner and workers read


# DeepSpeed's and torchrun's customary port of rank 0, when none is asked for.
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchFiles:
    hostfile: Path
    env_file: Path
    master_addr: str
    master_port: int


def forwarded_environment(environ: dict[str, str], extra_names: list[str]) -> dict[str, str]:
    """The variables every worker gets: llmtrain's and its libraries' settings, no secrets unless named."""
    chosen = {
        name: value
        for name, value in environ.items()
        if name.startswith(FORWARD_PREFIXES) and not _looks_secret(name)
    }
    chosen.update({name: environ[name] for name in extra_names if name in environ})
    return dict(sorted(chosen.items()))


def _looks_secret(name: str) -> bool:
    return bool(set(name.upper().split("_")) & _SECRET_WORDS)


@contextlib.contextmanager
def launch_files(launch: LaunchConfig, hosts: dict[str, int], run_dir: Path) -> Iterator[LaunchFiles]:
    """Write RUN_DIR/launch/{hostfile,env.json} for one launch; env.json is removed when it ends."""
    folder = run_dir / rundir.LAUNCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    used = list(hosts)[: launch.nodes]
    hostfile = folder / HOSTFILE
    write_atomic(hostfile, "".join(f"{host} slots={launch.gpus}\n" for host in used))
    addr = master_addr(launch, used[0])
    # Rank 0 runs on the first node, whose ports cannot be seen from here: the default is not probed.
    port = DEFAULT_MASTER_PORT if launch.master_port is None else launch.master_port
    handoff = {
        "env": forwarded_environment(dict(os.environ), forward_names(launch)),
        "path": str(Path(sys.executable).parent),  # the venv's bin: its tools (ninja) before the node's
        "nodes": used,
        "processes_per_node": launch.gpus,
        "master_addr": addr,
        "master_port": port,
    }
    env_file = folder / ENV_FILE
    env_file.unlink(missing_ok=True)
    shutil.rmtree(folder / WORKERS_DIR, ignore_errors=True)  # an earlier launch's workers
    descriptor = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump(handoff, out, indent=2)
    try:
        yield LaunchFiles(hostfile=hostfile, env_file=env_file, master_addr=addr, master_port=port)
    finally:
        env_file.unlink(missing_ok=True)
        shutil.rmtree(folder / WORKERS_DIR, ignore_errors=True)


def runner_args(launch: LaunchConfig) -> list[str]:
    """--launcher_args for DeepSpeed's runner: the user's, plus what mpirun needs to run as root
    (OpenMPI refuses root unless told; a container's user is often root)."""
    args = shlex.split(launch.launcher_args or "")
    if launch.launcher == "openmpi" and os.geteuid() == 0 and "--allow-run-as-root" not in args:
        args.append("--allow-run-as-root")
    return [f"--launcher_args={shlex.join(args)}"] if args else []  # one token: it may start with --


# ---------------------------------------------------------------- stopping the workers on the nodes

_ERE_SPECIAL = re.compile(r"([.\[\]()*+?{}|^$\\])")


def stop_workers(hosts: list[str], worker_command: list[str], launch_dir: Path) -> None:
    """SIGTERM to this launch's workers on every node, over ssh, as a preemption of the launching
    process asks for. Signalling the runner instead would end its ssh sessions, and with them the
    workers (SIGHUP) before they save; this way the sessions stay open, every worker finishes its step,
    all save together and exit 0, and the runner sees them end as after the last step.

    Each worker is signalled by the pid it registered (`register_worker`), whatever path its interpreter
    was started by (a venv behind a symlink gives the workers another command line than this one's);
    a pid is signalled only while it is still an llmtrain process. A worker not registered yet is found
    by its command line, the interpreter first (which no ssh client's or shell's is), so nothing else on
    a node matches. The ssh calls run in the background."""
    pattern = "^" + _ERE_SPECIAL.sub(r"\\\1", " ".join(worker_command)) + "$"
    registered = _registered_pids(launch_dir / WORKERS_DIR)
    for host in hosts:
        pids = " ".join(str(pid) for pid in registered.get(host, []))
        by_pid = (
            f"for p in {pids}; do grep -qa llmtrain /proc/$p/cmdline 2>/dev/null && kill -TERM $p; done; "
            if pids
            else ""
        )
        subprocess.Popen(
            ["ssh", "-o", "BatchMode=yes", host, f"{by_pid}pkill -TERM -f -- {shlex.quote(pattern)}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def _registered_pids(folder: Path) -> dict[str, list[int]]:
    """node -> the pids its workers registered."""
    found: dict[str, list[int]] = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            entry = json.loads(path.read_text())
            found.setdefault(str(entry["node"]), []).append(int(entry["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours: its worker is found by its command line
    return found


def register_worker(launch_dir: Path, rank: int, node: str) -> None:
    """This worker's node and pid, for `stop_workers` (RUN_DIR is on a filesystem every node shares)."""
    folder = launch_dir / WORKERS_DIR
    folder.mkdir(exist_ok=True)
    write_atomic(folder / f"rank-{rank}.json", json.dumps({"node": node, "pid": os.getpid()}))


# ---------------------------------------------------------------- in each worker, first thing

# An MPI's own names for rank, world size, local rank and local size (OpenMPI, MPICH/Intel MPI, MVAPICH).
_MPI_RANK_VARIABLES = (
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)


def adopt_launch_environment(env_file: Path) -> None:
    """Apply the launch's env.json to this worker (before torch or DeepSpeed is imported)."""
    try:
        handoff = json.loads(env_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{env_file}: cannot read the launch's environment ({exc}); start the run again"
        ) from None
    os.environ.update(handoff["env"])
    os.environ["PATH"] = f"{handoff['path']}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
    if "RANK" not in os.environ:
        _adopt_mpi_rank(handoff)
    rank, per_node = int(os.environ.get("RANK", "0")), int(handoff["processes_per_node"])
    nodes = handoff["nodes"]
    os.environ[NODE_ENV] = nodes[min(rank // per_node, len(nodes) - 1)]
    register_worker(env_file.parent, rank, os.environ[NODE_ENV])


def _adopt_mpi_rank(handoff: dict) -> None:
    """Under mpirun: torch's env:// rendezvous variables from the MPI's, rank 0's address from the launch."""
    for rank, size, local_rank, local_size in _MPI_RANK_VARIABLES:
        if rank in os.environ:
            os.environ.update(
                RANK=os.environ[rank],
                WORLD_SIZE=os.environ[size],
                LOCAL_RANK=os.environ.get(local_rank, "0"),
                LOCAL_WORLD_SIZE=os.environ.get(local_size, str(handoff["processes_per_node"])),
            )
            os.environ.setdefault("MASTER_ADDR", handoff["master_addr"])
            os.environ.setdefault("MASTER_PORT", str(handoff["master_port"]))
            return
