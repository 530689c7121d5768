"""DeepSpeed's print() chatter is held back around the calls that make it; its logger, a failure and
`--debug` still show everything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmtrain.quiet import DEBUG_ENV, held_stdout


def test_what_a_call_prints_is_held_back(capsys: pytest.CaptureFixture[str]) -> None:
    with held_stdout():
        print("MA 0.38 GB         Max_MA 0.38 GB")
    print("step 1/2")
    assert capsys.readouterr().out == "step 1/2\n"


def test_what_a_failing_call_printed_is_shown_before_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="no shm"), held_stdout():
        print("building the shm op")
        raise RuntimeError("no shm")
    assert capsys.readouterr().out == "building the shm op\n"


def test_debug_lets_everything_through(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1")
    with held_stdout():
        print("begin bf16_optimizer")
    assert capsys.readouterr().out == "begin bf16_optimizer\n"


def test_deepspeed_s_warnings_are_never_held() -> None:
    """DeepSpeed's logger writes to the stdout it found at import, not to the one held_stdout swaps in."""
    code = (
        "from deepspeed.utils import logger\n"
        "from llmtrain.quiet import held_stdout\n"
        "with held_stdout():\n"
        "    print('chatter')\n"
        "    logger.warning('a real problem')\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop(DEBUG_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "a real problem" in proc.stdout and "chatter" not in proc.stdout, proc.stdout
