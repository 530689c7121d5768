"""bench.record_ci reads .ci/run's log: the phase times, the suite's summary, the seed, the slowest tests."""

from __future__ import annotations

import pytest

from bench.record_ci import parse

LOG = """\
installed into .venv in 412 s
ci: install done at 415 s
ci: lint and typecheck done at 470 s
Using --randomly-seed=2
........................................................................ [ 99%]
============================= slowest 25 durations =============================
210.62s setup    tests/test_multinode.py::test_openmpi_two_nodes_train_as_one_node_with_two_processes
14.73s call     tests/test_bench_memory.py::test_a_short_run
=========== 1245 passed, 3 skipped, 14 warnings in 1301.50s (0:21:41) ===========
ci: tests done at 1790 s
"""


def test_the_log_gives_phases_counts_seed_and_slowest_tests() -> None:
    got = parse(LOG)
    assert got["phases_done_at_seconds"] == {"install": 415, "lint and typecheck": 470, "tests": 1790}
    assert got["tests"] == {"passed": 1245, "skipped": 3, "warning": 14}
    assert (got["pytest_seconds"], got["seed"]) == (1301.5, 2)
    assert got["slowest"][1] == {
        "seconds": 14.73,
        "when": "call",
        "test": "tests/test_bench_memory.py::test_a_short_run",
    }


def test_failures_are_counted() -> None:
    got = parse(LOG.replace("1245 passed, 3 skipped", "2 failed, 1243 passed, 3 skipped"))
    assert got["tests"] == {"failed": 2, "passed": 1243, "skipped": 3, "warning": 14}


def test_a_log_without_the_tests_phase_is_refused() -> None:
    with pytest.raises(SystemExit, match="no `ci: tests done at N s` line"):
        parse(LOG.replace("ci: tests done at 1790 s\n", ""))
