"""Fault injection for the reliability tests, driven by one environment variable.

LLMTRAIN_FAULTS="nan_loss@1:3,4;exit@1:5;hang@0:2;disk_full@1:3" means: rank 1 sees a NaN loss at
steps 3 and 4 (0-based optimizer step being computed), rank 1 exits abruptly after finishing step 5,
rank 0 blocks forever before step 2's collective, and file writes on rank 1 fail (EFBIG, through
RLIMIT_FSIZE) from the end of step 3 to the end of the next checkpoint save (put STEP right before one). A `#first` suffix (`exit@1:5#first`)
limits a fault to the first attempt of an elastic launcher (torchrun's TORCHELASTIC_RESTART_COUNT 0), so
the restarted job runs clean. `grad_spike@0:6` multiplies rank 0's gradients at step 6 by
GRAD_SPIKE_FACTOR while leaving its loss as it was: a gradient-norm spike with no loss spike.
`slow@0:5` has rank 0 wait SLOW_STEP_S before every step from step 5 on, which slows the whole run
(the other ranks wait for it in the next collective) and changes no number: a window in which a test's
signal surely lands mid-run. Unset (always, outside tests) it does nothing at all: no hook is
registered. A malformed value is bad input (`ConfigError`, one line naming LLMTRAIN_FAULTS and the syntax).

`Faults` is a loop hook (`llmtrain.train.hooks`): `on_forward` poisons or hangs, `after_step` exits or
fills the disk, `after_save` frees it.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmtrain.config import ConfigError
from llmtrain.train.hooks import TrainHook

if TYPE_CHECKING:  # annotations only (the launching process checks LLMTRAIN_FAULTS without torch)
    import torch

ENV = "LLMTRAIN_FAULTS"
FIRST_ATTEMPT_ONLY = "#first"
KINDS = ("nan_loss", "exit", "hang", "disk_full", "grad_spike", "slow")
GRAD_SPIKE_FACTOR = 1000.0
SLOW_STEP_S = 0.15
SYNTAX = (
    f"KIND@RANK:STEP[,STEP...][{FIRST_ATTEMPT_ONLY}] items separated by ';' with KIND one of "
    f"{', '.join(KINDS)} (e.g. nan_loss@1:3,4;exit@0:5#first)"
)
_ITEM = re.compile(r"(?P<kind>[a-z_]+)@(?P<rank>[0-9]+):(?P<steps>[0-9]+(?:,[0-9]+)*),?(?P<only>#first)?")
_FULL_DISK_BYTES = 1024  # file size limit while the disk is "full": small enough for any checkpoint file


@dataclass
class Faults(TrainHook):
    nan_loss_steps: set[int] = field(default_factory=set)
    exit_after_step: int | None = None
    hang_at_step: int | None = None
    disk_full_after_steps: set[int] = field(default_factory=set)
    grad_spike_steps: set[int] = field(default_factory=set)
    slow_from_step: int | None = None
    _saved_fsize: tuple[int, int] | None = None

    def on_forward(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        if self.hang_at_step == step:
            _hang()
        if self.slow_from_step is not None and step >= self.slow_from_step:
            time.sleep(SLOW_STEP_S)
        if step in self.grad_spike_steps:
            # The same value, GRAD_SPIKE_FACTOR times the gradient.
            return loss * GRAD_SPIKE_FACTOR - (loss * (GRAD_SPIKE_FACTOR - 1)).detach()
        return loss * float("nan") if step in self.nan_loss_steps else loss

    def after_step(self, step: int) -> None:
        if self.exit_after_step == step:
            os._exit(17)  # a crash: no cleanup, no barrier, no save
        # The checkpoint (if one is due) is written right after this step; after_save frees the disk.
        if step in self.disk_full_after_steps and self._saved_fsize is None:
            self._saved_fsize = resource.getrlimit(resource.RLIMIT_FSIZE)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (_FULL_DISK_BYTES, self._saved_fsize[1]))

    def after_save(self) -> None:
        if self._saved_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self._saved_fsize)
            self._saved_fsize = None


def _hang() -> None:
    """A rank stuck before a collective: the others must time out, not hang. Like a rank blocked in C
    code, it does not finish its step on SIGTERM; the launcher's signal ends it at once."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))
    while True:
        time.sleep(3600)


def first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


@dataclass(frozen=True)
class Item:
    kind: str
    rank: int
    steps: tuple[int, ...]
    first_attempt_only: bool


def parse(value: str) -> list[Item]:
    """The items of an LLMTRAIN_FAULTS value, all of them checked (whichever rank they are for)."""
    items = []
    for text in filter(None, (part.strip() for part in value.split(";"))):
        match = _ITEM.fullmatch(text)
        if match is None or match["kind"] not in KINDS:
            raise ConfigError(f"{ENV}: bad item {text!r}; expected {SYNTAX}")
        steps = tuple(int(s) for s in match["steps"].split(","))
        items.append(Item(match["kind"], int(match["rank"]), steps, match["only"] is not None))
    return items


def hooks_from_env(rank: int) -> list[TrainHook]:
    """The fault hook for this rank when LLMTRAIN_FAULTS is set (and not empty); none otherwise."""
    return [from_env(rank)] if os.environ.get(ENV, "").strip() else []


def from_env(rank: int) -> Faults:
    faults = Faults()
    for item in parse(os.environ.get(ENV, "")):
        if item.rank != rank or (item.first_attempt_only and not first_attempt()):
            continue
        kind, numbers = item.kind, item.steps
        if kind == "nan_loss":
            faults.nan_loss_steps.update(numbers)
        elif kind == "exit":
            faults.exit_after_step = numbers[0]
        elif kind == "hang":
            faults.hang_at_step = numbers[0]
        elif kind == "grad_spike":
            faults.grad_spike_steps.update(numbers)
        elif kind == "slow":
            faults.slow_from_step = numbers[0]
        else:
            faults.disk_full_after_steps.update(numbers)
    return faults
