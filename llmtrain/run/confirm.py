"""`llmtrain plan --confirm K`: the top K layouts run for a few steps on this machine, each a real
`llmtrain train` of the row's own command line, and their measured step times beside the predicted.

Each run logs every step; its step time is the median, over the steps after the first two (start-up:
the first step builds buffers and warms caches), of the tokens of one step over the step's tokens/s.
On a GPU the run also logs the most memory any rank's tensors held (`peak_memory_bytes`), measured
beside the estimator's peak; a CPU has no allocator peak to read.
The runs go into a scratch directory that is removed afterwards, one after another (they would share
the machine's cores otherwise).
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.errors import RunFailure
from llmtrain.train.metrics import METRICS_FILE, read_metrics

WARM_UP_STEPS = 2
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Measured:
    step_seconds: float
    peak_memory_bytes: int | None  # None on a CPU


def confirm(rows: list[dict[str, Any]], steps: int, tokens_per_step: int) -> list[Measured]:
    """What each row (a `report.document` row) measured, in order."""
    with tempfile.TemporaryDirectory(prefix="llmtrain-confirm-") as scratch:
        return [_measure(row["command"], Path(scratch) / f"layout-{i}", steps, tokens_per_step)
                for i, row in enumerate(rows)]  # fmt: skip


def _measure(command: str, run_dir: Path, steps: int, tokens_per_step: int) -> Measured:
    words = shlex.split(command)[2:]  # the row's flags, after `llmtrain train`
    never = str(steps * 1000)  # no evaluation or checkpoint inside the measured steps
    cmd = [sys.executable, "-m", "llmtrain", "train", *words, "--steps", str(steps), "--run-dir", str(run_dir),
           "--log-every", "1", "--eval-every", never, "--save-every", never, "--no-compile"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=os.environ.copy())
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RunFailure(f"--confirm: `{shlex.join(['llmtrain', 'train', *words])}` failed: {last}")
    records = read_metrics(run_dir / METRICS_FILE)
    rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r and r["step"] > WARM_UP_STEPS]
    if not rates:
        raise RunFailure(f"--confirm: the run of `{command}` logged no step after the first {WARM_UP_STEPS}")
    peaks = [r["peak_memory_bytes"] for r in records if r.get("peak_memory_bytes") is not None]
    return Measured(tokens_per_step / statistics.median(rates), max(peaks) if peaks else None)
