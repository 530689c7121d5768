"""The command line through its real entry point: help, version, and the one-line error contract."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmtrain import __version__
from llmtrain.cli import app, main

VERBS = [cmd.name for cmd in app.registered_commands] + [g.name for g in app.registered_groups]


def test_every_verb_is_registered() -> None:
    expected = {
        "train",
        "resume",
        "config",
        "estimate-memory",
        "plan",
        "prepare-data",
        "tokenizer",
        "eval",
        "generate",
        "export",
        "runs",
        "plot",
        "fork",
    }
    assert expected <= set(VERBS)


@pytest.mark.parametrize("verb", sorted(v for v in VERBS if v))
def test_each_verb_has_complete_help(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"Usage: llmtrain {verb}" in out and "--help" in out
    assert "not available yet" not in out


def test_top_level_help_lists_the_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in ("train", "resume", "estimate-memory", "config"):
        assert verb in out


def test_version_through_the_console_script() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "llmtrain", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == f"llmtrain {__version__}"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trian"], "No such command 'trian'"),
        (["config", "--bogus"], "No such option: --bogus"),
        (["config", "--zero"], "'--zero' requires an argument"),
        (["train", "--resume", "always"], "--resume: only `auto` is accepted"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
