"""Run the real `llmtrain` entry point in subprocesses, kill parts of it, read what it left behind.

Shared by the fault, security, resume and soak tests. Every run uses the debug preset, fp32 and one thread
per process, so two runs of the same configuration produce bitwise-equal losses and weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from dist import free_port

# Small and exact: fp32 (bitwise-comparable), ZeRO-1 (optimizer state sharded across the two ranks).
BASE_FLAGS = [
    "--preset",
    "debug",
    "--micro-batch",
    "2",
    "--seq-len",
    "32",
    "--log-every",
    "1",
    "--zero",
    "1",
    "--precision",
    "fp32",
]


def run_env(faults: str = "", **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",  # same thread count under every launcher: same reduction order, same bits
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="offline",
        LLMTRAIN_FAULTS=faults,
    )
    env.update(extra)
    return env


@dataclass
class Run:
    """A started `llmtrain` command; stdout and stderr go to one log file."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise AssertionError(
                f"still running after {timeout:.0f}s; output:\n{self.output()[-4000:]}"
            ) from None
        return code, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[int, psutil.Process]:
        """rank -> worker process (a python running llmtrain with RANK set), under this command."""
        found: dict[int, psutil.Process] = {}
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return found
        for child in children:
            try:
                cmdline, env = child.cmdline(), child.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "llmtrain" in cmdline and "RANK" in env and "deepspeed.launcher.launch" not in cmdline:
                found[int(env["RANK"])] = child
        return found


def start(args: list[str], log: Path, env: dict[str, str], launcher: list[str] | None = None) -> Run:
    """`python -m llmtrain ARGS` (or `LAUNCHER ... -m llmtrain ARGS`) in its own session."""
    cmd = [*(launcher or [sys.executable]), "-m", "llmtrain", *args]
    out = open(log, "ab")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    out.close()
    return Run(proc, log, time.monotonic())


def train_args(run_dir: Path, steps: int, save_every: int, *extra: str, gpus: int = 2) -> list[str]:
    return [
        "train",
        *BASE_FLAGS,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--run-dir",
        str(run_dir),
        "--gpus",
        str(gpus),
        "--master-port",
        str(free_port()),
        *extra,
    ]


def resume_args(run_dir: Path, *extra: str) -> list[str]:
    return ["resume", str(run_dir), "--master-port", str(free_port()), *extra]


def kill_tree(pid: int, sig: int = signal.SIGKILL, wait_s: float = 0.0) -> None:
    """Signal a process and everything under it. The launchers start new sessions, so each process
    group seen is signalled as a whole too: a worker spawned while we look is in one of them. With
    `wait_s`, waits up to that long for every process signalled to be gone."""
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    groups = set()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(proc.pid))
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
    for group in groups - {os.getpgid(0)}:  # never our own group (pytest's)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    if wait_s:
        psutil.wait_procs(procs, timeout=wait_s)


def wait_for(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> float:
    """Poll until `condition()`; returns the monotonic time it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def metrics(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return records


def losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in metrics(run_dir) if "loss" in r}  # type: ignore[arg-type]


def last_logged_step(run_dir: Path) -> int:
    return max(losses(run_dir), default=0)


def latest(run_dir: Path) -> str | None:
    path = run_dir / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else None


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


# All llmtrain prints before its first progress line (`step N/M ...`): nothing on a fresh start, else
# its own warnings (`warning: ...`: a lock taken over, a checkpoint passed over) and a wait for the run
# directory's lock (`waiting up to N s for ...`).
OWN_START_LINE = re.compile(r"^(warning: |waiting up to \d)")


def start_lines(output: str) -> list[str]:
    """The lines before the first progress line (all of them when there is none)."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("step ")), len(lines))
    return lines[:first]


def foreign_lines(lines: list[str], *allowed_prefixes: str) -> list[str]:
    """The lines llmtrain did not print (DeepSpeed's reports, banners, log records), less those starting
    with `allowed_prefixes` (another program's that the run asked for, e.g. `wandb: `)."""
    return [
        line for line in lines if not OWN_START_LINE.match(line) and not line.startswith(allowed_prefixes)
    ]


class Payload:
    """A pickle that runs `touch MARKER` when loaded with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def rewrite_manifest_entry(ckpt_dir: Path, rel: str) -> None:
    """Make the manifest agree with a replaced file, as an attacker who controls the files would."""
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    data = (ckpt_dir / rel).read_bytes()
    for entry in manifest["files"]:
        if entry["path"] == rel:
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------- SIGKILL mid-run, then resume

EXACT_KEYS = ("loss", "lr", "grad_norm", "tokens")


def run_ok(args: list[str], log: Path, timeout: float) -> str:
    """Run a verb to its end; its output (exit code 0 asserted)."""
    code, output = start(args, log, run_env()).wait(timeout)
    assert code == 0, output[-3000:]
    return output


def kill_after_a_checkpoint(
    args: list[str], run_dir: Path, log: Path, save_every: int, timeout: float
) -> None:
    """Start `args` (a train of `run_dir`) and SIGKILL its whole tree once a checkpoint exists and the
    run is past it, so a resume must redo steps from the checkpoint."""
    run = start(args, log, run_env())
    wait_for(
        lambda: latest(run_dir) is not None and last_logged_step(run_dir) > save_every + 1,
        timeout,
        f"step {save_every + 2}",
    )
    kill_tree(run.proc.pid, signal.SIGKILL, wait_s=30)
    run.proc.wait()


def assert_resumed_bitwise(reference: Path, resumed: Path, steps: int) -> None:
    """Every step's loss, lr, grad norm and token count of `resumed` equal the uninterrupted run's."""
    ref_records = {r["step"]: r for r in metrics(reference) if "loss" in r}
    got_records = {r["step"]: r for r in metrics(resumed) if "loss" in r}
    assert sorted(got_records) == list(range(1, steps + 1))
    for step, record in ref_records.items():
        assert {k: got_records[step][k] for k in EXACT_KEYS} == {k: record[k] for k in EXACT_KEYS}, step
    assert losses(resumed) == losses(reference)


def assert_recomputed_bitwise(
    before_kill: list[dict[str, object]], checkpoint: str, resumed: Path, steps: int
) -> None:
    """`resumed`, killed after `checkpoint` and resumed from it, logged every step to `steps`; the steps
    past the checkpoint that it logged before the kill came out the same when recomputed (loss, lr, grad
    norm, tokens). An uninterrupted run to compare with is not needed: those steps were one."""
    saved = int(re.findall(r"\d+", checkpoint)[-1])
    redone = [r for r in before_kill if "loss" in r and int(r["step"]) > saved]
    assert redone, f"no step past {checkpoint} was logged before the kill"
    got = {r["step"]: r for r in metrics(resumed) if "loss" in r}
    assert sorted(got) == list(range(1, steps + 1))
    for record in redone:
        assert {k: got[record["step"]][k] for k in EXACT_KEYS} == {k: record[k] for k in EXACT_KEYS}, record


def shm_buffers(args: list[str]) -> list[Path]:
    """DeepSpeed's shared-memory all-reduce files left by the run launched with `args` (its port)."""
    port = args[args.index("--master-port") + 1]
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
