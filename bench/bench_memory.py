"""Memory growth over a long run: does a training process's resident memory stay flat for 3000 steps?

`python -m bench memory` (defaults) or `python -m bench.bench_memory [--steps ...]` (flags below).
One real `llmtrain train` in its own process, started as a user starts it: the debug preset on one
process, ZeRO 1, fp32, a checkpoint every 400 steps, the default logging (metrics.jsonl and a progress
line every 10 steps), so the loop does everything a real run does. The benchmark watches the run's
metrics.jsonl and, when a sampling step is logged, takes the resident memory (RSS) of the run's whole
process tree (psutil): at step 100 (after warm-up: the allocator, the data loader's prefetch and the
metrics file have reached their working size), every 250 steps after it, and at step 3000. The run is one
logging interval longer than the last sample, so that sample is taken mid-run, not while the process
exits.

The figure is the growth RSS(step 3000) / RSS(step 100); PASS below 1.05 (--limit). Anything a loop
keeps per step (metrics history, the stability window, per-step lists) would show up as growth. Prints
every sample and the verdict, writes the results (settings, machine, versions, commit, every sample and
the ratio) to bench/results/memory.json (--out), and fails (MemoryGrowth) on FAIL, after writing them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.bench_train import THREADS
from bench.ranks import REPO, write_result

DEFAULT_OUT = REPO / "bench" / "results" / "memory.json"
LOG_EVERY = 10  # llmtrain's default logging interval: a metrics record every 10 steps
POLL_S = 0.02  # a debug step takes ~80 ms: a logged step is seen long before the next record
RUN_TIMEOUT_S = 3600.0


class MemoryGrowth(RuntimeError):
    """The run's resident memory grew by the limit or more between the first and the last sample."""


# ---------------------------------------------------------------- the run and its samples


def train_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """`llmtrain train` as a user runs it; it trains one logging interval past the last sample."""
    return [
        *("train", "--preset", "debug", "--gpus", "1", "--zero", "1", "--precision", args.precision),
        *("--steps", str(args.steps + LOG_EVERY), "--save-every", str(args.save_every)),
        *("--run-dir", str(run_dir)),
    ]


def sample_steps(first: int, every: int, last: int) -> list[int]:
    """`first`, each multiple of `every` between it and `last`, and `last`."""
    return sorted({first, last, *range(every, last, every)} - set(range(first)))


def tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of the process and everything under it, and how many processes that is."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total, count = 0, 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
            count += 1
        except psutil.NoSuchProcess:
            continue  # ended between the listing and the read
    return total, count


class MetricsTail:
    """The newest training record of a growing metrics.jsonl, reading only what was appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = ""
        self.last: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any] | None:
        if self.path.exists():
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
            *lines, self.partial = (self.partial + chunk).split("\n")  # the last piece may be half-written
            for line in lines:
                record = json.loads(line)
                if "loss" in record:  # a training step (evaluations and warnings have their own records)
                    self.last = record
        return self.last


def run_and_sample(args: argparse.Namespace, run_dir: Path, log: Path) -> list[dict[str, Any]]:
    """Start the run, sample its tree's RSS as each sampling step is logged, wait for its end."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(THREADS))
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmtrain", *train_command(args, run_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        samples = _sample_until_done(proc, args, MetricsTail(run_dir / "metrics.jsonl"), log)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        raise RuntimeError(f"the run failed (exit {code}):\n{_tail(log)}")
    return samples


def _sample_until_done(
    proc: subprocess.Popen[bytes], args: argparse.Namespace, metrics: MetricsTail, log: Path
) -> list[dict[str, Any]]:
    pending = sample_steps(args.first, args.every, args.steps)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the run ended (exit {proc.returncode}) before step {pending[0]}:\n{_tail(log)}"
            )
        if time.monotonic() - started > RUN_TIMEOUT_S:
            raise RuntimeError(f"no step {pending[0]} after {RUN_TIMEOUT_S:.0f}s:\n{_tail(log)}")
        record = metrics.poll()
        if record is not None and record["step"] >= pending[0]:
            rss, processes = tree_rss(proc.pid)
            samples.append(
                {
                    "step": pending.pop(0),
                    "logged_step": record["step"],  # the record seen (the same step with the defaults)
                    "rss_bytes": rss,
                    "rss_mib": rss / 2**20,
                    "processes": processes,
                    "checkpoint_due": record["step"] % args.save_every == 0,  # a save may be under way
                    "loss": record["loss"],
                    "elapsed_s": time.monotonic() - started,
                }
            )
            print(
                f"  step {record['step']:>5}: RSS {rss / 2**20:8.1f} MiB ({processes} process(es))",
                flush=True,
            )
            pending = [s for s in pending if s > record["step"]]  # steps passed by in one poll: sampled once
        time.sleep(POLL_S)
    return samples


def _tail(log: Path, lines: int = 30) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


# ---------------------------------------------------------------- the verdict


def growth(samples: list[dict[str, Any]], limit: float) -> dict[str, Any]:
    """RSS at the last sample over RSS at the first, and whether it is under `limit`."""
    first, last = samples[0], samples[-1]
    ratio = last["rss_bytes"] / first["rss_bytes"]
    return {
        "from_step": first["step"],
        "to_step": last["step"],
        "ratio": ratio,
        "grew_mib": (last["rss_bytes"] - first["rss_bytes"]) / 2**20,
        "limit": limit,
        "pass": ratio < limit,
    }


def verdict_line(g: dict[str, Any]) -> str:
    word = "PASS" if g["pass"] else "FAIL"
    return (
        f"{word}: RSS at step {g['to_step']} / step {g['from_step']} = {g['ratio']:.4f} "
        f"({g['grew_mib']:+.1f} MiB; {'under' if g['pass'] else 'not under'} the limit {g['limit']})"
    )


# ---------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="the last sample's step")
    parser.add_argument("--first", type=int, default=100, help="the first sample's step (the baseline)")
    parser.add_argument("--every", type=int, default=250, help="samples in between, every N steps")
    parser.add_argument("--save-every", type=int, default=400, help="the run's checkpoint interval")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--limit", type=float, default=1.05, help="PASS when the growth ratio is under it")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    args = parser.parse_args(argv)
    if not 1 <= args.first < args.steps:
        parser.error(f"--first must be at least 1 and below --steps ({args.steps}), got {args.first}")
    if args.every < 1 or args.save_every < 1:
        parser.error("--every and --save-every must be at least 1")
    if args.limit <= 1:
        parser.error(f"--limit is a growth ratio above 1 (e.g. 1.05), got {args.limit}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    from llmtrain import rundir

    args = parse_args(argv or [])
    print(
        f"debug preset, 1 process, ZeRO 1, {args.precision}, {THREADS} thread(s) (BENCH_THREADS), a checkpoint "
        f"every {args.save_every} steps, default logging; RSS of the run's process tree at steps "
        f"{args.first}, every {args.every} and {args.steps}",
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        run_dir = Path(tmp) / "run"
        samples = run_and_sample(args, run_dir, Path(tmp) / "train.log")
        command = ["llmtrain", *train_command(args, Path("RUN_DIR"))]  # not the temporary path
    g = growth(samples, args.limit)
    print(verdict_line(g))
    result = {
        # Not the output path: the file is where it is, and the path would name this machine.
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "threads": THREADS},
        "command": command,
        "machine": rundir.environment(1),
        "samples": samples,
        "growth": g,
        "seconds": time.perf_counter() - started,
    }
    write_result(result, args.out)
    if not g["pass"]:
        raise MemoryGrowth(verdict_line(g))
    return result


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except MemoryGrowth:
        sys.exit(1)  # the verdict and the results are printed and written already
