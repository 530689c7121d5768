"""The rich Console every table and log line is printed on.

rich wraps output at the console's width, which it takes from the terminal, else from COLUMNS, else 80,
reading COLUMNS from the `os.environ` object that existed when rich was imported (a library that swaps
`os.environ` for a copy, as datasets' `map(num_proc=...)` does, leaves rich reading a stale mapping).
Output that is not a terminal (a pipe, a file, a log collector, a test) therefore gets a fixed width wide
enough for every table llmtrain prints: its rows are never wrapped, whatever the environment says.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from rich.console import Console

PIPED_WIDTH = 1000  # wider than any table or log line llmtrain prints; tables keep their natural width


def console(file: TextIO | None = None, stderr: bool = False, **options: Any) -> Console:
    """A Console on `file` (default stdout, or stderr): the terminal's width on a terminal, else PIPED_WIDTH."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    terminal = options.get("force_terminal") or _isatty(stream)
    width = None if terminal else PIPED_WIDTH
    return Console(file=file, stderr=stderr, width=width, **options)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
