"""`llmtrain runs`: the listing agrees with what the run directories hold, and finds damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from trained_run import EVERY, STEPS, trained_run

from llmtrain import cli
from llmtrain.train.metrics import read_metrics


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/ with the trained run, a copy of it with a truncated checkpoint file, and a run with no
    checkpoint yet (config.yaml only); plus a directory that is not a run."""
    source = trained_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(source, root / "good")
    shutil.copytree(source, root / "damaged")
    shard = next((root / "damaged" / "checkpoints" / f"step_{STEPS:08d}").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    (root / "starting").mkdir()
    shutil.copy(source / "config.yaml", root / "starting" / "config.yaml")
    (root / "notes").mkdir()
    return root


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_runs_lists_every_run_with_progress_and_losses(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _cli_json(capsys, "runs", str(runs_root))
    by_name = {r["name"]: r for r in doc["runs"]}
    assert sorted(by_name) == ["damaged", "good", "starting"]  # `notes` is not a run

    records = read_metrics(runs_root / "good" / "metrics.jsonl")
    good = by_name["good"]
    assert good["preset"] == "debug"
    assert (good["step"], good["total_steps"]) == (STEPS, STEPS)
    assert good["latest_checkpoint"] == f"step_{STEPS:08d}" and good["checkpoints"] == 2
    assert good["last_loss"] == [r["loss"] for r in records if "loss" in r][-1]
    assert good["best_val_loss"] == min(r["val_loss"] for r in records if "val_loss" in r)

    starting = by_name["starting"]
    assert (starting["step"], starting["latest_checkpoint"], starting["checkpoints"]) == (None, None, 0)
    assert starting["total_steps"] == STEPS and starting["best_val_loss"] is None


def test_runs_of_one_run_lists_its_checkpoints_and_verifies_them(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _cli_json(capsys, "runs", str(runs_root / "good"))
    rows = doc["checkpoints"]
    assert [(r["tag"], r["step"], r["latest"]) for r in rows] == [
        (f"step_{EVERY:08d}", EVERY, False),
        (f"step_{STEPS:08d}", STEPS, True),
    ]
    for row in rows:
        tag_dir = runs_root / "good" / "checkpoints" / row["tag"]
        on_disk = [p for p in tag_dir.rglob("*") if p.is_file() and p.name != "manifest.json"]
        assert row["size_bytes"] == sum(p.stat().st_size for p in on_disk)
        assert row["files"] == len(on_disk)
        assert row["verified"] is True and row["problems"] == []
        assert (row["zero_stage"], row["world_size"]) == (2, 1)

    damaged = _cli_json(capsys, "runs", str(runs_root / "damaged"))["checkpoints"]
    assert [r["verified"] for r in damaged] == [True, False]
    assert "optim_states.pt" in damaged[1]["problems"][0] and "truncated" in damaged[1]["problems"][0]


def test_runs_table_shows_the_same_data(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["runs", str(runs_root)]) == 0
    table = capsys.readouterr().out
    for text in ("good", "damaged", "starting", f"{STEPS} / {STEPS}", f"step_{STEPS:08d}"):
        assert text in table
    assert cli.main(["runs", str(runs_root / "damaged")]) == 0
    table = capsys.readouterr().out
    assert "(latest)" in table and "NO:" in table


def test_runs_of_a_missing_directory_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["runs", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no such directory" in err[0]
    assert cli.main(["runs", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == []


def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_used(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["eval", str(runs_root / "damaged"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["checkpoint"] == f"step_{EVERY:08d}"
    assert "warning:" in err and "optim_states.pt" in err and "falling back" in err
