"""A killed launch leaves nothing running and nothing behind.

- SIGKILL of the `llmtrain train --gpus 2` command alone (DeepSpeed's runner, its launch.py and the
  workers run in a session of their own, so a kill of the command's process group reaches no further):
  every process of the run is gone within seconds (llmtrain.run.orphans), and the next run on the same
  --master-port starts and trains.
- DeepSpeed's shared-memory all-reduce buffers: a run's start removes those no live process holds open
  or maps, and keeps the others (llmtrain.parallel.shm).
- A --master-port in use (29500 too, when typed) is refused in one line before anything starts; without
  one, 29500 when in use gives way to a free port (llmtrain.run.launch), drawn below the kernel's
  ephemeral range (llmtrain.parallel.ports).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from dist import free_port
from runkit import BASE_FLAGS, last_logged_step, run_env, run_ok, shm_buffers, start, train_args, wait_for

from llmtrain import cli
from llmtrain.config import LaunchConfig
from llmtrain.parallel import ports, shm
from llmtrain.run import launch, orphans

RUN_TIMEOUT = 300  # generous: cold starts of DeepSpeed on a busy 2-core machine
GONE_WITHIN_S = 15.0  # the workers end at once; DeepSpeed's launch.py looks at them once a second


# ---------------------------------------------------------------- holders of fake buffers

HOLD_OPEN = "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); print(flush=True); time.sleep(600)"
# Maps the file and closes the descriptor: held by the mapping alone.
HOLD_MAPPED = (
    "import mmap, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); m = mmap.mmap(fd, 4096); "
    "os.close(fd); print(flush=True); time.sleep(600)"
)


def _fake_buffer(folder: Path, tag: str) -> Path:
    """A file named as DeepSpeed names its buffers, for this user and an address no run uses."""
    path = folder / f"{shm.BUFFER_PREFIX}_{os.getuid()}_sweeptest-{os.getpid()}_{tag}_0"
    path.write_bytes(b"\0" * 4096)
    return path


@contextlib.contextmanager
def _holder(code: str, path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A live process holding `path` (by `code`), until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"  # holding it now
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _dead_run_buffer(folder: Path) -> Path:
    """A buffer whose holder was SIGKILLed, as a killed run's are."""
    path = _fake_buffer(folder, "dead")
    with _holder(HOLD_OPEN, path):
        pass
    return path


@pytest.fixture
def shm_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder on /dev/shm's tmpfs, where the buffers live (the maps' device and inode numbers are the
    file's own there; an overlay filesystem's are not), else on the test's tmp_path."""
    if not shm.SHM_DIR.is_dir():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(dir=shm.SHM_DIR, prefix="llmtrain-test-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_sweep_removes_buffers_no_live_process_holds_and_keeps_the_others(shm_folder: Path) -> None:
    dead = _dead_run_buffer(shm_folder)
    held_open, mapped = _fake_buffer(shm_folder, "open"), _fake_buffer(shm_folder, "mapped")
    another_users = shm_folder / f"{shm.BUFFER_PREFIX}_{os.getuid() + 1}_x_1_0"
    another_users.write_bytes(b"")
    with _holder(HOLD_OPEN, held_open), _holder(HOLD_MAPPED, mapped):
        assert shm.sweep_dead_buffers(shm_folder) == [dead]
        assert held_open.exists() and mapped.exists() and another_users.exists()
    assert sorted(shm.sweep_dead_buffers(shm_folder)) == sorted([held_open, mapped])  # their holders gone


# ---------------------------------------------------------------- the watch on the launching command

# A stand-in for `llmtrain train --gpus 2` (argv[1]: the worker's code) that starts one "worker" in a
# session of its own, as DeepSpeed's runner is, prints its pid and waits. The worker shares its stdout.
COMMAND = (
    "import subprocess, sys, time\n"
    "from llmtrain.run import orphans\n"
    "with orphans.named_as_launcher():\n"
    "    worker = subprocess.Popen([sys.executable, '-u', '-c', sys.argv[1]], start_new_session=True)\n"
    "print(worker.pid, flush=True)\n"
    "time.sleep(600)\n"
)
WORKER = "import time; from llmtrain.run import orphans; orphans.watch_launcher(); print(); time.sleep(600)"


def test_a_worker_ends_at_once_when_its_launching_command_is_sigkilled() -> None:
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND, WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert command.stdout is not None and command.stderr is not None
    lines = [command.stdout.readline().strip(), command.stdout.readline().strip()]  # its pid; watching
    worker = psutil.Process(int(b"".join(lines)))
    command.kill()
    command.wait()
    _, alive = psutil.wait_procs([worker], timeout=5)
    for proc in alive:
        proc.kill()
    assert alive == []
    assert b"has died; its workers stop without saving" in command.stderr.read()


def test_a_launcher_on_another_machine_is_not_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    with orphans.named_as_launcher():
        assert orphans._launcher_here() == (os.getpid(), orphans._start_mark(os.getpid()))
        named = json.loads(os.environ[orphans.LAUNCHER_ENV])
    monkeypatch.setenv(orphans.LAUNCHER_ENV, json.dumps({**named, "machine": "another-boot/pid:[1]"}))
    assert orphans._launcher_here() is None  # its pid names some other process here


# ---------------------------------------------------------------- the master port


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def test_a_master_port_in_use_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path, taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    args = ["train", *BASE_FLAGS, "--steps", "2", "--run-dir", str(run_dir), "--gpus", "2"]
    assert cli.main([*args, "--master-port", str(taken_port)]) == 2
    expected = (
        f"error: --master-port {taken_port} is in use (by pid {os.getpid()}); "
        "pick another or omit it to use a free one"
    )
    assert capsys.readouterr().err.splitlines() == [expected]
    assert not run_dir.exists()  # the refused run left nothing
    assert orphans.LAUNCHER_ENV not in os.environ  # this process is not left named a launcher


def test_the_default_master_port_in_use_gives_way_to_a_free_one(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch, "DEFAULT_MASTER_PORT", taken_port)  # 29500 may be another run's
    chosen = launch.local_master_port(LaunchConfig())  # no --master-port
    assert chosen != taken_port
    with socket.socket() as probe:
        probe.bind(("", chosen))


def test_the_default_port_typed_and_in_use_is_refused_not_swapped(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch, "DEFAULT_MASTER_PORT", taken_port)
    with pytest.raises(launch.PortInUse, match=f"--master-port {taken_port} is in use"):
        launch.local_master_port(LaunchConfig(master_port=taken_port))  # --master-port 29500, typed


def test_a_free_port_is_drawn_below_the_ephemeral_range_so_no_outgoing_connection_takes_it(
    taken_port: int,
) -> None:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    drawn = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST <= port < first_ephemeral for port in drawn), drawn
    assert len(drawn) > 1  # drawn at random: two runs started side by side must not collide
    assert not any(ports.in_use(port) for port in drawn)
    assert ports.in_use(taken_port)


def test_a_free_port_comes_from_the_kernel_when_its_ephemeral_range_leaves_no_room_below(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", wide)
    port = ports.free_port()
    assert port >= 1024 and not ports.in_use(port)


# ---------------------------------------------------------------- SIGKILL of the command alone


def _run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names `run_dir`: the command, DeepSpeed's runner and
    launch.py (which carry the workers' arguments) and the workers."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(run_dir) in arg for arg in proc.info["cmdline"] or []) and _running(proc):
                found.append(proc)
    return found


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's, which a container's init may never reap)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _on_port(args: list[str], port: int) -> list[str]:
    args = list(args)
    args[args.index("--master-port") + 1] = str(port)
    return args


@pytest.mark.slow
def test_a_sigkilled_command_takes_its_workers_with_it_and_the_next_run_starts(tmp_path: Path) -> None:
    # Measured on a shared 2-core machine: 70-95 s, nearly all of it the two cold starts of a 2-process
    # run; every process of the killed run was gone 1.4-4 s after the SIGKILL.
    killed_dir, next_dir, port = tmp_path / "killed", tmp_path / "next", free_port()
    run = start(
        _on_port(train_args(killed_dir, 10_000, 10_000, "--no-compile"), port),
        tmp_path / "killed.log",
        run_env(),
    )
    wait_for(lambda: last_logged_step(killed_dir) >= 1, RUN_TIMEOUT, "the first step")
    assert sorted(run.workers()) == [0, 1] and len(shm_buffers(["--master-port", str(port)])) == 2

    tree = [psutil.Process(run.proc.pid), *psutil.Process(run.proc.pid).children(recursive=True)]
    assert len(_run_processes(killed_dir)) >= 5  # the command, the runner, launch.py, two workers

    os.kill(run.proc.pid, signal.SIGKILL)  # the command alone, as `kill -9 -PGID` of its group reaches it
    killed_at = time.monotonic()
    run.proc.wait()
    gone = lambda: not any(map(_running, tree)) and _run_processes(killed_dir) == []  # noqa: E731
    gone_at = wait_for(gone, GONE_WITHIN_S, "every process of the run to end")
    print(f"every process of the run gone {gone_at - killed_at:.1f}s after the SIGKILL")
    assert "has died; its workers stop without saving" in run.output()
    assert shm_buffers(["--master-port", str(port)]) == []  # each worker removed its buffer's name

    # A killed run's buffers outlive it (SIGKILL of everything): the next start sweeps them, and keeps
    # a live run's.
    dead = _dead_run_buffer(shm.SHM_DIR)
    live = _fake_buffer(shm.SHM_DIR, "live")
    try:
        with _holder(HOLD_OPEN, live):
            output = run_ok(_on_port(train_args(next_dir, 2, 2), port), tmp_path / "next.log", RUN_TIMEOUT)
            assert "step 2/2" in output and "EADDRINUSE" not in output
            assert not dead.exists() and live.exists()
    finally:
        dead.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
    assert shm_buffers(["--master-port", str(port)]) == []  # neither run's left
