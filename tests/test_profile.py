"""`llmtrain train --profile START:STEPS` through the real entry point, on a single process.

One module fixture starts two debug-preset runs together (one thread each): the same 8 steps with
`--profile 5:2` and without. The profiled run's trace holds exactly steps 5 and 6, its stdout names the
top operators, and its losses are the plain run's, bit for bit. On a GPU (`pytest -m gpu`), the trace
also holds CUDA kernels and the memory snapshot loads.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrain.config import resolve
from llmtrain.run.prepare import refuse_breaking_changes
from llmtrain.train.metrics import METRICS_FILE, read_metrics

ARGS = [
    "train", "--preset", "debug", "--steps", "8", "--micro-batch", "2", "--seq-len", "32", "--log-every", "1",
]  # fmt: skip
WINDOW = ["--profile", "5:2"]


@dataclass
class Finished:
    run_dir: Path
    stdout: str


def _start(run_dir: Path, extra: list[str], accelerator: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, DS_ACCELERATOR=accelerator, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LLMTRAIN_FAULTS", None)
    cmd = [sys.executable, "-m", "llmtrain", *ARGS, *extra, "--run-dir", str(run_dir)]
    with open(f"{run_dir}.out", "wb") as out, open(f"{run_dir}.err", "wb") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env)


def _finish(proc: subprocess.Popen[bytes], run_dir: Path) -> Finished:
    code = proc.wait(timeout=300)
    stdout, stderr = Path(f"{run_dir}.out").read_text(), Path(f"{run_dir}.err").read_text()
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return Finished(run_dir, stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Finished]:
    root = tmp_path_factory.mktemp("profile")
    started = {
        "profiled": _start(root / "profiled", WINDOW, "cpu"),
        "plain": _start(root / "plain", [], "cpu"),
    }
    return {name: _finish(proc, root / name) for name, proc in started.items()}


def _trace(run_dir: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads((run_dir / "profile" / "rank0.json").read_text())["traceEvents"]
    return events


def _ranges_inside(events: list[dict[str, Any]], step: dict[str, Any]) -> list[str]:
    """The operators and annotated ranges (e.g. the optimizer's step) that begin within `step`."""
    start, end = step["ts"], step["ts"] + step["dur"]
    kinds = ("cpu_op", "user_annotation")
    return [e["name"] for e in events if e.get("cat") in kinds and start <= e["ts"] <= end]


def test_the_trace_holds_steps_5_and_6_and_their_operators(runs: dict[str, Finished]) -> None:
    run_dir = runs["profiled"].run_dir
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["rank0.json"]  # no snapshot on CPU
    events = _trace(run_dir)
    steps = {e["name"]: e for e in events if e["name"].startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#5", "ProfilerStep#6"]  # neither step 4 nor step 7
    for step in steps.values():
        ops = _ranges_inside(events, step)
        assert "aten::mm" in ops and "Optimizer.step#AdamW.step" in ops  # forward, backward and update


def test_rank_0_prints_the_top_operators_and_the_trace_path(runs: dict[str, Finished]) -> None:
    run = runs["profiled"]
    lines = run.stdout.splitlines()
    head = lines.index("profile of steps 5-6, rank 0: top operators by self CPU time")
    rows = lines[head + 4 : head + 19]  # the table's 15 rows, after its rules and column names
    names = [row.split()[0] for row in rows]
    assert "aten::mm" in names and all("%" in row for row in rows)
    trace = run.run_dir / "profile" / "rank0.json"
    assert f"profile trace: {trace} (one per rank; open in https://ui.perfetto.dev)" in lines
    assert "profile of" not in runs["plain"].stdout


def test_profiling_leaves_the_losses_unchanged(runs: dict[str, Finished]) -> None:
    def losses(run: Finished) -> list[float]:
        return [r["loss"] for r in read_metrics(run.run_dir / METRICS_FILE) if "loss" in r]

    assert len(losses(runs["plain"])) == 8
    assert losses(runs["profiled"]) == losses(runs["plain"])


def test_a_resume_may_change_the_profile_window() -> None:
    saved = resolve(flags={"preset": "debug", "train.steps": "8"})
    refuse_breaking_changes(
        saved, resolve(flags={"preset": "debug", "train.steps": "8", "logging.profile": "3:2"}), Path("run")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_trace_holds_kernels_and_the_memory_snapshot_loads(tmp_path: Path) -> None:
    run = _finish(_start(tmp_path / "run", WINDOW, "cuda"), tmp_path / "run")
    assert "top operators by self CUDA time" in run.stdout
    assert any(e.get("cat") == "kernel" for e in _trace(run.run_dir))
    snapshot = pickle.loads((run.run_dir / "profile" / "memory_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]  # what pytorch.org/memory_viz reads
