"""`llmtrain train` through its real entry point (`python -m llmtrain`), in fresh processes.

The multi-process jobs run concurrently in one module fixture (each costs ~30 s of CPU, mostly imports,
on 2 cores):
- `one_node`: `train --gpus 2` under DeepSpeed's launcher, with `--wandb offline` and a fake API key,
  DS_ACCELERATOR unset as on a user's CPU machine;
- `two_nodes`: torchrun `--nnodes 2 --nproc-per-node 1`, node ranks 0 and 1 on loopback, each running
  `python -m llmtrain --debug train` (inside a launcher: no relaunch, world size from the launcher), with
  a configured per-device peak (`logging.peak_flops`) so MFU is logged on CPU too;
- `crash`: `train --gpus 2` where rank 1 exits abruptly after its third step (LLMTRAIN_FAULTS), its
  launching process run with `-X importtime`.
Bad input is checked on light single-process invocations that fail before any training starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from dist import free_port
from runkit import foreign_lines, start_lines

from llmtrain.train.metrics import METRICS_FILE, WANDB_ID_FILE, read_metrics

STEPS = 6
# fp32 so the two launch paths can be compared number for number.
TRAIN_ARGS = [
    "--preset", "debug", "--steps", str(STEPS), "--micro-batch", "2", "--seq-len", "32",
    "--log-every", "1", "--zero", "1", "--precision", "fp32",
]  # fmt: skip
FAKE_KEY = "llmtrainfake" + "0123456789abcdef" * 2
PEAK_FLOPS = 1e12  # per device, given to the two_nodes job
JOB_TIMEOUT = 420.0


def _env(**extra: str | None) -> dict[str, str]:
    """The test's environment with `extra` set (None: removed); one thread per process on 2 cores."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("LLMTRAIN_FAULTS", None)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass
class Job:
    name: str
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    run_dir: Path
    started: float
    ended_at: float = 0.0  # wall-clock time (time.time()) when the last process had exited

    def wait(self) -> None:
        deadline = self.started + JOB_TIMEOUT
        try:
            for proc in self.procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in self.procs:
                if proc.poll() is None:  # a hang: end it (its whole session) so the test can report it
                    os.killpg(proc.pid, 9)
                    proc.wait()
        self.ended_at = time.time()

    @property
    def codes(self) -> list[int | None]:
        return [p.returncode for p in self.procs]

    def stderr(self, i: int = 0) -> str:
        return self.logs[i].read_text(errors="replace")

    def stdout(self, i: int = 0) -> str:
        return self.logs[i].with_suffix(".out").read_text(errors="replace")

    def output(self, i: int = 0) -> str:
        return self.stdout(i) + self.stderr(i)


def _start(name: str, tmp: Path, commands: list[list[str]], env: dict[str, str], run_dir: Path) -> Job:
    procs, logs = [], []
    for i, cmd in enumerate(commands):
        log = tmp / f"{name}{i}.log"
        with open(log.with_suffix(".out"), "wb") as out, open(log, "wb") as err:
            # stdout alone (not a terminal) is what a script parsing the output reads
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True))
        logs.append(log)
    return Job(name, procs, logs, run_dir, time.monotonic())


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _llmtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmtrain", *args]


def _torchrun_node(node_rank: int, port: int, run_dir: Path) -> list[str]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [
        torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "llmtrain", "--debug", "train", *TRAIN_ARGS, "--run-dir", str(run_dir),
        "--set", f"logging.peak_flops={PEAK_FLOPS:g}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    tmp = tmp_path_factory.mktemp("cli")
    one, two, crash = tmp / "one_node", tmp / "two_nodes", tmp / "crash"
    one_node = [
        *_llmtrain("train", *TRAIN_ARGS, "--gpus", "2", "--run-dir", str(one)),
        *("--wandb", "offline", "--master-port", str(free_port())),
    ]
    rendezvous = free_port()
    crashing = [
        sys.executable, "-X", "importtime", "-m", "llmtrain",  # the launching process's imports alone
        "train", *TRAIN_ARGS, "--gpus", "2", "--run-dir", str(crash), "--master-port", str(free_port()),
    ]  # fmt: skip
    # The flag alone selects offline mode. On a machine without a GPU, DS_ACCELERATOR is left unset as
    # users leave it (llmtrain names the accelerator for DeepSpeed's runner, launch.py and the workers).
    accelerator = "cpu" if _has_gpu() else None
    wandb_env = _env(WANDB_API_KEY=FAKE_KEY, WANDB_MODE=None, DS_ACCELERATOR=accelerator)
    started = [
        _start("one_node", tmp, [one_node], wandb_env, one),
        _start("two_nodes", tmp, [_torchrun_node(r, rendezvous, two) for r in (0, 1)], _env(), two),
        _start("crash", tmp, [crashing], _env(LLMTRAIN_FAULTS="exit@1:2"), crash),
    ]
    for job in started:
        job.wait()
    return {job.name: job for job in started}


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / METRICS_FILE) if "loss" in r]


# ---------------------------------------------------------------- one node, two processes


def _step_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_two_processes_train_and_rank_0_alone_writes_shared_files(jobs: dict[str, Job]) -> None:
    job = jobs["one_node"]
    assert job.codes == [0], job.stderr()[-3000:]
    records = read_metrics(job.run_dir / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once: one writer
    assert records[-1]["tokens"] == STEPS * 2 * 2 * 32  # global batch = micro-batch 2 x 2 processes
    environment = json.loads((job.run_dir / "environment.json").read_text())
    assert environment["world_size"] == 2
    assert json.loads((job.run_dir / "ds_config.json").read_text())["train_batch_size"] == 4
    stdout = job.stdout()
    assert [line.split(" loss")[0] for line in _step_lines(stdout)] == [
        f"step {s}/{STEPS}" for s in range(1, 7)
    ]
    assert stdout.count("training summary") == 1
    assert len(list((job.run_dir / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
def test_output_is_quiet_and_machine_readable_when_not_a_terminal(jobs: dict[str, Job]) -> None:
    job = jobs["one_node"]
    stdout, everything = job.stdout(), job.output()
    assert "[INFO]" not in everything  # DeepSpeed's runner and launch.py at --log_level error
    assert "FutureWarning" not in everything and "is deprecated" not in everything
    assert "\x1b[" not in stdout  # no terminal control codes (no rich progress bar)
    assert "[WARNING]" not in stdout
    # Before the progress: llmtrain's own lines only (wandb's, which the run asked for, on stderr), in
    # none of the four processes (DeepSpeed's runner, launch.py, two workers).
    foreign = foreign_lines([*start_lines(stdout), *job.stderr().splitlines()], "wandb: ")
    assert foreign == [], everything[-3000:]
    # A script can parse the progress lines.
    pattern = re.compile(r"^step (\d+)/6 loss (\d+\.\d{4}) lr \S+ gnorm \S+ tok/s \d+")
    parsed = [pattern.match(line) for line in _step_lines(stdout)]
    assert all(parsed) and len(parsed) == STEPS
    assert [float(m.group(2)) for m in parsed if m] == pytest.approx(_losses(job.run_dir), abs=5e-5)


@pytest.mark.slow
def test_wandb_offline_holds_the_logged_metrics_and_never_the_api_key(jobs: dict[str, Job]) -> None:
    from test_metrics import wandb_history

    job = jobs["one_node"]
    assert job.codes == [0], job.stderr()[-3000:]
    run_id = (job.run_dir / WANDB_ID_FILE).read_text().strip()
    (run_file,) = (job.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history = wandb_history(run_file)
    records = read_metrics(job.run_dir / METRICS_FILE)
    assert [history[r["step"]]["loss"] for r in records] == [r["loss"] for r in records]
    assert [history[r["step"]]["tokens"] for r in records] == [r["tokens"] for r in records]
    files = [p for p in job.run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 10
    assert [p for p in files if FAKE_KEY.encode() in p.read_bytes()] == []


# ---------------------------------------------------------------- two nodes of one process each


@pytest.mark.slow
def test_two_nodes_of_one_process_match_one_node_of_two(jobs: dict[str, Job]) -> None:
    two, one = jobs["two_nodes"], jobs["one_node"]
    assert two.codes == [0, 0], two.stderr(0)[-3000:] + two.stderr(1)[-3000:]
    assert one.codes == [0]
    # Same global batch (2 per process x world size 2) though each node was told --gpus 1.
    assert json.loads((two.run_dir / "ds_config.json").read_text())["train_batch_size"] == 4
    assert "step 6/6" in two.stdout(0) and _step_lines(two.stdout(1)) == []  # node 1 holds rank 1
    reference, losses = _losses(one.run_dir), _losses(two.run_dir)
    assert len(losses) == STEPS
    # Same ranks, same data, same reductions: observed identical; 1e-6 allows another summation order.
    assert losses == pytest.approx(reference, rel=1e-6)


@pytest.mark.slow
def test_mfu_counts_every_process_of_the_job_not_the_gpus_flag(jobs: dict[str, Job]) -> None:
    from llmtrain.config import load_run_config
    from llmtrain.planning.flops import flops_per_token

    job = jobs["two_nodes"]
    assert job.codes == [0, 0], job.stderr(0)[-3000:] + job.stderr(1)[-3000:]
    cfg = load_run_config(job.run_dir / "config.yaml")
    assert cfg.logging.peak_flops == PEAK_FLOPS and cfg.world_size == 1  # each node was told --gpus 1
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    records = [r for r in read_metrics(job.run_dir / METRICS_FILE) if "loss" in r]
    assert len(records) == STEPS
    for r in records:
        # metrics.jsonl holds the floats unrounded (JSON round-trips them), so this is exact up to the
        # order of the operations; the peak is 2 processes x PEAK_FLOPS.
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * per_token / (PEAK_FLOPS * 2), rel=1e-12)


@pytest.mark.slow
def test_debug_brings_deepspeed_s_own_lines_back(jobs: dict[str, Job]) -> None:
    job = jobs["two_nodes"]  # run with `llmtrain --debug`
    assert job.codes == [0, 0], job.stderr(0)[-3000:]
    start = "\n".join(start_lines(job.stdout(0)))
    assert "[INFO]" in start and "DeepSpeed info: version=" in start  # DeepSpeed's logger at INFO
    assert "deepspeed_shm_comm_op built successfully" in start  # an op builder's print, not held back


# ---------------------------------------------------------------- a rank that dies


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_whole_job_promptly_naming_it(jobs: dict[str, Job]) -> None:
    job = jobs["crash"]
    output = job.output()
    assert job.codes[0] not in (0, None), output[-3000:]
    # Rank 1 exits after its 3rd step; the job ends soon after (launch.py's grace period is 30 s),
    # long before the 600 s collective timeout.
    last_record = (job.run_dir / METRICS_FILE).stat().st_mtime
    assert [r["step"] for r in read_metrics(job.run_dir / METRICS_FILE)][-1] == 3  # logged by rank 0
    ended_after = job.ended_at - last_record
    assert ended_after < 45, ended_after
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert any("rank 1" in line for line in errors), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_the_launching_process_imports_neither_torch_nor_deepspeed(jobs: dict[str, Job]) -> None:
    """With DS_ACCELERATOR set and the precision given, the `llmtrain` that starts DeepSpeed's launcher
    trains nothing and imports no torch: 1.4 s of CPU saved per launch on a 2-core AMD EPYC, paid again
    by every relaunch. (-X importtime reports its imports alone, not those of the processes it starts.)"""
    lines = jobs["crash"].stderr().splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    assert "llmtrain.run.launch" in imported
    assert not imported & {"torch", "deepspeed"}, sorted(imported & {"torch", "deepspeed"})


# ---------------------------------------------------------------- bad input


BAD_INPUT = {
    "unknown_preset": (["--preset", "nope"], "--preset: unknown preset 'nope'"),
    "zero_gpus": (["--gpus", "0"], "--gpus: must be at least 1, got 0"),
    "missing_hostfile": (["--hostfile", "{tmp}/no-such-hostfile"], "no-such-hostfile: file not found"),
    "malformed_hostfile": (["--hostfile", "{tmp}/hostfile", "--gpus", "2"], "expected `hostname slots=N`"),
    "steps_and_tokens": (["--steps", "5", "--tokens", "1000"], "give either --steps or --tokens, not both"),
    "seq_len_too_long": (["--seq-len", "1024"], "--seq-len: 1024 exceeds model.max_position_embeddings=512"),
}


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2_and_leaves_no_run_dir(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmtrain.cli import (
        main,
    )  # the console entry point, in-process: these fail before any import of torch

    (tmp_path / "hostfile").write_text("localhost slots=two\n")
    args, expected = BAD_INPUT[name]
    run_dir = tmp_path / "run"
    code = main(
        ["train", "--preset", "debug", "--run-dir", str(run_dir), *(a.format(tmp=tmp_path) for a in args)]
    )
    out, err = capsys.readouterr()
    line = _one_error_line(subprocess.CompletedProcess([], code, out, err))
    assert expected in line, line
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_fresh_run_into_a_directory_with_checkpoints_points_to_resume(
    jobs: dict[str, Job], tmp_path: Path
) -> None:
    run_dir = jobs["one_node"].run_dir
    assert (run_dir / "checkpoints" / "latest").exists()
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    proc = subprocess.run(
        _llmtrain("train", *TRAIN_ARGS, "--run-dir", str(run_dir)),
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    line = _one_error_line(proc)
    assert f"llmtrain resume {run_dir}" in line and "already holds checkpoints" in line
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
