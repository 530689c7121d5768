"""One small real training run, made once per test session and shared by the tests that read one.

`llmtrain train` runs as a subprocess through the real entry point: debug preset, ZeRO 2, fp32, world
size 1, 12 steps with a checkpoint and a validation loss every 6 steps. What it printed (stdout and
stderr, as a user whose output is not a terminal sees it) is kept beside the run directory
(`train_log`), so tests can read a real `train` output without training again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS, EVERY, SEQ_LEN, MICRO_BATCH = 12, 6, 64, 4
TRAIN_FLAGS = [
    "--preset",
    "debug",
    "--steps",
    str(STEPS),
    "--micro-batch",
    str(MICRO_BATCH),
    "--seq-len",
    str(SEQ_LEN),
    "--zero",
    "2",
    "--precision",
    "fp32",
    "--eval-every",
    str(EVERY),
    "--save-every",
    str(EVERY),
    "--log-every",
    "3",
    "--lr",
    "3e-3",
]


def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory (trained on the first call of the session, reused afterwards)."""
    run_dir = tmp_path_factory.getbasetemp() / "shared-debug-run"
    done = run_dir / ".trained"
    if done.is_file():
        return run_dir
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "llmtrain", "train", *TRAIN_FLAGS, "--run-dir", str(run_dir)]
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    train_log(run_dir).write_text(proc.stdout)
    done.write_text("ok\n")
    return run_dir


def train_log(run_dir: Path) -> Path:
    """Where the shared run's `train` output is kept: beside the run directory, not inside it."""
    return run_dir.with_name(run_dir.name + ".log")
