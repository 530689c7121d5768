"""Fault injection for the reliability tests, driven by one environment variable.

LLMTRAIN_FAULTS="nan_loss@1:3,4;exit@1:5;hang@0:2" means: rank 1 sees a NaN loss at steps 3 and 4
(0-based optimizer step being computed), rank 1 exits abruptly after finishing step 5, rank 0 blocks
forever before step 2's collective. Unset (always, outside tests) it does nothing at all.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

ENV = "LLMTRAIN_FAULTS"


@dataclass
class Faults:
    nan_loss_steps: set[int] = field(default_factory=set)
    exit_after_step: int | None = None
    hang_at_step: int | None = None

    def corrupt_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        if self.hang_at_step == step:
            while True:  # a rank stuck before a collective: the others must time out, not hang
                time.sleep(3600)
        return loss * float("nan") if step in self.nan_loss_steps else loss

    def after_step(self, step: int) -> None:
        if self.exit_after_step == step:
            os._exit(17)  # a crash: no cleanup, no barrier, no save


def from_env(rank: int) -> Faults:
    faults = Faults()
    for item in filter(None, os.environ.get(ENV, "").split(";")):
        kind, _, where = item.partition("@")
        fault_rank, _, steps = where.partition(":")
        if int(fault_rank) != rank:
            continue
        numbers = [int(s) for s in steps.split(",") if s]
        if kind == "nan_loss":
            faults.nan_loss_steps.update(numbers)
        elif kind == "exit":
            faults.exit_after_step = numbers[0]
        elif kind == "hang":
            faults.hang_at_step = numbers[0]
        else:
            raise ValueError(f"{ENV}: unknown fault {kind!r}")
    return faults
