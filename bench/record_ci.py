"""Keep a CI run's timings as a results file: `.ci/run 2>&1 | tee ci.log; python -m bench.record_ci ci.log`.

Writes bench/results/ci.json: the seconds at which `.ci/run` finished each phase (its `ci: ... done at N s`
lines: install, lint and typecheck, tests), the suite's summary (passed, skipped, failed, its own seconds),
the order's seed, the slowest tests as pytest printed them, and the machine.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from bench.ranks import REPO, write_result

PHASE = re.compile(r"^ci: (?P<phase>.+?) done at (?P<seconds>\d+) s$")
SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ (?:failed|passed|errors?)\b.*?) in (?P<seconds>[\d.]+)s")
COUNT = re.compile(r"(?P<n>\d+) (?P<what>passed|failed|skipped|errors?|warnings?|deselected)")
SEED = re.compile(r"--randomly-seed=(?P<seed>\d+)")
SLOW = re.compile(r"^(?P<seconds>[\d.]+)s (?P<when>call|setup|teardown) +(?P<test>\S+)$")


def parse(log: str) -> dict[str, Any]:
    lines = log.splitlines()
    phases = {m["phase"]: int(m["seconds"]) for m in map(PHASE.match, lines) if m}
    summaries = [m for m in map(SUMMARY.match, lines) if m]
    if "tests" not in phases or not summaries:
        raise SystemExit(
            "error: the log has no `ci: tests done at N s` line or no pytest summary; pass .ci/run's log"
        )
    summary = summaries[-1]
    seed = SEED.search(log)
    return {
        "phases_done_at_seconds": phases,
        "tests": {m["what"].rstrip("s"): int(m["n"]) for m in COUNT.finditer(summary["counts"])},
        "pytest_seconds": float(summary["seconds"]),
        "seed": int(seed["seed"]) if seed else None,
        "slowest": [
            {"seconds": float(m["seconds"]), "when": m["when"], "test": m["test"]}
            for m in map(SLOW.match, lines)
            if m
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.record_ci", description=__doc__)
    parser.add_argument("log", type=Path, help=".ci/run's whole output")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ci.json")
    args = parser.parse_args(argv)
    from llmtrain import rundir

    result = {**parse(args.log.read_text(errors="replace")), "machine": rundir.environment(1)}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
