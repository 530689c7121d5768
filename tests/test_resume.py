"""Exact resume through the real command line: `python -m llmtrain train / resume` in subprocesses.

Every configuration runs one uninterrupted reference (trained once per module) that the interrupted runs
are compared with, value by value: loss, lr and grad_norm of every step must be bitwise equal (floats
compared with ==). World size 2 goes through `--gpus 2`, i.e. DeepSpeed's launcher in its own session.

  fp32, 1 process, ZeRO 1   crash (exit fault after a save) -> `resume`
  bf16, 1 process, ZeRO 1   SIGTERM -> saves, exits 0 -> `train --resume auto`
  fp32, 2 processes, ZeRO 2 SIGTERM to the parent (forwarded to the workers) -> `resume`
  bf16, 2 processes, ZeRO 2 SIGKILL of the whole process tree at seeded random moments, one inside a
                            checkpoint write -> `train --resume auto` after each
  ZeRO 0, 1, 3, ZeRO 2 + CPU offload, FSDP2
                            SIGKILL mid-step, two steps past a checkpoint -> `resume`
  2 -> 1 processes          universal conversion; same global samples, continuous loss
  1 -> 2 processes          ZeRO 1, 2 (+ CPU offload), 3 through the universal checkpoint; FSDP2 through DCP
  FSDP2, fp32, 2 processes  SIGTERM -> `resume`; 2 -> 1
  corrupt / unsafe checkpoints and bad input: one line `error: ...`, exit 2

Every CLI call has a timeout and runs in its own session, so a hang kills its whole tree and fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from dist import free_port
from runkit import Payload, foreign_lines, kill_tree, rewrite_manifest_entry, start_lines

pytestmark = pytest.mark.slow

TIMEOUT_S = 300  # one CLI process; the slowest (2 processes on a loaded 2-core machine) takes ~60 s
EXACT_KEYS = ("loss", "lr", "grad_norm", "tokens", "skipped", "spikes")


# ---------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Setup:
    name: str
    precision: str
    zero: int
    gpus: int
    steps: int
    save_every: int
    port: int = 0
    faults: str = ""  # in every run of the configuration, reference included
    engine: str = "deepspeed"
    offload: str = "none"

    def flags(self, run_dir: Path) -> list[str]:
        # Global batch 4: 1 process accumulates 2 micro-batches of 2, 2 processes take one each.
        flags = ["--preset", "debug", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32"]
        flags += ["--engine", self.engine, "--offload", self.offload]
        flags += ["--log-every", "1", "--steps", str(self.steps), "--save-every", str(self.save_every)]
        flags += ["--zero", str(self.zero), "--precision", self.precision, "--run-dir", str(run_dir)]
        if self.gpus > 1:
            # A port of our own: other tests may run DeepSpeed's launcher on the default one meanwhile.
            flags += ["--gpus", str(self.gpus), "--master-port", str(self.port or free_port())]
        return flags


# A NaN loss at step 3 (0-based 2): the skipped update and the guard's bookkeeping must resume exactly too.
FP32_1 = Setup("fp32_ws1", "fp32", zero=1, gpus=1, steps=8, save_every=4, faults="nan_loss@0:2")
BF16_1 = Setup("bf16_ws1", "bf16", zero=1, gpus=1, steps=10, save_every=5)
# Two processes step fast: more steps leave room to land a signal or a kill mid-run.
FP32_2 = Setup("fp32_ws2", "fp32", zero=2, gpus=2, steps=20, save_every=10)
BF16_2 = Setup("bf16_ws2", "bf16", zero=2, gpus=2, steps=12, save_every=2)
# Every ZeRO stage and CPU offload once through a SIGKILL and, on one process, a resume on two.
ZERO0_1 = Setup("zero0_fp32_ws1", "fp32", zero=0, gpus=1, steps=8, save_every=4)
ZERO3_1 = Setup("zero3_fp32_ws1", "fp32", zero=3, gpus=1, steps=8, save_every=4)
OFFLOAD_1 = Setup("offload_zero2_fp32_ws1", "fp32", zero=2, gpus=1, steps=8, save_every=4, offload="cpu")
# FSDP2: the same engine-generic scenarios (signals, kills, another process count, both directions).
FSDP2_2 = Setup("fsdp2_fp32_ws2", "fp32", zero=3, gpus=2, steps=16, save_every=4, engine="fsdp2")
FSDP2_1 = Setup("fsdp2_fp32_ws1", "fp32", zero=3, gpus=1, steps=8, save_every=4, engine="fsdp2")


# ---------------------------------------------------------------- running the CLI


def _env(faults: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMTRAIN_FAULTS"}
    env.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if faults:
        env["LLMTRAIN_FAULTS"] = faults
    return env


class Cli:
    """`python -m llmtrain ARGS` in its own session, output to a log file; killable as a whole tree."""

    def __init__(self, args: list[str], log: Path, faults: str | None = None) -> None:
        self.args, self.log = args, log
        self._out = open(log, "w")  # noqa: SIM115 (closed in wait)
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmtrain", *args],
            env=_env(faults),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout: float = TIMEOUT_S) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(self)
            self.proc.wait()
            pytest.fail(f"llmtrain {' '.join(self.args)} timed out after {timeout} s:\n{self.tail()}")
        finally:
            self._out.close()
        return rc

    def running(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def run_cli(args: Sequence[str | Path], log: Path, faults: str | None = None, expect: int | None = 0) -> Cli:
    cli = Cli([str(a) for a in args], log, faults)
    rc = cli.wait()
    if expect is not None:
        assert rc == expect, f"llmtrain {' '.join(cli.args)} exited {rc}, expected {expect}:\n{cli.tail()}"
    return cli


def run_quick(args: Sequence[str | Path]) -> subprocess.CompletedProcess[str]:
    """A CLI call expected to stop early (bad input): captured stdout and stderr apart."""
    return subprocess.run(
        [sys.executable, "-m", "llmtrain", *[str(a) for a in args]],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        start_new_session=True,
    )


def kill(cli: Cli) -> None:
    """SIGKILL the command, every descendant and their process groups (DeepSpeed's launcher has its
    own; never our own, pytest's), then wait for them all to be gone."""
    kill_tree(cli.proc.pid, signal.SIGKILL, wait_s=30)


def wait_until(what: str, cli: Cli, condition: Callable[[], bool], timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not cli.running():
            pytest.fail(f"the run ended before {what}:\n{cli.tail()}")
        if time.monotonic() > deadline:
            kill(cli)
            pytest.fail(f"no {what} within {timeout} s:\n{cli.tail()}")
        time.sleep(0.005)


# ---------------------------------------------------------------- reading a run directory


def metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Training records of metrics.jsonl by step (a torn last line, left by a kill, is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            out[record["step"]] = record
    return out


def last_step(run_dir: Path) -> int:
    return max(metrics(run_dir), default=0)


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def step_of(tag: str) -> int:
    return int(tag.removeprefix("step_"))


def loader_state(run_dir: Path, tag: str) -> dict[str, Any]:
    state = json.loads((run_dir / "checkpoints" / tag / "llmtrain_state_rank0.json").read_text())
    return dict(state["client_state"]["loader"])


def _same(a: Any, b: Any) -> bool:
    """Equal bits for floats (a skipped step logs NaN in both runs), equal values otherwise."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def assert_bitwise(reference: Path, run_dir: Path, steps: range) -> None:
    ref, got = metrics(reference), metrics(run_dir)
    assert sorted(got) == sorted(ref), f"logged steps differ: {sorted(got)} vs reference {sorted(ref)}"
    for step in steps:
        for key in EXACT_KEYS:
            assert _same(got[step].get(key), ref[step].get(key)), (
                f"step {step} {key}: {got[step][key]!r} after resume, {ref[step][key]!r} uninterrupted"
            )


def _tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in a nested dict / list, by path."""
    import torch

    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else []
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def assert_same_final_state(reference: Path, run_dir: Path, step: int) -> None:
    """The checkpoints at `step` hold bitwise-equal model and optimizer tensors (the last update shows in
    no logged loss), and equal counters, sampler, guard and RNG states on every rank."""
    import torch

    from llmtrain.checkpoint import weights_only_loads

    tag = f"step_{step:08d}"
    ref_dir, got_dir = reference / "checkpoints" / tag, run_dir / "checkpoints" / tag
    files = sorted(
        p.name for p in ref_dir.iterdir() if p.suffix in (".pt", ".json") and p.name != "manifest.json"
    )
    assert files == sorted(
        p.name for p in got_dir.iterdir() if p.suffix in (".pt", ".json") and p.name != "manifest.json"
    )
    if (ref_dir / ".metadata").is_file():  # FSDP2: a distributed checkpoint, read whole
        from llmtrain.checkpoint import dcp

        ref_t, got_t = dcp.full_tensors(ref_dir, prefix=""), dcp.full_tensors(got_dir, prefix="")
        assert sorted(got_t) == sorted(ref_t) and len(ref_t) > 0, f"{tag}: different tensors"
        differ = [k for k in ref_t if not torch.equal(got_t[k], ref_t[k])]
        assert not differ, f"{tag}: tensors differ from the uninterrupted run: {differ[:5]}"
    for name in files:
        if name.endswith(".json"):
            ref_state, got_state = (json.loads((d / name).read_text()) for d in (ref_dir, got_dir))
            for state in (ref_state, got_state):
                state["client_state"].pop("config")  # holds the run directory
            assert got_state == ref_state, f"{tag}/{name}: llmtrain state differs"
            continue
        with weights_only_loads():
            ref_t = _tensors(torch.load(ref_dir / name, map_location="cpu"))
            got_t = _tensors(torch.load(got_dir / name, map_location="cpu"))
        assert sorted(got_t) == sorted(ref_t), f"{tag}/{name}: different tensors"
        differ = [k for k in ref_t if got_t[k].dtype != ref_t[k].dtype or not torch.equal(got_t[k], ref_t[k])]
        assert not differ, f"{tag}/{name}: tensors differ from the uninterrupted run: {differ[:5]}"


def copy_run(source: Path, dest: Path, keep_up_to: int | None = None) -> Path:
    """A copy of a run; with `keep_up_to`, as if it had crashed right after committing that step."""
    shutil.copytree(source, dest)
    if keep_up_to is not None:
        root = dest / "checkpoints"
        for tag_dir in root.glob("step_*"):
            if step_of(tag_dir.name.removesuffix("_universal")) > keep_up_to:
                shutil.rmtree(tag_dir)
        (root / "latest").write_text(f"step_{keep_up_to:08d}\n")
    return dest


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The run refused with exit 2 and exactly one `error: ...` line, no traceback; returns the line."""
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, f"exit {result.returncode}, expected 2:\n{output[-3000:]}"
    assert len(errors) == 1, f"expected one `error: ...` line:\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    return errors[0]


def refused_in_process(capsys: pytest.CaptureFixture[str], args: Sequence[str | Path]) -> str:
    """The CLI's entry function, in this process: for refusals that come before any process group or
    DeepSpeed import (a subprocess would spend its time importing torch)."""
    from llmtrain.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return one_error_line(subprocess.CompletedProcess(args, code, out, err))


# ---------------------------------------------------------------- the uninterrupted references


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume")


ONE_PROCESS = [FP32_1, BF16_1, ZERO0_1, ZERO3_1, OFFLOAD_1, FSDP2_1]


class References:
    """The uninterrupted run of each configuration, trained on first use and kept for the module.

    A one-process run keeps at most one core busy and spends most of its time starting up, so the first
    one asked for trains every one-process reference, two at a time: a 2-core machine is never half idle.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trained: dict[str, Path] = {}

    def __call__(self, setup: Setup) -> Path:
        if setup.name not in self.trained:
            todo = [s for s in ONE_PROCESS if s.name not in self.trained] if setup.gpus == 1 else [setup]
            for first in range(0, len(todo), 2):
                self._train_together(todo[first : first + 2])
        return self.trained[setup.name]

    def _train_together(self, setups: list[Setup]) -> None:
        started = {
            setup: Cli(
                ["train", *setup.flags(self.root / f"ref_{setup.name}")],
                self.root / f"ref_{setup.name}.log",
                setup.faults or None,
            )
            for setup in setups
        }
        try:
            for setup, cli in started.items():
                rc = cli.wait()
                assert rc == 0, f"reference {setup.name} exited {rc}:\n{cli.tail()}"
                run_dir = self.root / f"ref_{setup.name}"
                assert sorted(metrics(run_dir)) == list(range(1, setup.steps + 1))
                self.trained[setup.name] = run_dir
        finally:
            for cli in started.values():
                if cli.running():
                    kill(cli)


@pytest.fixture(scope="module")
def references(root: Path) -> References:
    return References(root)


@pytest.mark.parametrize("setup", ONE_PROCESS, ids=lambda setup: f"ref_{setup.name}")
def test_one_process_prints_nothing_of_deepspeed_s_before_its_first_step(
    root: Path, setup: Setup, references: References
) -> None:
    """Every ZeRO stage, CPU offload and FSDP2: no accelerator warning, op-builder line or bf16 memory
    report (`MA 0.38 GB ...`, `CPU Virtual Memory: ...`) ahead of the progress, on stdout or stderr."""
    references(setup)
    output = (root / f"ref_{setup.name}.log").read_text(errors="replace")  # stdout and stderr together
    assert foreign_lines(start_lines(output)) == [], output[:3000]


def test_resume_reads_its_checkpoints_without_importing_torch(references: References) -> None:
    """`resume` checks the saved config, `latest`, the complete checkpoints and the layout that saved
    them in the launching process, which trains nothing: with DS_ACCELERATOR set, without torch or
    DeepSpeed there (1.2 s of CPU saved per resume on a 2-core AMD EPYC). In a fresh interpreter, as
    `llmtrain resume` prepares."""
    code = (
        "import sys; from pathlib import Path; from llmtrain.run import prepare; "
        "prepared = prepare.prepare_resume(Path(sys.argv[1]), None); "
        "print(prepared.resume, sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    )
    run_dir = references(FP32_1)
    done = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "True []"


# ---------------------------------------------------------------- 1. a crash: exit fault, then resume


def test_crash_then_resume_is_bitwise_exact_fp32_one_process(root: Path, references: References) -> None:
    ref_fp32_1 = references(FP32_1)
    run_dir = root / "crash_fp32_ws1"
    # The process dies right after computing step 6 (0-based 5): steps 1-5 logged, step 4 saved.
    faults = f"{FP32_1.faults};exit@0:5"
    crashed = run_cli(["train", *FP32_1.flags(run_dir)], root / "crash.log", faults=faults, expect=17)
    assert latest(run_dir) == "step_00000004", crashed.tail()
    assert last_step(run_dir) == 5  # the resume must drop step 5's record and compute it again

    run_cli(["resume", run_dir], root / "crash_resume.log", faults=FP32_1.faults)
    assert_bitwise(ref_fp32_1, run_dir, range(5, FP32_1.steps + 1))
    assert latest(run_dir) == f"step_{FP32_1.steps:08d}"
    assert_same_final_state(ref_fp32_1, run_dir, FP32_1.steps)
    assert metrics(run_dir)[FP32_1.steps]["skipped"] == 1, "the injected NaN step was not skipped"


# ---------------------------------------------------------------- 2. SIGTERM: finish the step, save, exit 0


@dataclass
class Preempted:
    run_dir: Path
    stop_rc: int
    stopped_at: int  # the last step logged before exiting
    latest_after_stop: str
    had_checkpoint_before: bool
    first_run: Cli
    resumed: Cli


def _preempt(root: Path, setup: Setup, resume_args: Callable[[Path], Sequence[str | Path]]) -> Preempted:
    """Start with `train --resume auto`, SIGTERM the `llmtrain` process once step 2 is logged, resume."""
    run_dir = root / f"sigterm_{setup.name}"
    setup = replace(setup, port=free_port())  # the resume reuses the saved port
    had_checkpoint = (run_dir / "checkpoints").exists()
    first = Cli(["train", "--resume", "auto", *setup.flags(run_dir)], root / f"sigterm_{setup.name}.log")
    wait_until("step 2 was logged", first, lambda: last_step(run_dir) >= 2)
    first.proc.send_signal(signal.SIGTERM)
    rc = first.wait()
    stopped_at = last_step(run_dir)
    stopped_latest = latest(run_dir) if (run_dir / "checkpoints" / "latest").exists() else ""
    resumed = run_cli(resume_args(run_dir), root / f"sigterm_{setup.name}_resume.log")
    return Preempted(run_dir, rc, stopped_at, stopped_latest, had_checkpoint, first, resumed)


@pytest.fixture(scope="module")
def preempted_bf16_1(root: Path) -> Preempted:
    # `train --resume auto` both times: the first starts (no checkpoint), the second resumes.
    return _preempt(root, BF16_1, lambda run_dir: ["train", "--resume", "auto", *BF16_1.flags(run_dir)])


@pytest.fixture(scope="module")
def preempted_fp32_2(root: Path) -> Preempted:
    return _preempt(root, FP32_2, lambda run_dir: ["resume", run_dir])


@pytest.fixture(scope="module")
def preempted_fsdp2_2(root: Path) -> Preempted:
    return _preempt(root, FSDP2_2, lambda run_dir: ["resume", run_dir])


PREEMPTED = [
    ("preempted_bf16_1", BF16_1),
    ("preempted_fp32_2", FP32_2),
    ("preempted_fsdp2_2", FSDP2_2),
]
PREEMPTED_IDS = ["bf16_one_process", "fp32_two_processes", "fsdp2_two_processes"]


@pytest.mark.parametrize("name, setup", PREEMPTED, ids=PREEMPTED_IDS)
def test_sigterm_finishes_the_step_saves_and_exits_0(
    request: pytest.FixtureRequest, name: str, setup: Setup
) -> None:
    run: Preempted = request.getfixturevalue(name)
    assert run.stop_rc == 0, run.first_run.tail()
    assert 2 <= run.stopped_at < setup.steps, f"stopped at {run.stopped_at}: the signal came too late"
    assert run.latest_after_stop == f"step_{run.stopped_at:08d}", "latest must name the step it stopped at"


@pytest.mark.parametrize("name, setup", PREEMPTED, ids=PREEMPTED_IDS)
def test_sigterm_resume_is_bitwise_exact(
    request: pytest.FixtureRequest, references: References, name: str, setup: Setup
) -> None:
    run: Preempted = request.getfixturevalue(name)
    reference = references(setup)
    assert_bitwise(reference, run.run_dir, range(run.stopped_at + 1, setup.steps + 1))
    assert_same_final_state(reference, run.run_dir, setup.steps)


def test_sigterm_while_the_run_starts_stops_after_its_first_step_with_a_checkpoint(root: Path) -> None:
    """A preemption or a job's time limit may come while a run starts (torch's import, the process
    group, the engine: minutes for a large model). The process keeps the request from the moment it
    knows it trains (train.stopping), trains its first step, saves and exits 0, which a Slurm job
    script takes as saved and requeues; killed by the signal instead, the job would end as failed.
    One process, ~10 s; the signal lands half a second after config.yaml, long before the first step."""
    run_dir = root / "sigterm_at_start"
    cli = Cli(["train", *FP32_1.flags(run_dir)], root / "sigterm_at_start.log")
    wait_until("config.yaml was written", cli, lambda: (run_dir / "config.yaml").exists())
    time.sleep(0.5)
    assert last_step(run_dir) == 0, "the signal came after the first step"
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.wait() == 0, cli.tail()
    assert last_step(run_dir) == 1 and latest(run_dir) == "step_00000001", cli.tail()


def test_resume_auto_starts_without_checkpoint_and_resumes_with_one(preempted_bf16_1: Preempted) -> None:
    run = preempted_bf16_1
    assert not run.had_checkpoint_before
    assert "step 1/" in run.first_run.text()  # a fresh start
    printed = [line.split()[1] for line in run.resumed.text().splitlines() if line.startswith("step ")]
    assert printed[0] == f"{run.stopped_at + 1}/{BF16_1.steps}", "the second `--resume auto` must resume"
    assert latest(run.run_dir) == f"step_{BF16_1.steps:08d}"


# ---------------------------------------------------------------- 3. SIGKILL of a 2-process run, repeatedly


@dataclass
class Kill:
    when: str  # what the kill waited for
    step_logged: int  # last step in metrics.jsonl at the kill
    latest: str  # `latest` after the kill ("" when none yet)
    inside_save: bool  # this process was writing a checkpoint: it left its staging directory behind


def _staging_since(run_dir: Path, since: float) -> list[Path]:
    """Staging directories of saves started after `since` (older ones are leftovers of earlier kills)."""
    found = []
    for path in (run_dir / "checkpoints" / ".incoming").glob("step_*"):
        with contextlib.suppress(FileNotFoundError):  # committed (renamed) meanwhile
            if path.stat().st_ctime >= since:
                found.append(path)
    return found


def _printed_step(cli: Cli) -> int:
    """The last `step N/M` line this process printed (metrics.jsonl still holds the killed run's)."""
    steps = [
        int(line.split()[1].split("/")[0]) for line in cli.text().splitlines() if line.startswith("step ")
    ]
    return max(steps, default=0)


def _kill_when(cli: Cli, run_dir: Path, what: str, condition: Callable[[], bool], delay: float) -> Kill:
    wait_until(what, cli, condition)
    time.sleep(delay)
    kill(cli)
    cli.wait()
    tag = latest(run_dir) if (run_dir / "checkpoints" / "latest").exists() else ""
    return Kill(what, last_step(run_dir), tag, inside_save=bool(_staging_since(run_dir, cli.started)))


@pytest.fixture(scope="module")
def killed_bf16_2(root: Path) -> tuple[Path, list[Kill], Cli]:
    """SIGKILL the whole process tree three times at seeded random moments, `--resume auto` after each."""
    rng = random.Random(20240611)
    setup = replace(BF16_2, port=free_port())
    run_dir = root / "killed_bf16_ws2"
    args = ["train", "--resume", "auto", *setup.flags(run_dir)]
    kills: list[Kill] = []

    def resumed_from() -> int:
        return step_of(kills[-1].latest) if kills and kills[-1].latest else 0

    # 1: a random number of steps in, plus a random fraction of a step.
    cli = Cli(args, root / "killed_1.log")
    target = rng.randint(2, 5)
    kills.append(
        _kill_when(cli, run_dir, f"step {target}", lambda: _printed_step(cli) >= target, rng.uniform(0, 0.2))
    )
    # 2: inside a checkpoint write, as soon as this process starts one.
    cli = Cli(args, root / "killed_2.log")
    kills.append(_kill_when(cli, run_dir, "a save", lambda: bool(_staging_since(run_dir, cli.started)), 0.0))
    # 3: a random number of steps after the restart, plus a random fraction of a step.
    cli = Cli(args, root / "killed_3.log")
    target = resumed_from() + rng.randint(1, 3)
    kills.append(
        _kill_when(cli, run_dir, f"step {target}", lambda: _printed_step(cli) >= target, rng.uniform(0, 0.2))
    )
    final = run_cli(args, root / "killed_final.log")
    return run_dir, kills, final


def test_sigkill_at_random_moments_then_resume_ends_bitwise_exact(
    killed_bf16_2: tuple[Path, list[Kill], Cli], references: References
) -> None:
    ref_bf16_2 = references(BF16_2)
    run_dir, kills, _ = killed_bf16_2
    assert any(k.inside_save for k in kills), f"no kill landed inside a checkpoint write: {kills}"
    # The file is truncated to the checkpoint on every resume, so at the end every step is the reference's.
    assert_bitwise(ref_bf16_2, run_dir, range(1, BF16_2.steps + 1))
    assert latest(run_dir) == f"step_{BF16_2.steps:08d}"
    assert_same_final_state(ref_bf16_2, run_dir, BF16_2.steps)

    from llmtrain import checkpoint

    complete = checkpoint.list_complete(run_dir / "checkpoints")
    assert complete, "no complete checkpoint left"
    for info in complete:
        assert checkpoint.verify(info.path) == [], info.tag
    leftovers = list((run_dir / "checkpoints" / ".incoming").glob("step_*"))
    assert not leftovers, "a later successful run must clear leftovers of a killed save"


@pytest.mark.parametrize(
    "setup",
    [ZERO0_1, FP32_1, ZERO3_1, OFFLOAD_1, FSDP2_2],
    ids=["zero0", "zero1", "zero3", "zero2_cpu_offload", "fsdp2_two_processes"],
)
def test_sigkill_mid_step_then_resume_is_bitwise_exact(
    root: Path, references: References, setup: Setup
) -> None:
    """Killed inside the step two past a checkpoint (rank 0 held there, so the kill cannot miss a fast
    run): the two steps logged since the checkpoint are dropped and computed again, to the same bits.
    DeepSpeed's ZeRO 2 on two processes goes through the kills at random moments above."""
    reference = references(setup)
    setup = replace(setup, port=free_port())
    run_dir = root / f"killed_{setup.name}"
    held_at = setup.save_every + 2  # 0-based: the step after the second logged past the checkpoint
    faults = ";".join(f for f in (setup.faults, f"hang@0:{held_at}") if f)
    cli = Cli(["train", *setup.flags(run_dir)], root / f"killed_{setup.name}.log", faults=faults)

    def held_past_a_checkpoint() -> bool:
        return last_step(run_dir) >= held_at and (run_dir / "checkpoints" / "latest").exists()

    killed = _kill_when(cli, run_dir, "two steps past a checkpoint", held_past_a_checkpoint, 0.0)
    assert (killed.latest, killed.step_logged) == (f"step_{setup.save_every:08d}", held_at), killed
    run_cli(["resume", run_dir], root / f"killed_{setup.name}_resume.log", faults=setup.faults or None)
    assert_bitwise(reference, run_dir, range(1, setup.steps + 1))
    assert_same_final_state(reference, run_dir, setup.steps)


# ---------------------------------------------------------------- 5. a different number of processes


def _assert_continued(reference: Path, run_dir: Path, setup: Setup, from_step: int, rel: float) -> None:
    """The run went on from the same global sample, at the same LR, with the uninterrupted run's losses
    (same samples in another reduction order: equal to rounding; a replayed or skipped batch differs by
    far more, as losses of neighbouring batches differ by ~1e-2 here)."""
    final = f"step_{setup.steps:08d}"
    assert loader_state(run_dir, final) == loader_state(reference, final)
    ref, got = metrics(reference), metrics(run_dir)
    assert sorted(got) == sorted(ref)
    for step in range(from_step + 1, setup.steps + 1):
        assert got[step]["lr"] == ref[step]["lr"]
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=rel), f"step {step}"
    first = got[from_step + 1]["loss"]
    assert abs(first - got[from_step]["loss"]) <= 0.05 * got[from_step]["loss"], "loss jumped at the resume"
    if setup.engine == "deepspeed":
        updates = setup.steps - got[setup.steps]["skipped"]  # a skipped step does not count
        _assert_adam_groups_intact(run_dir / "checkpoints" / final, updates)


def _torch_optimizer_states(obj: Any) -> list[dict[str, Any]]:
    """Every torch optimizer state_dict ({state, param_groups}) nested in a DeepSpeed optimizer file."""
    if isinstance(obj, dict):
        if "state" in obj and "param_groups" in obj:
            return [obj]
        return [found for value in obj.values() for found in _torch_optimizer_states(value)]
    return []


def _assert_adam_groups_intact(tag_dir: Path, updates: int) -> None:
    """After a resume through the universal format: Adam counted each optimizer step once (not once per
    param group), and the norms and embedding group still has no weight decay."""
    import torch

    from llmtrain.checkpoint import weights_only_loads
    from llmtrain.config import OptimConfig

    files = sorted(tag_dir.glob("*optim_states.pt"))
    assert files, f"{tag_dir}: no optimizer states"
    for path in files:
        with weights_only_loads():
            states = _torch_optimizer_states(torch.load(path, map_location="cpu"))
        assert states, path
        for state in states:
            assert [float(s["step"]) for s in state["state"].values()] == [updates] * len(state["state"]), (
                path
            )
            decays = [group["weight_decay"] for group in state["param_groups"]]
            assert decays == [OptimConfig().weight_decay, 0.0], f"{path}: weight decay per group {decays}"


@pytest.mark.parametrize(
    "setup, from_step, rel",
    [(BF16_2, 8, 1e-4), (FP32_2, 10, 1e-4), (FSDP2_2, 8, 1e-5)],
    ids=["deepspeed_bf16", "deepspeed_fp32", "fsdp2_fp32"],
)
def test_saved_on_two_processes_resumed_on_one(
    root: Path, references: References, setup: Setup, from_step: int, rel: float
) -> None:
    reference = references(setup)
    run_dir = copy_run(reference, root / f"two_to_one_{setup.name}", keep_up_to=from_step)
    run_cli(["resume", run_dir, "--gpus", "1"], root / f"two_to_one_{setup.name}.log")
    # DeepSpeed's ZeRO shards go through the universal format; FSDP2's DCP reshards by itself.
    converted = (run_dir / "checkpoints" / f"step_{from_step:08d}_universal").is_dir()
    assert converted == (setup.engine == "deepspeed")
    _assert_continued(reference, run_dir, setup, from_step, rel)


@pytest.mark.parametrize(
    "setup",
    [FP32_1, OFFLOAD_1, ZERO3_1, FSDP2_1],
    ids=["zero1", "zero2_cpu_offload", "zero3", "fsdp2"],
)
def test_saved_on_one_process_resumed_on_two(root: Path, references: References, setup: Setup) -> None:
    """Growing the job: DeepSpeed's ZeRO shards of one process go through the universal format, FSDP2's
    DCP reshards by itself; the two processes continue from the same global sample."""
    reference = references(setup)
    from_step = setup.save_every
    run_dir = copy_run(reference, root / f"one_to_two_{setup.name}", keep_up_to=from_step)
    run_cli(
        ["resume", run_dir, "--gpus", "2", "--master-port", free_port()],
        root / f"one_to_two_{setup.name}.log",
    )
    converted = (run_dir / "checkpoints" / f"step_{from_step:08d}_universal").is_dir()
    assert converted == (setup.engine == "deepspeed")
    _assert_continued(reference, run_dir, setup, from_step, 1e-5)


def test_fsdp2_resumed_as_hsdp_continues(root: Path, references: References) -> None:
    """The two-process FSDP2 run (one shard group of 2) resumed with --dp-shard 1: 2 replicas of 1
    shard, both sizes of the mesh changed; DCP loads the sharded checkpoint into the replicated
    tensors. ~15 s."""
    reference = references(FSDP2_2)
    from_step = 8
    run_dir = copy_run(reference, root / "fsdp2_as_hsdp", keep_up_to=from_step)
    run_cli(["resume", run_dir, "--dp-shard", "1", "--master-port", free_port()], root / "fsdp2_as_hsdp.log")
    assert json.loads((run_dir / "fsdp2_plan.json").read_text())["mesh"] == {
        "replicate": 2,
        "shard": 1,
        "tp": 1,
    }
    _assert_continued(reference, run_dir, FSDP2_2, from_step, 1e-6)


# ---------------------------------------------------------------- 6. damaged and unsafe checkpoints


def test_truncated_shard_is_named_and_the_previous_checkpoint_used(
    root: Path, references: References
) -> None:
    ref_fp32_1 = references(FP32_1)
    run_dir = copy_run(ref_fp32_1, root / "truncated")
    newest = run_dir / "checkpoints" / f"step_{FP32_1.steps:08d}"
    shard = next(newest.glob("*optim_states.pt"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)

    strict = one_error_line(run_quick(["resume", run_dir, "--strict"]))
    assert str(shard) in strict and "truncated" in strict, strict

    resumed = run_cli(["resume", run_dir], root / "truncated_resume.log", faults=FP32_1.faults)
    warning = next(line for line in resumed.text().splitlines() if line.startswith("warning: "))
    assert str(shard) in warning and "falling back" in warning, warning
    printed = [line.split()[1] for line in resumed.text().splitlines() if line.startswith("step ")]
    assert printed[0] == f"{FP32_1.save_every + 1}/{FP32_1.steps}", "must resume from the previous checkpoint"
    assert_bitwise(ref_fp32_1, run_dir, range(1, FP32_1.steps + 1))
    assert_same_final_state(ref_fp32_1, run_dir, FP32_1.steps)


@pytest.mark.parametrize("how", ["dotdot", "symlink"])
def test_latest_pointing_outside_the_checkpoint_directory_is_refused(
    root: Path, references: References, how: str
) -> None:
    run_dir = copy_run(references(FP32_1), root / f"outside_{how}")
    ckpts = run_dir / "checkpoints"
    elsewhere = root / f"elsewhere_{how}"
    shutil.copytree(ckpts / "step_00000004", elsewhere / "step_00000009")
    if how == "dotdot":
        (ckpts / "latest").write_text(f"../../{elsewhere.name}/step_00000009\n")
    else:
        (ckpts / "step_00000009").symlink_to(elsewhere / "step_00000009")
        (ckpts / "latest").write_text("step_00000009\n")
    line = one_error_line(run_quick(["resume", run_dir]))
    assert str(ckpts / "latest") in line and "refusing" in line, line
    assert not (run_dir / "checkpoints" / "step_00000009_universal").exists()


def test_checkpoint_holding_code_is_refused_and_never_runs(root: Path, references: References) -> None:
    import torch

    run_dir = copy_run(references(FP32_1), root / "pickled")
    marker = root / "payload_ran"
    tag_dir = run_dir / "checkpoints" / f"step_{FP32_1.steps:08d}"
    target = tag_dir / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": Payload(marker)}, target)
    # The attacker also rewrites the manifest, so the file passes verification and reaches the loader.
    rewrite_manifest_entry(tag_dir, target.name)

    line = one_error_line(run_quick(["resume", run_dir]))
    assert str(target) in line and "system" in line, line
    assert not marker.exists(), "the pickled payload ran"


def test_fsdp2_checkpoint_metadata_holding_code_is_refused_and_never_runs(
    root: Path, references: References
) -> None:
    """DCP reads its `.metadata` with a plain pickle.load: llmtrain's reader admits DCP's records only."""
    import pickle

    run_dir = copy_run(references(FSDP2_1), root / "pickled_fsdp2")
    marker = root / "fsdp2_payload_ran"
    tag_dir = run_dir / "checkpoints" / f"step_{FSDP2_1.steps:08d}"
    target = tag_dir / ".metadata"
    target.write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest_entry(tag_dir, target.name)

    line = one_error_line(run_quick(["resume", run_dir]))
    assert str(target) in line and "posix.system" in line, line
    assert not marker.exists(), "the pickled payload ran"


# ---------------------------------------------------------------- 7. bad input: one line, exit 2


def test_resume_of_a_directory_that_is_not_a_run(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = root / "not_a_run"
    empty.mkdir()
    assert "not a run directory" in refused_in_process(capsys, ["resume", empty])
    assert "no such run directory" in refused_in_process(capsys, ["resume", root / "missing"])


def test_resume_of_a_run_without_a_complete_checkpoint(
    root: Path, references: References, capsys: pytest.CaptureFixture[str]
) -> None:
    # Only a save that never committed (its staging directory): nothing to resume.
    run_dir = copy_run(references(FP32_1), root / "no_checkpoint")
    ckpts = run_dir / "checkpoints"
    staging = ckpts / ".incoming"
    staging.mkdir(exist_ok=True)  # saves leave it behind, empty
    (ckpts / "step_00000004").rename(staging / "step_00000004")
    shutil.rmtree(ckpts / f"step_{FP32_1.steps:08d}")
    (ckpts / "latest").unlink()
    assert "no checkpoint" in refused_in_process(capsys, ["resume", run_dir])

    # A tag directory without its manifest was never committed either (found by the trainer: a process).
    (staging / "step_00000004").rename(ckpts / "step_00000004")
    (ckpts / "step_00000004" / "manifest.json").unlink()
    assert "no complete checkpoint" in one_error_line(run_quick(["resume", run_dir]))


def test_resume_with_an_incompatible_change_shows_the_diff(
    root: Path, references: References, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = copy_run(references(FP32_1), root / "incompatible")
    before = (run_dir / "config.yaml").read_text()
    line = refused_in_process(capsys, ["resume", run_dir, "--seq-len", "64"])
    assert "train.seq_len: 32 -> 64" in line, line
    assert (run_dir / "config.yaml").read_text() == before, "a refused resume must not touch the run"
