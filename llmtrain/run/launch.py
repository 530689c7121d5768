"""Start a prepared run's workers: here, or under DeepSpeed's launcher; forward signals to them.

`llmtrain train --gpus 2` (not inside a launcher) is prepared and frozen in RUN_DIR/config.yaml by
run.prepare; this module then runs `deepspeed --num_gpus 2 ... --module llmtrain worker RUN_DIR` so
every worker trains from that same frozen config. Inside a launcher (RANK / WORLD_SIZE set by deepspeed,
torchrun or Slurm) the process trains directly. DeepSpeed's launcher runs in its own session: SIGINT /
SIGTERM reach this process only, which passes SIGTERM to the workers themselves, so they finish the
step, save and exit 0 (DeepSpeed's launch.py would kill them after 30 s and exit 1). When this process
dies without a word (SIGKILL), the workers notice and end at once (run.orphans), and DeepSpeed's
launcher with them.

The master port of a launch on this machine is checked first: one asked for (`--master-port N`) and
already in use is refused in one line; the default, 29500, when in use is replaced by a free port.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from llmtrain import rundir
from llmtrain.config import LaunchConfig, TrainConfig, flag_for
from llmtrain.errors import EXIT_BAD_INPUT, BadInput
from llmtrain.parallel import ports
from llmtrain.parallel.accelerator import select_accelerator
from llmtrain.parallel.node import inside_launcher
from llmtrain.quiet import debug_requested
from llmtrain.run import nodes, orphans
from llmtrain.run.nodes import DEFAULT_MASTER_PORT
from llmtrain.run.prepare import PreparedRun, freeze, read_hostfile
from llmtrain.train import stopping


def needs_relaunch(cfg: TrainConfig) -> bool:
    return cfg.world_size > 1 and not inside_launcher()


def deepspeed_command(
    cfg: TrainConfig, worker_args: list[str], files: nodes.LaunchFiles | None, master_port: int
) -> list[str]:
    """DeepSpeed's runner for this run: on this machine, or on the nodes of `files` (a hostfile launch)."""
    launch = cfg.launch
    runner = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    cmd = [runner, "--master_port", str(master_port)]
    if files is not None:
        # The hostfile lists exactly the nodes and slots used: the MPI runners refuse --num_nodes/--num_gpus.
        cmd += ["--hostfile", str(files.hostfile), "--launcher", launch.launcher]
        cmd += ["--master_addr", files.master_addr, *nodes.runner_args(launch)]
    else:
        # No hostfile: single node on this machine (DeepSpeed refuses --num_nodes > 1 without one).
        cmd += ["--num_gpus", str(launch.gpus), "--hostfile", os.devnull]
    # DeepSpeed's runner and launch.py log every spawn (INFO) and our /dev/null hostfile (WARNING);
    # a failing worker is still reported (ERROR). --debug (LLMTRAIN_DEBUG) brings the rest back.
    cmd += ["--log_level", "info" if debug_requested() else "error"]
    return [*cmd, "--no_local_rank", "--module", "llmtrain", *worker_args]


def quiet_worker_output() -> None:
    """Machine-readable worker output; before anything imports DeepSpeed. The accelerator is named
    (DeepSpeed guessing it at import warns that it did); DeepSpeed's logger keeps its level, WARNING;
    the FutureWarning from DeepSpeed's use of deprecated torch collectives on every step is ignored.
    With --debug: DeepSpeed's logger at INFO and every warning shown."""
    select_accelerator()
    if debug_requested():
        from deepspeed.utils import set_log_level_from_string

        set_log_level_from_string("info")
        return
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )


def relaunch(cfg: TrainConfig, run_dir: Path, resume: bool) -> int:
    """Run the workers under DeepSpeed's launcher; returns its exit code."""
    args = worker_args(run_dir, resume)
    if cfg.launch.hostfile is None:
        port = local_master_port(cfg.launch)
        with orphans.named_as_launcher():
            return _run_runner(deepspeed_command(cfg, args, None, port))
    hosts = read_hostfile(cfg.launch.hostfile)
    with orphans.named_as_launcher(), nodes.launch_files(cfg.launch, hosts, run_dir) as files:
        args = [*args, "--launch-env", str(files.env_file)]
        stop: Callable[[], None] | None = None
        if cfg.launch.launcher in nodes.SSH_RUNNERS:
            used = list(hosts)[: cfg.launch.nodes]
            stop = functools.partial(
                nodes.stop_workers,
                used,
                [sys.executable, "-u", "-m", "llmtrain", *args],
                files.env_file.parent,
            )
        return _run_runner(deepspeed_command(cfg, args, files, files.master_port), stop)


def _run_runner(cmd: list[str], stop_remote: Callable[[], None] | None = None) -> int:
    # DeepSpeed's runner imports DeepSpeed, as do the launch.py and workers it starts on this machine:
    # with the accelerator named, none of them guesses it and warns that it did (a hostfile's nodes
    # choose their own).
    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_ACCELERATOR=select_accelerator())
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=orphans.parent_death_signal())
    forward = _SignalForwarder(proc.pid, stop_remote)
    try:
        return proc.wait()
    finally:
        forward.restore()


class _SignalForwarder:
    """SIGINT / SIGTERM -> SIGTERM to the worker processes, leaving the launcher to see them exit 0:
    here, or on the nodes of a hostfile launch through `stop_remote`."""

    def __init__(self, launcher_pid: int, stop_remote: Callable[[], None] | None) -> None:
        self.launcher_pid, self.stop_remote = launcher_pid, stop_remote
        self.previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_remote is not None:
            self.stop_remote()
            return
        import psutil

        try:
            children = psutil.Process(self.launcher_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        workers = [c for c in children if _is_worker(c)]
        for proc in workers or children:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _is_worker(proc: object) -> bool:
    try:
        cmdline = proc.cmdline()  # type: ignore[attr-defined]
    except Exception:
        return False
    return "llmtrain" in cmdline and "deepspeed.launcher.launch" not in " ".join(cmdline)


# ---------------------------------------------------------------- the master port


class PortInUse(BadInput):
    """The master port asked for is taken (exit code 2)."""


def local_master_port(launch: LaunchConfig) -> int:
    """The port rank 0 listens on, for a launch on this machine. A port in use would fail every rank at
    start with torch's EADDRINUSE traceback: one asked for (even 29500) is refused in one line, before
    anything starts; with none asked for, 29500 gives way to a free one when taken, which no other process
    needs to know on a single node."""
    port = launch.master_port
    if port is None:
        return DEFAULT_MASTER_PORT if not ports.in_use(DEFAULT_MASTER_PORT) else ports.free_port()
    if not ports.in_use(port):
        return port
    holder = _listener(port)
    by = f" (by pid {holder})" if holder is not None else ""
    flag = flag_for("launch.master_port")
    raise PortInUse(f"{flag} {port} is in use{by}; pick another or omit it to use a free one")


def _listener(port: int) -> int | None:
    """The pid listening on `port`, when this user may see it."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    return None


# ---------------------------------------------------------------- running a prepared run


def start(prepared: PreparedRun) -> int:
    """Freeze the prepared run and train it: here when this process is a worker (one process, or a rank
    of an outside launcher), else in workers under DeepSpeed's launcher. Returns the exit code. A run
    refused for bad input (here, or by the workers: exit 2) leaves the run directory as it found it."""
    undo_freeze = freeze(prepared)
    try:
        if not needs_relaunch(prepared.cfg):
            return train_here(prepared.cfg, prepared.run_dir, prepared.resume)
        code = relaunch(prepared.cfg, prepared.run_dir, prepared.resume)
    except BadInput:
        _undo(prepared, undo_freeze)
        raise
    if code == EXIT_BAD_INPUT:  # the workers rejected their input and said why
        _undo(prepared, undo_freeze)
    return code


def worker_args(run_dir: Path, resume: bool) -> list[str]:
    """The hidden `llmtrain worker` verb: train from the frozen RUN_DIR/config.yaml."""
    return ["worker", str(run_dir), *(["--resume"] if resume else [])]


def train_here(cfg: TrainConfig, run_dir: Path, resume: bool) -> int:
    stopping.listen()  # before the imports: a stop request while the run starts is kept
    orphans.watch_launcher()  # a worker of `llmtrain train --gpus N`: ends if that command dies
    quiet_worker_output()  # before the trainer's imports bring in DeepSpeed
    from llmtrain.train import trainer

    summary = trainer.run(cfg, run_dir, resume=resume)
    return 0 if summary is not None else 1


def _undo(prepared: PreparedRun, undo_freeze: Callable[[], None]) -> None:
    """Remove the run directory if this command created it (and it holds no checkpoint); else put back
    the config.yaml that freeze replaced (e.g. a `resume --strict` refused for a damaged checkpoint)."""
    if prepared.new_dir and not rundir.has_checkpoints(prepared.run_dir):
        shutil.rmtree(prepared.run_dir, ignore_errors=True)
    else:
        undo_freeze()
