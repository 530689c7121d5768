"""Soak: a 2-process run killed (SIGKILL of the whole process tree) and resumed at random points, over
and over for SOAK_MINUTES (default 20), must end bitwise equal to the same run left alone.

Not part of `make test` (pytest only collects test_*.py); run it with `make soak`. Kill points mix
three kinds: during start-up, mid-step, and while a checkpoint is being written. After every kill the
checkpoint `latest` names must verify. Environment: SOAK_MINUTES, SOAK_SEED (printed, to replay a
failure), SOAK_STEPS (default 12 per soak minute + 20).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import torch
from runkit import (
    Run,
    kill_tree,
    last_logged_step,
    latest,
    losses,
    resume_args,
    run_env,
    start,
    train_args,
    wait_for,
)

from llmtrain import checkpoint

MINUTES = float(os.environ.get("SOAK_MINUTES", "20"))
SEED = int(os.environ.get("SOAK_SEED", str(random.SystemRandom().randrange(1 << 30))))
STEPS = int(os.environ.get("SOAK_STEPS", str(int(12 * MINUTES) + 20)))
SAVE_EVERY = 3
RUN_TIMEOUT = 600


def _staged(run_dir: Path) -> bool:
    staging = run_dir / "checkpoints" / checkpoint.STAGING
    return staging.exists() and any(p.name.startswith("step_") for p in staging.iterdir())


def _launch(run_dir: Path, log: Path, counts: Counter[str]) -> Run:
    if latest(run_dir) is None:  # nothing committed yet: start (again) from scratch
        counts["starts"] += 1
        return start(train_args(run_dir, STEPS, SAVE_EVERY), log, run_env())
    counts["resumes"] += 1
    return start(resume_args(run_dir), log, run_env())


def _kill_at_random(run: Run, run_dir: Path, rng: random.Random) -> str:
    """Wait for a random moment of the given kind, then SIGKILL everything; returns the kind, or
    'finished' when the run ended first."""
    kind = rng.choice(["startup", "mid-step", "mid-step", "mid-save"])
    before = last_logged_step(run_dir)
    try:
        if kind == "startup":
            deadline = time.monotonic() + rng.uniform(1.0, 40.0)
            wait_for(lambda: run.proc.poll() is not None or time.monotonic() > deadline, RUN_TIMEOUT, kind)
        elif kind == "mid-step":
            wait_for(
                lambda: run.proc.poll() is not None or last_logged_step(run_dir) > before, RUN_TIMEOUT, kind
            )
            time.sleep(rng.uniform(0.0, 2.5))
        else:
            wait_for(lambda: run.proc.poll() is not None or _staged(run_dir), RUN_TIMEOUT, kind, poll=0.002)
    finally:
        if run.proc.poll() is None:
            kill_tree(run.proc.pid)
        run.proc.wait()
    return kind if run.proc.returncode != 0 else "finished"


def _assert_latest_verifies(run_dir: Path) -> None:
    tag = latest(run_dir)
    if tag is not None:
        assert checkpoint.verify(run_dir / "checkpoints" / tag) == [], tag
        assert checkpoint.choose_checkpoint(run_dir / "checkpoints", strict=True).tag == tag


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.consolidated_fp32_state_dict(run_dir / "checkpoints", checkpoint.tag_for(STEPS))


def test_soak_kill_and_resume_at_random_points_ends_bitwise_equal(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"\nsoak: {MINUTES:g} min, {STEPS} steps, save every {SAVE_EVERY}, seed {SEED}")
    started = time.monotonic()

    reference = tmp_path / "reference"
    code, output = start(
        train_args(reference, STEPS, SAVE_EVERY), tmp_path / "reference.log", run_env()
    ).wait(RUN_TIMEOUT)
    assert code == 0, output[-3000:]

    run_dir = tmp_path / "run"
    kinds: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    deadline = time.monotonic() + MINUTES * 60  # the kill-and-resume time, after the reference run
    finished = False
    while time.monotonic() < deadline:
        run = _launch(run_dir, tmp_path / f"attempt{launches.total()}.log", launches)
        kind = _kill_at_random(run, run_dir, rng)
        if kind == "finished":
            finished = True
            break
        kinds[kind] += 1
        _assert_latest_verifies(run_dir)
        print(
            f"  kill {sum(kinds.values())}: {kind}, latest {latest(run_dir)}, logged {last_logged_step(run_dir)}"
        )

    if not finished:  # let the last attempt run to the end
        code, output = _launch(run_dir, tmp_path / "final.log", launches).wait(RUN_TIMEOUT)
        assert code == 0, output[-3000:]

    same_losses = losses(run_dir) == losses(reference)
    ref_weights, weights = _weights(reference), _weights(run_dir)
    same_weights = ref_weights.keys() == weights.keys() and all(
        torch.equal(ref_weights[k], weights[k]) for k in ref_weights
    )
    kills = sum(kinds.values())
    print(
        f"soak summary: kills {kills} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), "
        f"resumes {launches['resumes']}, fresh starts {launches['starts']}, steps {STEPS}, wall {(time.monotonic() - started) / 60:.1f} min, "
        f"equal: {'yes' if same_losses and same_weights else 'no'} "
        f"(losses {'equal' if same_losses else 'DIFFER'}, weights {'equal' if same_weights else 'DIFFER'})"
    )
    assert kills > 0
    assert same_losses
    assert same_weights
