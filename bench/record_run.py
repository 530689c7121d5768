"""Keep a finished training run's figures as a results file: `python -m bench.record_run RUN_DIR NAME`.

Writes bench/results/NAME.json with what the README quotes of a run such as `make train`'s runs/tiny:
the command's settings (RUN_DIR/config.yaml), the machine (RUN_DIR/environment.json), every
evaluation, the last training record and the median tokens/s of the logged intervals. The losses are
deterministic for a given machine kind and settings; the timings are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.ranks import REPO, write_result


def record(run_dir: Path) -> dict[str, Any]:
    from llmtrain import rundir
    from llmtrain.config import to_dict
    from llmtrain.train.metrics import read_metrics

    records = read_metrics(run_dir / rundir.METRICS_FILE)
    train = [r for r in records if "loss" in r]
    if not train:
        raise SystemExit(f"error: {run_dir}: no training records in {rundir.METRICS_FILE}; train it first")
    return {
        "run_dir": run_dir.name,
        "config": to_dict(rundir.load_saved_config(run_dir)),
        "machine": json.loads((run_dir / rundir.ENVIRONMENT_FILE).read_text()),
        "evaluations": [r for r in records if "val_loss" in r],
        "last": train[-1],
        "median_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train[1:] or train),
        "training_seconds": train[-1]["elapsed_s"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.record_run", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("name", help="bench/results/NAME.json")
    parser.add_argument("--wall-seconds", type=float, help="the whole command's wall time, measured outside")
    args = parser.parse_args(argv)
    result = {**record(args.run_dir), "wall_seconds": args.wall_seconds}
    write_result(result, REPO / "bench" / "results" / f"{args.name}.json")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
