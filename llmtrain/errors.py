"""The two kinds of error a user sees, and the exit code each maps to.

`BadInput` (exit 2): the user can fix it by changing a flag, a file or a path; the message is one line
naming what to change. `RunFailure` (exit 1): something went wrong while a run was going; the run
directory is left consistent (the last complete checkpoint is intact). The CLI maps by these base
classes only, so a new error type chooses its exit code by choosing its base.
"""

from __future__ import annotations


class BadInput(Exception):
    """Bad user input: one line `error: ...` naming the flag or file and the fix; exit code 2."""


class ConfigError(BadInput, ValueError):
    """A bad flag, key or value (named by its flag, see llmtrain.flags)."""


class RunFailure(RuntimeError):
    """A failure during a run (a dead peer, divergence, a failed save); exit code 1.

    `on_every_rank`: every rank raises it at the same point, after the collective that agreed on it (the
    stability guard's verdict, a failed save), so all peers are alive to meet at the exit's barrier."""

    on_every_rank = False


EXIT_BAD_INPUT = 2
EXIT_RUN_FAILURE = 1
