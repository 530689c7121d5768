"""bench/results/confirm.json, as `python -m bench confirm` recorded it: a dozen layouts at world size 4,
predicted by the time model after `plan --calibrate` and measured by `plan --confirm`, meet the targets
(rank correlation >= 0.8, median error <= 25%), and the recorded predictions are what the time model
predicts today from the recorded calibration (a change to the model re-records the file)."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from bench import bench_confirm
from llmtrain.cli import main

RESULTS = json.loads(bench_confirm.OUT.read_text())
ROWS: dict[str, dict[str, Any]] = RESULTS["rows"]


def _flags(row: dict[str, Any]) -> dict[str, str]:
    words = shlex.split(row["command"])[2:]
    return dict(zip(words[::2], words[1::2], strict=True))


def test_the_layouts_cover_every_axis_at_world_size_4() -> None:
    flags = [_flags(row) for row in ROWS.values()]
    assert len(flags) >= 10 and all(f["--gpus"] == "4" for f in flags)
    kinds = {
        (f["--engine"], f["--zero"], f["--offload"], f.get("--tp", "1"), f.get("--sp", "1"), f.get("--pp", "1"),
         f.get("--pp-schedule", "-"))
        for f in flags
    }  # fmt: skip
    for zero in ("1", "2", "3"):
        assert ("deepspeed", zero, "none", "1", "1", "1", "-") in kinds
    assert ("deepspeed", "3", "cpu", "1", "1", "1", "-") in kinds
    assert ("deepspeed", "1", "none", "2", "1", "1", "-") in kinds  # tp2 x dp2
    assert ("deepspeed", "1", "none", "1", "2", "1", "-") in kinds  # sp2 x dp2
    assert {("deepspeed", "1", "none", "1", "1", "2", s) for s in ("1f1b", "gpipe")} <= kinds
    assert any(kind[3:6] == ("2", "1", "2") for kind in kinds)  # tp2 x pp2
    assert len({f["--micro-batch"] for f in flags}) >= 2


def test_predicted_and_measured_rank_alike_within_the_targets() -> None:
    summary = RESULTS["summary"]
    assert summary == bench_confirm.summary(ROWS)  # recomputed from the rows
    assert summary["spearman"] >= 0.8
    assert summary["median_relative_error"] <= 0.25


@pytest.mark.parametrize("name", list(ROWS))
def test_the_recorded_prediction_is_the_time_models_today(name: str, tmp_path: Path) -> None:
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text(RESULTS["calibration"])
    flags = _flags(ROWS[name])
    del flags["--gpus"], flags["--nodes"]  # the cluster's
    argv = bench_confirm.pinned([word for pair in flags.items() for word in pair])  # every axis, as run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--cluster", str(cluster), *argv, "--top", "1", "--json"]) == 0
    row = json.loads(out.getvalue())["rows"][0]
    assert row["command"] == ROWS[name]["command"]
    assert row["step_seconds"] == pytest.approx(ROWS[name]["predicted_step_seconds"], rel=1e-9)
