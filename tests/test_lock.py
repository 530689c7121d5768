"""One writer per run directory: RUN_DIR/run.lock (llmtrain/run/lock.py).

In this process: a held run directory is refused naming its holder (at once, or after --lock-wait), a
lock left by a dead process is taken over with a warning, the descriptor never reaches a child process,
and a refused run leaves the directory as it found it. Through the real command line (subprocesses):
a second `train` on a live run is refused naming the first's pid before it imports torch (at once,
however loaded the machine), `resume` after a SIGKILL takes the stale lock over, and
`train --resume auto` waits for the holder and then resumes its checkpoint. The holder is made to hang
(LLMTRAIN_FAULTS) right after its first checkpoint, so it holds the lock for as long as a test needs,
with no race against its end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_resume import Cli, kill, metrics, run_cli, run_quick, wait_until

from llmtrain import rundir
from llmtrain.cli import main
from llmtrain.run import lock

HOST = socket.gethostname()
STEPS, SAVE_EVERY = 10, 5
HANG = f"hang@0:{SAVE_EVERY + 1}"  # 0-based step 6: steps 1-6 done, step 5 saved, then stuck
# Modules a refused run must never import: the refusal comes before any of them, so it is immediate.
HEAVY_MODULES = {"torch", "deepspeed", "transformers", "datasets", "numpy"}


@pytest.fixture(autouse=True)
def _not_inside_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _train(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "debug", "--steps", "2", "--run-dir", str(run_dir), *extra]


def _lock_text(run_dir: Path) -> str:
    return (run_dir / rundir.LOCK_FILE).read_text()


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# ---------------------------------------------------------------- in this process


def test_a_held_run_dir_is_refused_at_once_naming_its_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with lock.hold(run_dir, f"--run-dir {run_dir}", 0, create=True):
        held = _lock_text(run_dir)
        assert json.loads(held)["pid"] == os.getpid() and json.loads(held)["host"] == HOST
        for argv, label in [
            (_train(run_dir), f"--run-dir {run_dir}"),
            (["resume", str(run_dir)], f"resume {run_dir}"),
        ]:
            capsys.readouterr()
            assert main(argv) == 2
            lines = _stderr_lines(capsys)
            assert len(lines) == 1, lines  # the error alone: no "waiting up to" line, so no wait
            assert lines[0].startswith(
                f"error: {label}: in use by llmtrain (pid {os.getpid()} on host {HOST}, since "
            )
            assert lines[0].endswith("; wait for it to end or stop it")
        assert _lock_text(run_dir) == held  # the holder's record is untouched
        assert sorted(p.name for p in run_dir.iterdir()) == [rundir.LOCK_FILE]  # nothing else was written
    assert _lock_text(run_dir) == ""  # a clean end names no holder


def test_lock_wait_waits_then_refuses_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with lock.hold(run_dir, f"--run-dir {run_dir}", 0, create=True):
        capsys.readouterr()
        started = time.monotonic()
        assert main(_train(run_dir, "--lock-wait", "1.5")) == 2
        waited = time.monotonic() - started
    assert 1.5 <= waited < 1.5 + 10 * lock.POLL_S  # waited its time, then gave up (slack for a loaded CPU)
    waiting, error = _stderr_lines(capsys)
    assert waiting.startswith(
        f"waiting up to 1.5 s for --run-dir {run_dir}: in use by llmtrain (pid {os.getpid()} "
    )
    assert error.startswith(
        f"error: --run-dir {run_dir}: in use by llmtrain (pid {os.getpid()} on host {HOST}"
    )
    assert "after waiting 1.5 s" in error


def test_a_negative_lock_wait_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_train(tmp_path / "run", "--lock-wait", "-1")) == 2
    assert _stderr_lines(capsys) == ["error: --lock-wait: must be 0 or more seconds, got -1"]
    assert not (tmp_path / "run").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {
        "host": "node-07",
        "pid": 4242,
        "command": "llmtrain train",
        "started": "2026-01-02T03:04:05+0000",
    }
    (run_dir / rundir.LOCK_FILE).write_text(json.dumps(dead) + "\n")
    capsys.readouterr()
    with lock.hold(run_dir, f"--run-dir {run_dir}", 0, create=True):
        assert json.loads(_lock_text(run_dir))["pid"] == os.getpid()
    assert _stderr_lines(capsys) == [
        f"warning: taking over the lock of {run_dir} left by pid 4242 on host node-07 "
        "(started 2026-01-02T03:04:05+0000); that process is gone"
    ]
    with lock.hold(run_dir, f"--run-dir {run_dir}", 0, create=True):  # released cleanly: no warning
        pass
    assert _stderr_lines(capsys) == []


def test_the_lock_descriptor_is_not_inherited(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with lock.hold(run_dir, "run", 0, create=True) as held:
        assert held.fd is not None and not os.get_inheritable(held.fd)
        # Even a child told to keep every descriptor (close_fds=False) gets none of it: O_CLOEXEC.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    try:
        lock_path = str((run_dir / rundir.LOCK_FILE).resolve())
        assert lock_path not in [f.path for f in psutil.Process(child.pid).open_files()]
        # The child alive (it sleeps 60 s), the lock is free: a few seconds' wait tolerates a transient
        # holder on a loaded machine (seen once under two xdist workers) and still fails on a leaked fd.
        with lock.hold(run_dir, "run", 5, create=True) as again:
            assert again.fd is not None
    finally:
        child.kill()
        child.wait()


def test_a_refused_run_leaves_nothing_the_lock_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A new directory (and its new parent), made only to hold the lock: removed again.
    run_dir = tmp_path / "new" / "run"
    assert main(_train(run_dir, "--data", str(tmp_path / "missing.txt"))) == 2
    assert "missing.txt: file not found" in _stderr_lines(capsys)[-1]
    assert not (tmp_path / "new").exists()
    # An existing run directory whose run.lock a dead process left: every byte as it was.
    run_dir = tmp_path / "never_saved"
    run_dir.mkdir()
    (run_dir / rundir.CONFIG_FILE).write_text("train: {steps: 2}\n")
    stale = json.dumps(
        {"host": "h", "pid": 1, "command": "llmtrain train", "started": "2026-01-01T00:00:00+0000"}
    )
    (run_dir / rundir.LOCK_FILE).write_text(stale)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
    assert main(["resume", str(run_dir)]) == 2
    assert "no checkpoint to resume from" in _stderr_lines(capsys)[-1]
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()} == before


# ---------------------------------------------------------------- through the command line


def _holder(run_dir: Path, log: Path) -> Cli:
    """A `train` that saves step 5, logs step 6 and then hangs holding the lock until killed."""
    flags = [
        "--preset",
        "debug",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--log-every",
        "1",
        "--warmup-steps",
        "1",
    ]
    first = Cli(
        ["train", *flags, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--run-dir", str(run_dir)],
        log,
        faults=HANG,
    )
    step = f"step_{SAVE_EVERY:08d}"
    wait_until(
        f"{step} saved",
        first,
        lambda: (
            (run_dir / "checkpoints" / "latest").is_file() and max(metrics(run_dir), default=0) > SAVE_EVERY
        ),
    )
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == step
    return first


def _stale_warning(run_dir: Path, first: Cli) -> str:
    return f"warning: taking over the lock of {run_dir} left by pid {first.proc.pid} on host {HOST}"


@pytest.mark.slow
def test_a_second_train_is_refused_at_once_and_resume_takes_the_stale_lock_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    first = _holder(run_dir, tmp_path / "first.log")
    try:
        monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # every import, one stderr line each
        second = run_quick(["train", "--preset", "debug", "--run-dir", run_dir])
        monkeypatch.delenv("PYTHONPROFILEIMPORTTIME")
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.splitlines()
        imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
        assert "llmtrain.run.lock" in imported and not imported & HEAVY_MODULES, imported & HEAVY_MODULES
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1 and f"in use by llmtrain (pid {first.proc.pid} on host {HOST}" in errors[0], (
            errors
        )
        assert first.running()
    finally:
        kill(first)
    resumed = run_cli(["resume", run_dir], tmp_path / "resume.log")
    assert _stale_warning(run_dir, first) in resumed.text()
    assert sorted(metrics(run_dir)) == list(range(1, STEPS + 1))
    assert _lock_text(run_dir) == ""


@pytest.mark.slow
def test_resume_auto_waits_for_the_holder_then_resumes_its_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _holder(run_dir, tmp_path / "first.log")
    before = {step: r for step, r in metrics(run_dir).items() if step <= SAVE_EVERY}
    try:
        waiter = Cli(
            ["train", "--run-dir", str(run_dir), "--resume", "auto", "--lock-wait", "30"], tmp_path / "w.log"
        )
        wait_until("the waiting line", waiter, lambda: "waiting up to 30 s" in waiter.text())
        time.sleep(1.0)  # still waiting: it wrote nothing into the run directory
        assert waiter.running() and metrics(run_dir).keys() == set(range(1, SAVE_EVERY + 2))
    finally:
        kill(first)
    assert waiter.wait() == 0, waiter.tail()
    text = waiter.text()
    assert f"--run-dir {run_dir}: in use by llmtrain (pid {first.proc.pid} on host {HOST}" in text
    assert _stale_warning(run_dir, first) in text
    after = metrics(run_dir)
    assert sorted(after) == list(range(1, STEPS + 1))
    assert {step: after[step] for step in before} == before  # continued from step 5: steps 1-5 kept as logged


def _start_as_this_rank_decided(rank: int, world_size: int, run_dir: str) -> tuple[float, bool]:
    from llmtrain import config
    from llmtrain.parallel.distributed import World
    from llmtrain.train.trainer import rank_zeros_start

    # Rank 0 found a checkpoint to resume (its saved config: lr 1e-3); rank 1 found none yet and
    # prepared a fresh run from the flags (lr 5e-4).
    lr, resume = (1e-3, True) if rank == 0 else (5e-4, False)
    cfg = config.resolve(flags={"preset": "debug", "optim.lr": lr, "run_dir": run_dir})
    agreed, agreed_resume = rank_zeros_start(cfg, resume, World(rank, rank, world_size, "cpu", world_size))
    return agreed.optim.lr, agreed_resume


def test_under_an_outside_launcher_every_rank_starts_as_rank_0_decided(tmp_path: Path) -> None:
    """torchrun/srun start `train --resume auto` on every rank; only rank 0 waits for the lock, so the
    ranks' own decisions may differ: rank 0's is the one every rank follows."""
    from dist import run_distributed

    results = run_distributed(_start_as_this_rank_decided, 2, str(tmp_path / "run"), timeout=120)
    assert results == [(1e-3, True), (1e-3, True)]
