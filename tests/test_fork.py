"""`llmtrain fork`: a WSD run forked at step 20 into a cooldown over the next 10 steps.

One module fixture trains the parent (debug preset, fp32, one process, 40 steps, wsd, a checkpoint
every 20) and forks it once through the real entry point; the refusals run in-process and fail before
any training.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmtrain import cli
from llmtrain.train.metrics import METRICS_FILE, read_metrics

PEAK_LR, MIN_LR_RATIO = 3e-4, 0.1
PARENT_STEPS, FORK_STEP, COOLDOWN = 40, 20, 10
PARENT_FLAGS = [
    "--preset", "debug", "--micro-batch", "2", "--seq-len", "32", "--precision", "fp32", "--zero", "1",
    "--steps", str(PARENT_STEPS), "--save-every", "20", "--schedule", "wsd", "--warmup-steps", "4",
    "--lr", str(PEAK_LR), "--log-every", "1",
]  # fmt: skip


@dataclass
class Forked:
    parent: Path
    fork: Path
    parent_files_before: dict[str, str]
    output: str


def _checksums(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _llmtrain(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "llmtrain", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def forked(tmp_path_factory: pytest.TempPathFactory) -> Forked:
    tmp = tmp_path_factory.mktemp("fork")
    parent, fork = tmp / "parent", tmp / "cool"
    trained = _llmtrain("train", *PARENT_FLAGS, "--run-dir", str(parent))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    before = _checksums(parent)
    done = _llmtrain(
        "fork", str(parent), "--step", str(FORK_STEP), "--run-dir", str(fork),
        "--steps", str(FORK_STEP + COOLDOWN), "--set", f"schedule.decay_steps={COOLDOWN}",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Forked(parent, fork, before, done.stdout)


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / METRICS_FILE) if "loss" in r}


def test_the_cooldown_reaches_the_minimum_lr_exactly_at_its_last_step(forked: Forked) -> None:
    fork = _records(forked.fork)
    assert sorted(fork) == list(range(1, FORK_STEP + COOLDOWN + 1))
    assert fork[FORK_STEP]["lr"] == PEAK_LR  # the stable phase up to the fork
    lrs = [fork[s]["lr"] for s in range(FORK_STEP + 1, FORK_STEP + COOLDOWN + 1)]
    assert all(a > b for a, b in itertools.pairwise(lrs))  # decaying every step
    assert lrs[-1] == MIN_LR_RATIO * PEAK_LR
    assert next(line for line in forked.output.splitlines() if line.startswith("step ")).startswith(
        f"step {FORK_STEP + 1}/{FORK_STEP + COOLDOWN} "
    )


def test_the_fork_continues_the_parents_state_and_leaves_the_parent_untouched(forked: Forked) -> None:
    parent, fork = _records(forked.parent), _records(forked.fork)
    # Steps up to the fork are the parent's records; the fork's first step sees the parent's weights
    # and the batch the parent trained on next: the same loss, to the bit.
    assert [fork[s]["loss"] for s in range(1, FORK_STEP + 2)] == [
        parent[s]["loss"] for s in range(1, FORK_STEP + 2)
    ]
    assert fork[FORK_STEP + 1]["tokens"] == parent[FORK_STEP + 1]["tokens"]
    assert _checksums(forked.parent) == forked.parent_files_before
    record = json.loads((forked.fork / "fork.json").read_text())
    assert record["parent"] == str(forked.parent.resolve())
    assert (record["step"], record["checkpoint"]) == (FORK_STEP, f"step_{FORK_STEP:08d}")


NEW = "{new}"  # the fork's directory in a case's arguments


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["--step", "15", "--run-dir", NEW],
            "--step 15: {parent} has no complete checkpoint there (checkpoints at steps: 20, 40)",
        ),
        (
            ["--step", "20", "--run-dir", NEW, "--steps", "20"],
            "--steps: the fork starts after step 20 of {parent}; give more",
        ),
        (
            ["--step", "20", "--run-dir", NEW, "--set", "model.num_hidden_layers=3"],
            "model.num_hidden_layers: 2 -> 3",
        ),
        (["--step", "20", "--run-dir", "{parent}"], "is the run being forked; give the fork a directory"),
        (["--step", "20"], "give the new run's directory with --run-dir NEW"),
    ],
    ids=["no-checkpoint", "too-short", "model-change", "into-itself", "no-run-dir"],
)
def test_a_fork_that_cannot_continue_exactly_is_refused_and_writes_nothing(
    forked: Forked, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    names = {"{parent}": str(forked.parent), NEW: str(tmp_path / "new")}
    code = cli.main(["fork", str(forked.parent), *[names.get(a, a) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert said.replace("{parent}", str(forked.parent)) in err
    assert not (tmp_path / "new").exists()
    assert _checksums(forked.parent) == forked.parent_files_before
