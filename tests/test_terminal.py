"""llmtrain's tables and log lines do not depend on the terminal they are piped to (llmtrain/terminal.py)."""

from __future__ import annotations

import os

import pytest

from llmtrain.cli import main

ESTIMATE = ["estimate-memory", "--preset", "7b", "--zero", "3", "--offload", "cpu", "--gpus", "8"]


def _estimate(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(ESTIMATE) == 0
    return capsys.readouterr().out


def test_piped_tables_are_whole_whatever_columns_says(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    unset = _estimate(capsys)
    monkeypatch.setenv("COLUMNS", "40")
    assert _estimate(capsys) == unset
    assert max(map(len, unset.splitlines())) > 80  # rows wider than rich's 80-column default, unwrapped


def test_a_swapped_os_environ_changes_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # datasets' map(num_proc=...) swaps os.environ for a copy; rich keeps reading the object it saw at
    # import, so a COLUMNS set in the new one was lost and tables wrapped at 80 columns.
    monkeypatch.delenv("COLUMNS", raising=False)
    whole = _estimate(capsys)
    monkeypatch.setattr(os, "environ", {**os.environ, "COLUMNS": "250"})
    assert _estimate(capsys) == whole
    assert max(map(len, whole.splitlines())) > 80
