"""What llmtrain reads and writes cannot be turned against the user.

- A checkpoint never unpickles arbitrary objects, end to end through `llmtrain resume`.
- Secrets in the environment (wandb, Hugging Face, AWS) never reach any file under the run directory
  (config.yaml, ds_config.json, environment.json, metrics.jsonl, wandb's offline files, checkpoints) nor
  the logs, after a real 2-process run with `--wandb offline`.
- Run names and checkpoint tags cannot lead outside their directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from runkit import Payload, error_lines, resume_args, rewrite_manifest_entry, run_env, start, train_args

from llmtrain import checkpoint
from llmtrain.cli import main

SECRETS = {
    "WANDB_API_KEY": "wandbfake" + uuid.uuid4().hex,
    "HF_TOKEN": "hf_fake" + uuid.uuid4().hex,
    "HUGGING_FACE_HUB_TOKEN": "hf_fake" + uuid.uuid4().hex,
    "AWS_SECRET_ACCESS_KEY": "awsfake" + uuid.uuid4().hex,
}
STEPS = 2


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-process run with wandb offline and secrets in its environment; (run dir, its output)."""
    run_dir = tmp_path_factory.mktemp("security") / "run"
    env = run_env(**SECRETS)
    env.pop("WANDB_MODE")  # the flag alone selects offline mode
    run = start(train_args(run_dir, STEPS, STEPS, "--wandb", "offline"), run_dir.with_suffix(".log"), env)
    code, output = run.wait(300)
    assert code == 0, output[-3000:]
    return run_dir, output


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.mark.slow
def test_secrets_from_the_environment_reach_no_file_and_no_log(secret_run: tuple[Path, str]) -> None:
    run_dir, output = secret_run
    files = _files(run_dir)
    names = {p.name for p in files}
    # The run wrote what it should (so the scan below looked at real files, wandb's included).
    assert {"config.yaml", "ds_config.json", "environment.json", "metrics.jsonl", "manifest.json"} <= names
    assert any(".wandb" in p.name for p in files), sorted(names)
    assert any(p.suffix == ".pt" for p in files)
    for name, value in SECRETS.items():
        for path in files:
            assert value.encode() not in path.read_bytes(), f"{name} leaked into {path}"
        assert value not in output, f"{name} leaked into the console output"


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_with_pickled_code_and_never_runs_it(
    secret_run: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(secret_run[0], run_dir, symlinks=True)
    tag_dir = run_dir / "checkpoints" / checkpoint.tag_for(STEPS)
    marker = tmp_path / "PWNED"
    target = tag_dir / "mp_rank_00_model_states.pt"
    state = torch.load(target, map_location="cpu", weights_only=False)
    state["evil"] = Payload(marker)
    torch.save(state, target)
    rewrite_manifest_entry(tag_dir, target.name)
    assert checkpoint.verify(tag_dir) == []  # it passes the integrity check: only the scan stands

    run = start(resume_args(run_dir, "--steps", str(STEPS + 2)), tmp_path / "resume.log", run_env())
    code, output = run.wait(300)
    assert code == 2, output[-3000:]
    refused = [line for line in error_lines(output) if "refusing to load" in line]
    assert refused and str(target) in refused[0] and "system" in refused[0], output[-3000:]
    assert not marker.exists()
    assert "Traceback" not in output


# ---------------------------------------------------------------- nothing escapes its directory


def _run_dir_with_checkpoint(root: Path) -> Path:
    from llmtrain import config as config_mod

    run_dir = root / "run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    cfg = config_mod.resolve(None, [], {"preset": "debug", "train.steps": "4"})
    (run_dir / "config.yaml").write_text(config_mod.dump_yaml(cfg))
    return run_dir


@pytest.mark.parametrize(
    "latest", ["../../outside", "/etc/passwd", "step_00000002/../../outside", "..", "step_2"]
)
def test_resume_refuses_a_latest_that_leads_outside(
    latest: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run_dir_with_checkpoint(tmp_path)
    (run_dir / "checkpoints" / "latest").write_text(latest + "\n")
    assert main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run_dir / 'checkpoints' / 'latest'}: names ") and "refusing it" in err


def test_resume_refuses_a_tag_directory_that_is_a_symlink_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run_dir_with_checkpoint(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_text(json.dumps({"files": [], "step": 9}))
    (run_dir / "checkpoints" / "step_00000009").symlink_to(outside, target_is_directory=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000009\n")
    assert main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "resolves outside" in err and "refusing it" in err
    # Not even listed as a checkpoint, so neither resume's fallback nor pruning ever touches it.
    assert [i.tag for i in checkpoint.list_complete(run_dir / "checkpoints")] == []
    assert checkpoint.prune(run_dir / "checkpoints", keep=1, keep_every=None) == []
    assert (outside / "manifest.json").exists()


@pytest.mark.parametrize("tag", ["../step_00000001", "step_00000001/../../x", "/tmp", "step_1"])
def test_checkpoint_tags_cannot_name_a_path(tag: str, tmp_path: Path) -> None:
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint tag"):
        checkpoint.checkpoint_dir(tmp_path, tag)


@pytest.mark.parametrize("name", ["../../x", "a/b", "/abs", "..", "."])
def test_run_names_cannot_be_paths(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [
        "train",
        "--preset",
        "debug",
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        f"logging.run_name={name}",
    ]
    assert main(argv) == 2
    assert "is not a plain name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_environment_file_records_no_environment_variables() -> None:
    """environment.json is built from an allow-list of facts, not from os.environ."""
    code = "import json, llmtrain.rundir as r; print(json.dumps(r.environment(1)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **SECRETS, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert not any(value in out.stdout for value in SECRETS.values())
    assert "git_sha" in json.loads(out.stdout.strip().splitlines()[-1])
