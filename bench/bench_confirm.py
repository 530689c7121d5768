"""The time model against real runs on this machine: `llmtrain plan --calibrate` at world size 4, then
a dozen layouts of one model, each predicted by `llmtrain plan` and run by its `--confirm`, and how well
the predictions rank and size the measured step times.

`python -m bench confirm` (about 11 minutes on a 2-core AMD EPYC; run it on a quiet machine: another process
on the cores moves the step times it measures):
1. `llmtrain plan --calibrate FILE --gpus 4`: four gloo processes measure this machine (matmuls, memory,
   all-reduce, CPU Adam, and each engine kind's own per-parameter work on a real engine);
2. for every layout below, `llmtrain plan --cluster FILE` with the layout's flags pinned, `--top 1
   --confirm 1`: the layout's predicted step and, from a real `llmtrain train` of its command line,
   the measured one (the median of its steps after the first two);
3. Spearman's rank correlation of predicted and measured, and the median relative error, against the
   targets (0.8 and 25%).

bench/results/confirm.json keeps every row (command, predicted terms, measured), the calibrated cluster
file and the summary; tests/test_bench_confirm.py holds the summary to the targets and the recorded
predictions to what the time model predicts today from the recorded calibration. After a change to the
time model, `python -m bench.bench_confirm --repredict` predicts the recorded runs again (seconds, no
run; `predicted_at` names the commit) where re-measuring them is not wanted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.ranks import REPO, write_result
from llmtrain import rundir
from llmtrain.planning.report import spearman

OUT = REPO / "bench" / "results" / "confirm.json"
DEVICES = 4
# One model and one request for every layout: the `tiny` preset (10M parameters), fp32 (any CPU
# computes it natively), 16 sequences of 256 tokens per step.
REQUEST = ["--preset", "tiny", "--precision", "fp32", "--seq-len", "256", "--global-batch", "16"]
# Each layout pins every axis, so `--top 1` is that layout. The micro-batches differ where the layouts
# would otherwise be alike: per micro-batch, ZeRO 3 gathers every weight, and checkpointing recomputes.
LAYOUTS: dict[str, list[str]] = {
    "dp4 zero1": ["--zero", "1", "--micro-batch", "4"],
    "dp4 zero2": ["--zero", "2", "--micro-batch", "4"],
    "dp4 zero3": ["--zero", "3", "--micro-batch", "4"],
    "dp4 zero3 micro 1": ["--zero", "3", "--micro-batch", "1"],
    "dp4 zero3 cpu offload": ["--zero", "3", "--offload", "cpu", "--micro-batch", "2"],
    "dp4 zero1 micro 1": ["--zero", "1", "--micro-batch", "1"],
    "dp4 zero1 full checkpointing": [
        "--zero",
        "1",
        "--micro-batch",
        "4",
        "--activation-checkpointing",
        "full",
    ],
    "tp2 x dp2": ["--zero", "1", "--tp", "2", "--micro-batch", "8"],
    "sp2 x dp2": ["--zero", "1", "--sp", "2", "--micro-batch", "8"],
    "pp2 x dp2 1f1b": ["--zero", "1", "--pp", "2", "--pp-schedule", "1f1b", "--micro-batch", "2"],
    "pp2 x dp2 gpipe": ["--zero", "1", "--pp", "2", "--pp-schedule", "gpipe", "--micro-batch", "4"],
    "tp2 x pp2": ["--zero", "1", "--tp", "2", "--pp", "2", "--micro-batch", "4"],
    "fsdp2 dp4": ["--engine", "fsdp2", "--zero", "3", "--micro-batch", "4"],
}
ALL_AXES = {"--tp": "1", "--sp": "1", "--pp": "1", "--engine": "deepspeed", "--offload": "none",
            "--activation-checkpointing": "none"}  # fmt: skip
SPEARMAN_TARGET, ERROR_TARGET = 0.8, 0.25


def pinned(flags: list[str]) -> list[str]:
    """The layout's flags, and the defaults of every axis it leaves out (so plan ranks only it)."""
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    return [word for key, value in {**ALL_AXES, **given}.items() for word in (key, value)]


def llmtrain(*args: str) -> str:
    cmd = [sys.executable, "-m", "llmtrain", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(
            f"`llmtrain {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return done.stdout


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    predicted = [row["predicted_step_seconds"] for row in rows.values()]
    measured = [row["measured_step_seconds"] for row in rows.values()]
    rho = spearman(predicted, measured)
    error = statistics.median(abs(m / p - 1) for p, m in zip(predicted, measured, strict=True))
    return {
        "layouts": len(rows),
        "spearman": rho,
        "median_relative_error": error,
        "targets": {"spearman": SPEARMAN_TARGET, "median_relative_error": ERROR_TARGET},
        "meets_targets": rho >= SPEARMAN_TARGET and error <= ERROR_TARGET,
    }


def repredict() -> None:
    """A change to the time model, held to the recorded runs: the engine overhead derived again from the
    calibration's measured engine steps, then each layout predicted again (no run), beside the measured
    step times as they were; `predicted_at` names the model's commit."""
    result = json.loads(OUT.read_text())
    result["calibration"] = _rederived(result["calibration"])
    with tempfile.TemporaryDirectory(prefix="bench-confirm-") as scratch:
        cluster = Path(scratch) / "cpu.yaml"
        cluster.write_text(result["calibration"])
        for name, flags in LAYOUTS.items():
            out = llmtrain(
                "plan", "--cluster", str(cluster), *REQUEST, *pinned(flags), "--top", "1", "--json"
            )
            row, recorded = json.loads(out)["rows"][0], result["rows"][name]
            recorded.update(
                predicted_step_seconds=row["step_seconds"],
                measured_over_predicted=recorded["measured_step_seconds"] / row["step_seconds"],
                terms={term["term"]: term["seconds"] for term in row["terms"]},
            )
    result["summary"] = summary(result["rows"])
    result["predicted_at"] = rundir.environment(DEVICES)["git_sha"]  # the measured runs' is in "machine"
    write_result(result, OUT)


def _rederived(calibration: str) -> str:
    """The calibration file with its engine overhead derived again, by today's time model, from the
    engine steps it measured (the rest of what it measured is the model's input, unchanged)."""
    import yaml

    from llmtrain import calibrate

    header = "".join(line for line in calibration.splitlines(keepends=True) if line.startswith("#"))
    doc = yaml.safe_load(calibration)
    doc["engine_overhead"] = calibrate.engine_overhead(doc)
    return header + yaml.safe_dump(doc, sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench confirm")
    parser.add_argument("--steps", type=int, default=10, help="steps of each run (the first 2 not timed)")
    parser.add_argument(
        "--repredict", action="store_true", help="predict the recorded runs again with today's time model"
    )
    args = parser.parse_args([] if argv is None else argv)  # python -m bench: the defaults
    if args.repredict:
        repredict()
        return
    with tempfile.TemporaryDirectory(prefix="bench-confirm-") as scratch:
        cluster = Path(scratch) / "cpu.yaml"
        print(
            llmtrain("plan", "--calibrate", str(cluster), "--gpus", str(DEVICES)).splitlines()[0], flush=True
        )
        rows = {}
        for name, flags in LAYOUTS.items():
            out = llmtrain("plan", "--cluster", str(cluster), *REQUEST, *pinned(flags), "--top", "1",
                           "--confirm", "1", "--confirm-steps", str(args.steps), "--json")  # fmt: skip
            row = json.loads(out)["rows"][0]
            rows[name] = {
                "command": row["command"],
                "predicted_step_seconds": row["step_seconds"],
                "measured_step_seconds": row["measured_step_seconds"],
                "measured_over_predicted": row["measured_over_predicted"],
                "terms": {term["term"]: term["seconds"] for term in row["terms"]},
            }
            print(f"{name:30s} predicted {row['step_seconds']:.3f} s, measured {row['measured_step_seconds']:.3f} s",
                  flush=True)  # fmt: skip
        calibration = cluster.read_text()
    result = {"machine": rundir.environment(DEVICES), "request": REQUEST, "calibration": calibration,
              "rows": rows, "summary": summary(rows)}  # fmt: skip
    s = result["summary"]
    print(f"{s['layouts']} layouts: rank correlation {s['spearman']:.2f} (target {SPEARMAN_TARGET}), "
          f"median error {s['median_relative_error']:.0%} (target {ERROR_TARGET:.0%})")  # fmt: skip
    write_result(result, OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
