"""Training runs through the real entry point, side by side, and what the export tests read from them:
shared by the tests of export from tensor-, sequence- and pipeline-parallel checkpoints."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from dist import free_port

from llmtrain import cli
from llmtrain.checkpoint import consolidated_fp32_state_dict

TIMEOUT_S = 240


def start(base: Path, name: str, args: list[str]) -> subprocess.Popen[bytes]:
    """`llmtrain train ARGS --run-dir base/name` in the background, one thread per process."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "llmtrain", "train", *args]
    cmd += ["--run-dir", str(base / name), "--master-port", str(free_port())]
    with open(base / f"{name}.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(base: Path, name: str, proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # The launcher starts its workers in sessions of their own: end the whole tree, not a group.
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
    tail = (base / f"{name}.log").read_text(errors="replace")[-3000:]
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{tail}"


def consolidated(run_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32's progress lines
        return consolidated_fp32_state_dict(run_dir / "checkpoints", tag)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A verb in this process; its stdout (exit code 0 asserted)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out
