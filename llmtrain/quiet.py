"""What DeepSpeed prints on its own, held back from a run's output unless `llmtrain --debug`.

A run's stdout is its progress, read by scripts. DeepSpeed reports some things with print() rather than
its logger: an op builder's "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"
(inside `deepspeed.init_distributed`) and the bf16 optimizer's memory reports ("begin bf16_optimizer",
"MA 0.38 GB ...", "CPU Virtual Memory: ...", forced on inside `deepspeed.initialize`). `held_stdout()`
holds back what such a call prints and shows it if the call fails. DeepSpeed's logger writes to the
stream it bound at import, so its warnings and errors are never held.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator

DEBUG_ENV = "LLMTRAIN_DEBUG"  # set by `llmtrain --debug`, inherited by the workers


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def held_stdout() -> Iterator[None]:
    """The block's print() output held back; written out if the block raises. Under --debug it passes."""
    if debug_requested():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stdout.write(held.getvalue())
        sys.stdout.flush()
        raise
