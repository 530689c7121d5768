"""What the trainer drives, whatever trains underneath: DeepSpeed (`ds_engine.DeepSpeedEngine`, its
pipeline variant `pipeline.PipelineEngine`) or PyTorch FSDP2 (`fsdp2.FSDP2Engine`).

One optimizer step is `run_step`: forward and backward each micro-batch, with the ranks' agreement
(global loss, skip / save / stop) taken before the last backward, then clip + update. Engines implement
the five steps below it; the pipeline engine, which runs a whole step as one schedule, overrides
`run_step` itself. The checkpoint package drives `save` / `load` under its commit protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmtrain.parallel import distributed

Batch = dict[str, Tensor]
# Called once per step with (sum of this rank's micro-batch losses, their count) before the update's
# gradients are reduced; the ranks agree there (one all-reduce in the trainer). True: skip the update.
BeforeUpdate = Callable[[Tensor, int], bool]
# Called with the global gradient norm (the same on every rank) by an engine that knows it before the
# optimizer steps (FSDP2); True: skip the update (the stability guard's grad-norm spike).
JudgeNorm = Callable[[float], bool]


def never_skip(grad_norm: float) -> bool:
    return False


class Engine(ABC):
    optimizer: Any  # param_groups carry the lr; the update's state lives here
    device: torch.device
    wrapper: torch.nn.Module  # the outermost module (DeepSpeed's engine, the fully_shard'ed model)

    # ------------------------------------------------ the five steps of an update

    @abstractmethod
    def forward(self, batch: Batch) -> Tensor:
        """This micro-batch's mean loss (a scalar that backward accepts)."""

    @abstractmethod
    def backward(self, loss: Tensor, *, last: bool, skip: bool) -> None:
        """Accumulate this micro-batch's gradients; gradients are reduced across ranks on the `last`
        one only. `skip`: every rank agreed to drop this update (known before the last backward)."""

    @abstractmethod
    def update(self, *, skip: bool, judge_norm: JudgeNorm = never_skip) -> float | None:
        """Clip, step the optimizer (unless `skip`), clear the gradients; the global gradient norm
        before clipping (non-finite: the update was dropped), None where the engine cannot know it.
        An engine that knows the norm before the optimizer steps asks `judge_norm` whether to skip;
        DeepSpeed computes it inside its step, so there the guard can only report a spike."""

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def eval_loss(self, batch: Batch) -> float:
        """The mean loss of one validation micro-batch, no gradients, in eval mode."""
        self.wrapper.eval()
        try:
            return float(self.forward(batch))
        finally:
            self.wrapper.train()

    # ------------------------------------------------ checkpoints (driven by llmtrain.checkpoint)

    @abstractmethod
    def save(self, staging_root: Path, tag: str) -> tuple[list[str], list[Path]]:
        """Write this rank's share of the model and optimizer states into `staging_root/tag`.
        Never raises for a failed write (every rank must reach the same collectives): returns the
        errors (each naming its path) and the files written, which the commit fsyncs."""

    @abstractmethod
    def load(self, ckpt_root: Path, tag: str) -> None:
        """Restore the model and optimizer states of checkpoint `tag`, without running pickled code."""

    @abstractmethod
    def checkpoint_facts(self) -> dict[str, Any]:
        """What the manifest records of the engine: `engine` (whose format) and `zero_stage`."""

    # ------------------------------------------------ one optimizer step, one evaluation

    def run_step(
        self,
        micro_batches: list[Batch],
        on_loss: Callable[[Tensor], Tensor],
        before_update: BeforeUpdate,
        judge_norm: JudgeNorm = never_skip,
    ) -> float | None:
        """Forward and backward each micro-batch, then update; returns the grad norm. `before_update`
        comes before the last backward, so a skip is known before gradients are reduced. `on_loss`
        sees each micro-batch's loss first (the fault-injection hook)."""
        *head, last_batch = micro_batches
        losses: list[Tensor] = []
        for batch in head:
            loss = on_loss(self.forward(batch))
            losses.append(loss.detach())
            self.backward(loss, last=False, skip=False)
        loss = on_loss(self.forward(last_batch))
        losses.append(loss.detach())
        skip = before_update(torch.stack(losses).double().sum(), len(losses))
        self.backward(loss, last=True, skip=skip)
        return self.update(skip=skip, judge_norm=judge_norm)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """Mean validation loss over every data-parallel rank's `batches` (0 for none)."""
        total = sum(self.eval_loss(batch) for batch in batches)
        summed, count = distributed.all_reduce_sum([total, float(len(batches))], self.device)
        return summed / max(count, 1.0)

    def to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
