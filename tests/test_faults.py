"""Fault injection on real 2-process runs (`llmtrain train --gpus 2` on CPU, gloo).

Each test starts the real entry point in a subprocess, breaks one part of it (kills a rank, hangs one,
fills its disk, signals it mid-save, lets it diverge) and checks what a user relies on: the job ends in
bounded time with a message naming the rank, `latest` only ever names a checkpoint that verifies, and
`llmtrain resume` continues bitwise-exactly (fp32, compared with one uninterrupted run).

Faults come from LLMTRAIN_FAULTS (llmtrain/train/faults.py, a loop hook); steps there are 0-based, the
logs' are 1-based.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist import free_port
from runkit import (
    error_lines,
    last_logged_step,
    latest,
    losses,
    metrics,
    resume_args,
    run_env,
    start,
    train_args,
    wait_for,
)

from llmtrain import checkpoint
from llmtrain.config import ConfigError, resolve
from llmtrain.planning import memory
from llmtrain.train import faults
from llmtrain.units import human

pytestmark = pytest.mark.slow

STEPS = 8
SAVE_EVERY = 2
RUN_TIMEOUT = 300  # generous: two cold starts of DeepSpeed on a busy 2-core machine


def _ckpt_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _assert_latest_verifies(run_dir: Path) -> str:
    tag = latest(run_dir)
    assert tag is not None, "no checkpoint committed"
    assert checkpoint.verify(_ckpt_root(run_dir) / tag) == []
    assert checkpoint.choose_checkpoint(_ckpt_root(run_dir), strict=True).tag == tag
    return tag


def _staged_tags(run_dir: Path) -> list[str]:
    """Saves under way (DeepSpeed also keeps its recovery scripts in the staging dir: not tags)."""
    staging = _ckpt_root(run_dir) / checkpoint.STAGING
    return sorted(p.name for p in staging.iterdir() if p.name.startswith("step_")) if staging.exists() else []


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.consolidated_fp32_state_dict(_ckpt_root(run_dir), checkpoint.tag_for(STEPS))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == torch.float32
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run every interrupted one must match, loss for loss and bit for bit."""
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    run = start(train_args(run_dir, STEPS, SAVE_EVERY), run_dir.with_suffix(".log"), run_env())
    code, output = run.wait(RUN_TIMEOUT)
    assert code == 0, output[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return run_dir


def _resume_to_the_end(run_dir: Path, reference: Path) -> None:
    run = start(resume_args(run_dir), run_dir.with_suffix(".resume.log"), run_env())
    code, output = run.wait(RUN_TIMEOUT)
    assert code == 0, output[-3000:]
    assert losses(run_dir) == losses(reference)  # every step, bitwise (floats survive JSON exactly)
    _assert_same_weights(_final_weights(run_dir), _final_weights(reference))


# The engine flags of the engine-generic fault tests: DeepSpeed's default ZeRO 1, and FSDP2.
ENGINES = {"deepspeed": [], "fsdp2": ["--engine", "fsdp2", "--zero", "3"]}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_sigkill_of_one_rank_ends_the_job_naming_it_and_resume_is_exact(
    tmp_path: Path, reference: Path, engine: str
) -> None:
    run_dir = tmp_path / "run"
    run = start(train_args(run_dir, STEPS, SAVE_EVERY, *ENGINES[engine]), tmp_path / "run.log", run_env())
    wait_for(lambda: latest(run_dir) is not None and last_logged_step(run_dir) >= 3, RUN_TIMEOUT, "step 3")
    victim = run.workers()[1]
    victim.kill()  # SIGKILL, mid-step: no handler, no cleanup
    killed_at = time.monotonic()
    code, output = run.wait(RUN_TIMEOUT)
    ended_in = time.monotonic() - killed_at
    print(f"job ended {ended_in:.1f}s after SIGKILL of rank 1")
    assert code != 0
    assert ended_in < 60
    named = [
        line
        for line in error_lines(output)
        if f"rank 1 on {socket.gethostname()} (pid {victim.pid}) has died" in line
    ]
    assert named, output[-3000:]
    assert named[0].startswith("error: rank 0: lost contact with another rank at step ")
    assert "Traceback" not in output
    _assert_latest_verifies(run_dir)
    if engine == "deepspeed":  # FSDP2's bitwise resume after SIGKILL: tests/test_resume.py
        _resume_to_the_end(run_dir, reference)


def test_a_rank_stuck_before_a_collective_aborts_the_job_within_the_timeout(tmp_path: Path) -> None:
    timeout = 15
    run_dir = tmp_path / "run"
    args = train_args(run_dir, STEPS, SAVE_EVERY, "--collective-timeout", str(timeout))
    run = start(args, tmp_path / "run.log", run_env("hang@1:3"))  # rank 1 stops before step 4's all-reduce
    stuck_at = wait_for(lambda: last_logged_step(run_dir) >= 3, RUN_TIMEOUT, "step 3")
    code, output = run.wait(RUN_TIMEOUT)
    ended_in = time.monotonic() - stuck_at
    print(f"job ended {ended_in:.1f}s after rank 1 got stuck (--collective-timeout {timeout})")
    assert code == 1
    assert timeout - 1 < ended_in < timeout + 15
    assert (
        f"error: rank 0: a collective timed out after {timeout}s at step 4 (--collective-timeout): "
        "rank 1 is stuck: it never reached step 4 (last at step 3)"
    ) in error_lines(output), output[-3000:]
    assert "Traceback" not in output
    assert _assert_latest_verifies(run_dir) == checkpoint.tag_for(2)


def _disk_full_run(tmp_path: Path, engine: str, *extra: str) -> tuple[Path, int, str]:
    """Rank 1's writes fail (EFBIG) during the checkpoint after 0-based step 3 (the one for step 4)."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, 6, SAVE_EVERY, *ENGINES[engine], *extra)
    run = start(args, tmp_path / "run.log", run_env("disk_full@1:3"))
    code, output = run.wait(RUN_TIMEOUT)
    return run_dir, code, output


def _names_rank_1s_failed_write(line: str, run_dir: Path, engine: str) -> bool:
    """DeepSpeed: rank 1's optimizer shard, the first file it writes. FSDP2: DCP reports the failed
    rank and its error for the checkpoint directory (its shard file is the only one rank 1 writes)."""
    staging = f"rank 1: {run_dir}/checkpoints/.incoming/step_00000004"
    return (staging + ("/zero_pp_rank_1_" if engine == "deepspeed" else ": OSError: File too large")) in line


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_failed_checkpoint_write_on_one_rank_warns_and_retries_at_the_next_interval(
    tmp_path: Path, engine: str
) -> None:
    run_dir, code, output = _disk_full_run(tmp_path, engine)
    assert code == 0, output[-3000:]
    warning = [line for line in output.splitlines() if "checkpoint at step 4 failed" in line]
    assert warning, output[-3000:]
    assert _names_rank_1s_failed_write(warning[0], run_dir, engine), warning[0]
    assert "failed, previous checkpoint kept: " in warning[0]
    assert warning[0].endswith("; retrying at the next interval")
    root = _ckpt_root(run_dir)
    assert not (root / checkpoint.tag_for(4)).exists()
    assert _staged_tags(run_dir) == []  # the failed attempt left nothing behind
    assert [i.step for i in checkpoint.list_complete(root)] == [2, 6]  # the retry at step 6 worked
    assert checkpoint.verify(root / checkpoint.tag_for(2)) == []
    assert _assert_latest_verifies(run_dir) == checkpoint.tag_for(6)
    assert last_logged_step(run_dir) == 6


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_failed_checkpoint_write_stops_cleanly_when_configured(tmp_path: Path, engine: str) -> None:
    run_dir, code, output = _disk_full_run(tmp_path, engine, "--set", "checkpoint.on_save_failure=stop")
    assert code == 1
    reports = [line for line in error_lines(output) if "checkpoint at step 4 failed" in line]
    assert len(reports) == 2, output[-3000:]  # every rank reports it (and names rank 1's failure)
    assert all(_names_rank_1s_failed_write(x, run_dir, engine) for x in reports), reports
    assert "Traceback" not in output
    root = _ckpt_root(run_dir)
    assert latest(run_dir) == checkpoint.tag_for(2)  # unchanged
    assert [i.step for i in checkpoint.list_complete(root)] == [2]
    assert checkpoint.verify(root / checkpoint.tag_for(2)) == []
    assert last_logged_step(run_dir) == 4  # stopped at the failed save


MORE_THAN_ANY_DISK = "1e15"  # checkpoint.min_free of 1 PB: no checkpoint fits


@pytest.fixture(scope="module")
def no_room(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """on_save_failure -> (run dir, exit code, output) of a one-process run (6 steps, a save due every 2)
    with checkpoint.min_free above the disk's free space; both runs at once, as one costs mostly start-up."""
    base = tmp_path_factory.mktemp("no_room")
    started = {}
    for policy in ("continue", "stop"):
        sets = [f"checkpoint.min_free={MORE_THAN_ANY_DISK}", f"checkpoint.on_save_failure={policy}"]
        args = train_args(base / policy, 6, SAVE_EVERY, *(x for s in sets for x in ("--set", s)), gpus=1)
        started[policy] = start(args, base / f"{policy}.log", run_env())
    return {policy: (base / policy, *run.wait(RUN_TIMEOUT)) for policy, run in started.items()}


def _refusal(step: int, run_dir: Path) -> re.Pattern[str]:
    """The refusal of step's save, with the first-save estimate of the debug preset (ZeRO 1, fp32) and
    the free space captured."""
    cfg = resolve(flags={"preset": "debug", "train.precision": "fp32", "zero.stage": 1})
    setup = memory.setup_from_config(cfg)
    basis = f"the model's {setup.params:,} parameters in fp32, no checkpoint yet"
    return re.compile(
        re.escape(f"checkpoint at step {step} failed: not enough free space on {_ckpt_root(run_dir)}: ")
        + re.escape(f"needs ~{human(memory.checkpoint_bytes(setup), decimals=1)} (estimated from {basis}), ")
        + r"([0-9.]+) ([KMGT]iB) free, "
        + re.escape(f"keeping {human(int(float(MORE_THAN_ANY_DISK)), decimals=1)} free (checkpoint.min_free)")
    )


def test_a_checkpoint_that_cannot_fit_is_refused_before_writing_and_training_goes_on(
    no_room: dict[str, tuple[Path, int, str]],
) -> None:
    run_dir, code, output = no_room["continue"]
    assert code == 0, output[-3000:]
    warnings = [line for line in output.splitlines() if line.startswith("warning: checkpoint at step")]
    for step in (2, 4, 6):  # every save due, and the final one
        found = [match for w in warnings if (match := _refusal(step, run_dir).search(w))]
        assert found, (step, warnings)
        assert found[0].string.endswith("; retrying at the next interval")
        number, unit = found[0].groups()
        free = float(number) * 1024 ** (1 + ["KiB", "MiB", "GiB", "TiB"].index(unit))
        assert abs(free - shutil.disk_usage(run_dir.parent).free) < 0.05 * free + 2**30  # the run's disk
    assert not _ckpt_root(run_dir).exists()  # no checkpoint, no staging dir, no partial file
    assert last_logged_step(run_dir) == 6


def test_a_checkpoint_that_cannot_fit_stops_the_run_when_configured(
    no_room: dict[str, tuple[Path, int, str]],
) -> None:
    run_dir, code, output = no_room["stop"]
    assert code == 1, output[-3000:]
    (line,) = error_lines(output)
    assert _refusal(2, run_dir).fullmatch(line.removeprefix("error: ")), line
    assert "Traceback" not in output
    assert not _ckpt_root(run_dir).exists()
    assert last_logged_step(run_dir) == 2  # stopped at the first save due


def test_sigterm_during_a_checkpoint_save_never_leaves_a_half_checkpoint_named_latest(
    tmp_path: Path, reference: Path
) -> None:
    run_dir = tmp_path / "run"
    run = start(train_args(run_dir, STEPS, 1), tmp_path / "run.log", run_env())
    saving = lambda: last_logged_step(run_dir) >= 2 and _staged_tags(run_dir) != []  # noqa: E731
    wait_for(saving, RUN_TIMEOUT, "a checkpoint being written", poll=0.002)
    run.proc.send_signal(signal.SIGTERM)  # to `llmtrain train`, which passes it to both ranks
    in_flight = _staged_tags(run_dir)
    code, output = run.wait(RUN_TIMEOUT)
    assert code == 0, output[-3000:]
    tag = _assert_latest_verifies(run_dir)
    stopped = int(tag.removeprefix("step_"))
    print(f"SIGTERM while writing {in_flight}; stopped with a checkpoint at step {stopped}")
    assert stopped < STEPS
    for name in in_flight:  # the save under way finished (complete, verified) or left no tag at all
        done = _ckpt_root(run_dir) / name
        assert not done.exists() or checkpoint.verify(done) == []
    assert _staged_tags(run_dir) == []
    _resume_to_the_end(run_dir, reference)


def test_torchrun_restart_resumes_automatically_and_ends_with_the_uninterrupted_weights(
    tmp_path: Path, reference: Path
) -> None:
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    launcher = [torchrun, "--max-restarts", "1", "--nproc-per-node", "2", "--master-port", str(free_port())]
    args = train_args(run_dir, STEPS, SAVE_EVERY, "--resume", "auto")
    # Rank 1 crashes after 0-based step 4 (two checkpoints in); only in the first attempt.
    run = start(args, tmp_path / "run.log", run_env("exit@1:4#first"), launcher=launcher)
    code, output = run.wait(RUN_TIMEOUT * 2)
    assert code == 0, output[-4000:]
    assert "(exitcode: 17) local_rank: 1" in output, output[-4000:]  # the first attempt did crash
    assert "step 5/8" in output.split("(exitcode: 17)")[1]  # the restart resumed from step 4's checkpoint
    assert losses(run_dir) == losses(reference)
    _assert_same_weights(_final_weights(run_dir), _final_weights(reference))


def test_repeated_nan_loss_on_one_rank_is_skipped_everywhere_then_stops_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, STEPS, SAVE_EVERY, "--set", "stability.max_consecutive_skips=3")
    run = start(args, tmp_path / "run.log", run_env("nan_loss@1:3,4,5,6,7"))
    code, output = run.wait(RUN_TIMEOUT)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 2, output[-3000:]  # both ranks stop at the same step, with the same words
    assert errors[0] == errors[1]
    assert "3" in errors[0] and "skip" in errors[0], errors[0]
    assert "Traceback" not in output
    records = {int(r["step"]): r for r in metrics(run_dir) if "loss" in r}
    assert [records[s]["skipped"] for s in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert all(records[s]["loss"] is None or records[s]["loss"] != records[s]["loss"] for s in (4, 5))
    assert 6 not in records  # the third skip in a row ends the run before it is logged
    assert _assert_latest_verifies(run_dir) == checkpoint.tag_for(4)


def test_faults_parse_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrain.train import faults

    monkeypatch.setenv(faults.ENV, "exit@1:5#first;nan_loss@1:2,3;disk_full@1:4")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first = faults.from_env(1)
    assert (first.exit_after_step, first.nan_loss_steps, first.disk_full_after_steps) == (5, {2, 3}, {4})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.from_env(1).exit_after_step is None
    assert faults.from_env(0) == faults.Faults()


@pytest.mark.parametrize(
    "value",
    ["nan_loss@1", "nan_loss@x:3", "explode@0:3", "exit@1:", "nan_loss@1:3#last", "nan_loss@1:3;exit"],
)
def test_a_malformed_faults_value_is_a_config_error_naming_the_variable_and_the_syntax(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.ENV, value)
    for rank in (0, 1):  # every item is checked on every rank, whichever rank it names
        with pytest.raises(ConfigError) as info:
            faults.hooks_from_env(rank)
        message = str(info.value)
        assert message.startswith(f"{faults.ENV}: bad item ") and faults.SYNTAX in message
        assert "\n" not in message


def test_faults_are_a_hook_registered_only_when_the_variable_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.hooks_from_env(0) == []
    monkeypatch.setenv(faults.ENV, "")
    assert faults.hooks_from_env(0) == []
    monkeypatch.setenv(faults.ENV, "nan_loss@1:2, ;hang@0:5")
    (hook,) = faults.hooks_from_env(1)
    loss = torch.tensor(2.0)
    assert hook.on_forward(loss, 1) is loss
    assert torch.isnan(hook.on_forward(loss, 2))
    assert faults.hooks_from_env(0) == [faults.Faults(hang_at_step=5)]


def test_a_malformed_faults_value_fails_the_cli_in_one_line_with_exit_2(tmp_path: Path) -> None:
    args = ["train", "--preset", "debug", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain", *args],
        capture_output=True,
        text=True,
        env=run_env("nan_loss@one:3"),
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [
        f"error: {faults.ENV}: bad item 'nan_loss@one:3'; expected {faults.SYNTAX}"
    ]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # refused while preparing: nothing was created
