"""What every benchmark test checks first: the result was printed once, as one JSON line, and written
to the results file unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def assert_printed_and_written(printed: str, result: dict[str, Any], out: Path) -> None:
    json_lines = [line for line in printed.splitlines() if line.startswith("{")]
    assert len(json_lines) == 1 and json.loads(json_lines[0]) == result
    assert json.loads(out.read_text()) == result
