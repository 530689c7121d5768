"""Soak: a 2-process run killed (SIGKILL of the whole process tree) and resumed at random points, over
and over for SOAK_MINUTES of wall time (default 20), must end bitwise equal to the same run left alone.

Not part of `make test` (pytest only collects test_*.py); run it with `make soak`. Kill points mix
three kinds: during start-up, mid-step, and while a checkpoint is being written; the attempt still
running when the time is up is killed at that moment ("deadline"). After every kill the checkpoint
`latest` names must verify, and an attempt that exits by itself fails the soak.

The run is far longer than any soak reaches (RUN_STEPS), so killing and resuming lasts the wall time asked
on a machine of any speed. Its LR schedule does not depend on the run's length (constant after a fixed
warmup), so the uninterrupted reference is `train --steps K` with the same flags, K the step of the
soaked run's last committed checkpoint, trained once at the end: every step's loss, LR, grad norm and token
count up to K, and the weights at K, must be bitwise equal. Environment: SOAK_MINUTES, SOAK_SEED (printed,
to replay the same sequence of kill kinds and delays).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from runkit import (
    EXACT_KEYS,
    Run,
    kill_tree,
    last_logged_step,
    latest,
    metrics,
    resume_args,
    run_env,
    start,
    train_args,
    wait_for,
)

from llmtrain import checkpoint, rundir

MINUTES = float(os.environ.get("SOAK_MINUTES", "20"))
SEED = int(os.environ.get("SOAK_SEED", str(random.SystemRandom().randrange(1 << 30))))
RUN_STEPS = 1_000_000  # at several steps a second, days: the soaked run never finishes
# The same LR at step k whatever the run's length (cosine and WSD decay over the whole run), so a
# K-step reference takes exactly the soaked run's first K updates.
SCHEDULE = ["--schedule", "constant", "--warmup-steps", "20"]
SAVE_EVERY = 3
RUN_TIMEOUT = 600
KINDS = ["startup", "mid-step", "mid-step", "mid-save"]


def _staged(run_dir: Path) -> bool:
    staging = run_dir / "checkpoints" / checkpoint.STAGING
    return staging.exists() and any(p.name.startswith("step_") for p in staging.iterdir())


def _launch(run_dir: Path, log: Path, counts: Counter[str]) -> Run:
    # Nothing committed yet: start (again) from scratch. Asked as `train` asks it, not by `latest`: a kill
    # right after a checkpoint's rename into place leaves it without `latest`, and `train` refuses it.
    if not rundir.has_checkpoints(run_dir):
        counts["starts"] += 1
        return start(train_args(run_dir, RUN_STEPS, SAVE_EVERY, *SCHEDULE), log, run_env())
    counts["resumes"] += 1
    return start(resume_args(run_dir), log, run_env())


def _wait_for_kill_point(run: Run, run_dir: Path, rng: random.Random, kind: str, deadline: float) -> bool:
    """Wait for a random moment of `kind`; False when the soak's time ran out first."""

    def over() -> bool:
        return run.proc.poll() is not None or time.monotonic() >= deadline

    if kind == "startup":
        until = time.monotonic() + rng.uniform(1.0, 40.0)
        wait_for(lambda: over() or time.monotonic() > until, RUN_TIMEOUT, kind)
    elif kind == "mid-step":
        before = last_logged_step(run_dir)
        wait_for(lambda: over() or last_logged_step(run_dir) > before, RUN_TIMEOUT, kind)
        pause = rng.uniform(0.0, 2.5)  # drawn whatever happens, so SOAK_SEED replays the same sequence
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
    else:
        wait_for(lambda: over() or _staged(run_dir), RUN_TIMEOUT, kind, poll=0.002)
    return time.monotonic() < deadline


def _kill_at_random(run: Run, run_dir: Path, rng: random.Random, deadline: float) -> str:
    """SIGKILL everything at a random moment of a random kind, or at the deadline; returns the kind
    ('deadline' for the latter). A run that ended by itself fails the soak: nothing should end it."""
    kind = rng.choice(KINDS)
    try:
        in_time = _wait_for_kill_point(run, run_dir, rng, kind, deadline)
        exited = run.proc.poll()
        assert exited is None, f"the run exited by itself ({exited}); its output:\n{run.output()[-3000:]}"
    finally:
        if run.proc.poll() is None:
            kill_tree(run.proc.pid)
        run.proc.wait()
    return kind if in_time else "deadline"


def _resume_point(run_dir: Path) -> int | None:
    """The step a resume continues from (None before the first checkpoint), after checking that `latest`
    names a verified checkpoint and the one a resume chooses. `latest` is missing only after a kill
    between a first checkpoint's rename into place and the write of `latest`."""
    if not rundir.has_checkpoints(run_dir):
        return None
    chosen = checkpoint.choose_checkpoint(run_dir / "checkpoints", strict=True)
    tag = latest(run_dir)
    if tag is not None:
        assert checkpoint.verify(run_dir / "checkpoints" / tag) == [], tag
        assert chosen.tag == tag
    return chosen.info.step


def _records(run_dir: Path, upto: int) -> dict[int, dict[str, object]]:
    """step -> the exactly reproducible fields of its metrics record, for steps 1..upto. A killed
    attempt may have logged steps past its last checkpoint; the resume after it redid them."""
    found = {int(r["step"]): r for r in metrics(run_dir) if "loss" in r}  # type: ignore[call-overload]
    return {step: {k: found[step][k] for k in EXACT_KEYS} for step in range(1, upto + 1) if step in found}


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return checkpoint.consolidated_fp32_state_dict(run_dir / "checkpoints", checkpoint.tag_for(step))


# The kill phase, then one uninterrupted reference of the steps it reached (faster than the kill phase,
# which restarts over and over), and room for start-up: past the suite's 15-minute default per test.
@pytest.mark.timeout(int(MINUTES * 60 * 2 + 900))
def test_soak_kill_and_resume_at_random_points_ends_bitwise_equal(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"\nsoak: {MINUTES:g} min of kills and resumes, save every {SAVE_EVERY}, seed {SEED}")

    run_dir = tmp_path / "run"
    kinds: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    soak_started = time.monotonic()
    deadline = soak_started + MINUTES * 60
    while time.monotonic() < deadline:
        run = _launch(run_dir, tmp_path / f"attempt{launches.total()}.log", launches)
        kind = _kill_at_random(run, run_dir, rng, deadline)
        kinds[kind] += 1
        step = _resume_point(run_dir)
        print(f"  kill {kinds.total()}: {kind}, resumes from step {step}, logged {last_logged_step(run_dir)}")
    soak_wall = time.monotonic() - soak_started
    reached = _resume_point(run_dir)
    assert reached is not None, "no checkpoint was ever committed: nothing to compare (soak longer)"

    reference = tmp_path / "reference"
    reference_started = time.monotonic()
    code, output = start(
        train_args(reference, reached, SAVE_EVERY, *SCHEDULE), tmp_path / "reference.log", run_env()
    ).wait(RUN_TIMEOUT + reached)
    assert code == 0, output[-3000:]
    reference_wall = time.monotonic() - reference_started

    ref_records, got_records = _records(reference, reached), _records(run_dir, reached)
    same_steps = sorted(got_records) == sorted(ref_records) == list(range(1, reached + 1))
    same_metrics = same_steps and got_records == ref_records
    ref_weights, weights = _weights(reference, reached), _weights(run_dir, reached)
    same_weights = ref_weights.keys() == weights.keys() and all(
        torch.equal(ref_weights[k], weights[k]) for k in ref_weights
    )
    print(
        f"soak summary: killed and resumed for {soak_wall / 60:.1f} min (asked {MINUTES:g}); "
        f"kills {kinds.total()} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), "
        f"resumes {launches['resumes']}, fresh starts {launches['starts']}; reached step {reached}, "
        f"reference {reference_wall / 60:.1f} min; seed {SEED}; "
        f"equal: {'yes' if same_metrics and same_weights else 'NO'} "
        f"(loss, lr, grad norm, tokens of steps 1-{reached} {'equal' if same_metrics else 'DIFFER'}, "
        f"weights {'equal' if same_weights else 'DIFFER'})"
    )
    assert kinds.total() - kinds["deadline"] > 0
    assert same_steps, (sorted(got_records), sorted(ref_records))
    assert same_metrics
    assert same_weights
