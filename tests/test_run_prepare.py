"""The run lifecycle: a run is prepared once (resolved, checked, derived, frozen in config.yaml) before
any worker starts; `resume` applies --config / --set / flags under the resume rules or refuses them; a
ZeRO knob set once reaches DeepSpeed's dict and the estimator alike."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trained_run import STEPS, trained_run

from llmtrain import rundir
from llmtrain.cli import main
from llmtrain.config import ConfigError, resolve
from llmtrain.run import prepare
from llmtrain.train.metrics import METRICS_FILE, read_metrics


def _copy_of_trained_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    shutil.copytree(trained_run(tmp_path_factory), run_dir)
    return run_dir


def _llmtrain(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmtrain", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _saved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / rundir.CONFIG_FILE).read_text())


# ---------------------------------------------------------------- resume --config FILE


@pytest.mark.slow
def test_resume_applies_a_config_file_under_the_resume_rules(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    run_dir = _copy_of_trained_run(tmp_path_factory, "resume_config")
    longer = run_dir.parent / "longer.yaml"
    longer.write_text(yaml.safe_dump({"train": {"steps": STEPS + 2}, "logging": {"log_every": 1}}))

    proc = _llmtrain("resume", run_dir, "--config", longer)

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [r["step"] for r in read_metrics(run_dir / METRICS_FILE) if "loss" in r]
    assert steps[-2:] == [STEPS + 1, STEPS + 2]  # log_every 1 from the file reached the run too
    assert _saved(run_dir)["train"]["steps"] == STEPS + 2
    assert (run_dir / "checkpoints" / f"step_{STEPS + 2:08d}").is_dir()


def test_resume_refuses_a_config_file_that_breaks_exactness(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    cfg = resolve(flags={"preset": "debug", "train.steps": "4", "run_dir": str(run_dir)})
    prepare.derive(cfg)
    rundir.write_config(run_dir, cfg)
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    before = (run_dir / rundir.CONFIG_FILE).read_text()
    changes = tmp_path / "changes.yaml"
    changes.write_text(yaml.safe_dump({"train": {"steps": 8}, "optim": {"lr": 0.5}}))

    code = main(["resume", str(run_dir), "--config", str(changes)])

    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "changes would break an exact continuation: optim.lr: 0.0003 -> 0.5; start" in err[0], err
    assert (run_dir / rundir.CONFIG_FILE).read_text() == before


def test_resume_names_a_bad_value_in_the_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    rundir.write_config(run_dir, resolve(flags={"preset": "debug", "run_dir": str(run_dir)}))
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    changes = tmp_path / "changes.yaml"
    changes.write_text("train:\n  steps: many\n")

    assert main(["resume", str(run_dir), "--config", str(changes)]) == 2
    assert f"--config {changes}: train.steps must be int" in capsys.readouterr().err


# ---------------------------------------------------------------- derived once, frozen


def test_prepare_fixes_the_derived_numbers_and_checks_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = resolve(
        flags={"preset": "debug", "train.steps": "50", "train.micro_batch": "2", "launch.gpus": "2"}
    )
    prepared = prepare.prepare_train(cfg, resume_auto=False)
    assert (prepared.cfg.train.global_batch, prepared.cfg.schedule.warmup_steps) == (4, 5)
    assert prepared.new_dir and not prepared.run_dir.exists()  # nothing is written before freeze

    # Under a launcher (torchrun --nnodes 2 running `train --gpus 1`) the launcher's world size counts.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = resolve(flags={"preset": "debug", "train.steps": "50", "train.micro_batch": "2"})
    prepare.derive(cfg)
    assert cfg.train.global_batch == 4

    bad = resolve(flags={"preset": "debug", "train.steps": "10", "schedule.warmup_steps": "20"})
    with pytest.raises(ConfigError, match="--warmup-steps: 20 warmup steps exceed"):
        prepare.derive(bad)


def test_only_rank_0_freezes_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = resolve(flags={"preset": "debug", "run_dir": str(tmp_path / "run")})
    prepared = prepare.PreparedRun(cfg, tmp_path / "run", resume=False, new_dir=True)
    monkeypatch.setenv("RANK", "1")
    prepare.freeze(prepared)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "0")
    undo = prepare.freeze(prepared)
    assert rundir.load_saved_config(tmp_path / "run") == cfg
    undo()  # a run refused after freezing leaves no config.yaml it did not find
    assert not (tmp_path / "run" / rundir.CONFIG_FILE).exists()

    before = "preset: debug\n"
    (tmp_path / "run" / rundir.CONFIG_FILE).write_text(before)
    undo = prepare.freeze(prepared)
    assert (tmp_path / "run" / rundir.CONFIG_FILE).read_text() != before
    undo()  # ... and puts back the one it replaced (`resume --strict` refused: the run is untouched)
    assert (tmp_path / "run" / rundir.CONFIG_FILE).read_text() == before


# ---------------------------------------------------------------- one ZeRO knob, every consumer


def test_a_zero_knob_reaches_the_deepspeed_config_and_the_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["--preset", "7b", "--zero", "2", "--gpus", "8"]
    knob = ["--set", "zero.reduce_bucket_size=123456789"]

    assert main(["config", *common, *knob]) == 0
    assert json.loads(capsys.readouterr().out)["zero_optimization"]["reduce_bucket_size"] == 123456789

    def reduce_buckets(extra: list[str]) -> int:
        assert main(["estimate-memory", *common, *extra, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["per_gpu"]
        return next(r["bytes"] for r in rows if r["term"] == "reduce buckets")

    # overlap_comm keeps two bf16 buckets of reduce_bucket_size elements
    assert reduce_buckets(knob) == 2 * 2 * 123456789
    assert reduce_buckets([]) == 2 * 2 * 4096 * 4096
