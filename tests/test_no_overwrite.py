"""Nothing of the user's is ever deleted or overwritten: a verb writing at a path the user gave refuses,
in one line with exit 2 and before any work, a path holding what llmtrain did not write (or, for one
file, anything at all unless `--force`), and leaves every byte there as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain import rundir
from llmtrain.cli import main
from llmtrain.data.tokenizer import train_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture
def w(tmp_path: Path) -> Path:
    (tmp_path / "good.txt").write_text(TEXT)
    train_tokenizer([TEXT], 300, tmp_path / "tok.json")
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def _prepare(w: Path, out: Path) -> list[str]:
    return ["prepare-data", str(w / "good.txt"), "--tokenizer", str(w / "tok.json"), "--out", str(out)]


# The measured data loss: a folder holding the user's manifest.json and x.bin was rewritten, exit 0.
USER_FILES = {
    "users_manifest_and_shard": {"manifest.json": b'{"mine": true}', "x.bin": b"\x00\x01\x02"},
    "users_manifest_alone": {"manifest.json": b'{"mine": true}'},
    "a_tokenizer_folder": {"tokenizer.json": b'{"my": "tokenizer"}'},
    "shards_beside_notes": {"train-00000.bin": b"\x00\x00", "notes.txt": b"keep me"},
}


@pytest.mark.parametrize("name", list(USER_FILES))
def test_prepare_data_refuses_a_folder_holding_the_users_files_and_changes_nothing(
    w: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    out = w / "out"
    out.mkdir()
    for file, data in USER_FILES[name].items():
        (out / file).write_bytes(data)
    before = _snapshot(w)
    _refused(capsys, _prepare(w, out), f"--out {out}: holds files prepare-data did not write")
    assert _snapshot(w) == before


def test_prepare_data_refuses_a_file_as_its_output_directory(
    w: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(w)
    _refused(capsys, _prepare(w, w / "good.txt"), "not a directory")
    assert _snapshot(w) == before


def test_prepare_data_replaces_its_own_earlier_output(w: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = w / "out"
    assert main(_prepare(w, out)) == 0
    first = json.loads((out / "manifest.json").read_text())
    (out / "val-00007.bin").write_bytes(b"\x00\x00")  # a shard an interrupted run might have left
    assert main([*_prepare(w, out), "--val-fraction", "0.5"]) == 0
    second = json.loads((out / "manifest.json").read_text())
    assert second["val_fraction"] == 0.5 and first["val_fraction"] != 0.5
    assert not (out / "val-00007.bin").exists()


@pytest.mark.parametrize("verb", ["tokenizer", "config"])
def test_a_single_output_file_is_replaced_only_with_force(
    w: Path, capsys: pytest.CaptureFixture[str], verb: str
) -> None:
    target = w / "existing.json"
    target.write_bytes(b"the user's file")
    argv = {
        "tokenizer": ["tokenizer", "train", str(w / "good.txt"), "--vocab-size", "300", "--out", str(target)],
        "config": ["config", "--preset", "debug", "--out", str(target)],
    }[verb]
    before = _snapshot(w)
    _refused(capsys, argv, f"--out {target}: already exists; nothing was changed; pass --force")
    assert _snapshot(w) == before
    assert main([*argv, "--force"]) == 0
    assert json.loads(target.read_text())  # replaced by what the verb writes
    _refused(capsys, [*argv[:-1], str(w)], "is a directory")


# ---------------------------------------------------------------- train --run-dir

# What a fresh `train` must refuse to write beside: the user's files, alone or beside llmtrain's own files
# of a run that never saved.
USER_RUN_DIRS = {
    "a_users_folder": {"notes.txt": b"my notes", "data.bin": b"\x00\x01"},
    "notes_beside_a_run_that_never_saved": {"config.yaml": b"train: {steps: 2}\n", "notes.txt": b"my notes"},
    "a_folder_in_it": {"plots/loss.png": b"\x89PNG"},
}


@pytest.mark.parametrize("resume_auto", [False, True], ids=["train", "train_resume_auto"])
@pytest.mark.parametrize("name", list(USER_RUN_DIRS))
def test_train_refuses_a_run_dir_holding_the_users_files_and_changes_nothing(
    w: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, name: str, resume_auto: bool
) -> None:
    for var in ("RANK", "WORLD_SIZE"):  # the process the user started
        monkeypatch.delenv(var, raising=False)
    run_dir = w / "run"
    for file, data in USER_RUN_DIRS[name].items():
        (run_dir / file).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / file).write_bytes(data)
    foreign = sorted({file.split("/")[0] for file in USER_RUN_DIRS[name]} - rundir.RUN_NAMES)
    before, names = _snapshot(w), sorted(p.name for p in run_dir.iterdir())
    argv = ["train", "--preset", "debug", "--steps", "2", "--run-dir", str(run_dir)]
    _refused(
        capsys,
        [*argv, *(["--resume", "auto"] if resume_auto else [])],
        f"--run-dir {run_dir}: holds files llmtrain did not write ({', '.join(foreign)}); nothing was changed",
    )
    assert _snapshot(w) == before
    assert sorted(p.name for p in run_dir.iterdir()) == names  # not even a lock file was made


def test_train_refuses_a_file_as_its_run_dir(w: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(w)
    _refused(capsys, ["train", "--preset", "debug", "--run-dir", str(w / "good.txt")], "not a directory")
    assert _snapshot(w) == before


def test_train_accepts_an_empty_dir_or_llmtrains_files_of_a_run_that_never_saved(w: Path) -> None:
    from llmtrain import config as config_mod
    from llmtrain.run import prepare

    empty, restart = w / "empty", w / "restart"
    empty.mkdir()
    # Everything a run writes before its first checkpoint, and what writes cut short by a kill leave.
    for name in ["config.yaml", "ds_config.json", "environment.json", "metrics.jsonl", "tokenizer.json"]:
        (restart / name).parent.mkdir(parents=True, exist_ok=True)
        (restart / name).write_text("{}\n")
    for name in ["run.lock", ".config.yaml.tmp4242", "metrics.jsonl.tmp", "wandb/llmtrain_run_id"]:
        (restart / name).parent.mkdir(parents=True, exist_ok=True)
        (restart / name).write_text("")
    (restart / "checkpoints" / ".incoming").mkdir(parents=True)
    assert rundir.foreign_names(restart) == []
    for run_dir in (empty, restart):
        for resume_auto in (False, True):
            cfg = config_mod.resolve(
                None, [], {"preset": "debug", "train.steps": "2", "run_dir": str(run_dir)}
            )
            prepared = prepare.prepare_train(cfg, resume_auto=resume_auto)
            assert prepared.run_dir == run_dir and not prepared.resume and not prepared.new_dir
