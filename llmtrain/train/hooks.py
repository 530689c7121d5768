"""Named points in the training loop where extra behaviour plugs in, instead of inline calls.

A hook subclasses `TrainHook` and overrides the points it needs; the Trainer calls each point on every
registered hook, in registration order:
- `before_step(step)`: before optimizer step `step` (0-based) fetches its batches;
- `on_forward(loss, step) -> loss`: after each micro-batch's forward (0-based optimizer step being
  computed); returns the loss to use (a hook may replace it);
- `after_step(step)`: after the optimizer step `step` (0-based) is done, before it is counted;
- `after_save()`: after each checkpoint save, whether it succeeded or not.
Fault injection (`llmtrain.train.faults`) is one such hook, registered only when LLMTRAIN_FAULTS is set;
the profiler (`llmtrain.train.profile`) another, registered only with --profile.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the launching process imports these modules and never torch
    import torch


class TrainHook:
    """Every point does nothing; a hook overrides the ones it needs."""

    def before_step(self, step: int) -> None:
        return None

    def on_forward(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss

    def after_step(self, step: int) -> None:
        return None

    def after_save(self) -> None:
        return None


class Hooks(TrainHook):
    """The registered hooks, called in order at each point (with none, every point is a no-op)."""

    def __init__(self, hooks: Iterable[TrainHook] = ()) -> None:
        self.hooks = list(hooks)

    def add(self, hook: TrainHook) -> None:
        self.hooks.append(hook)

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def on_forward(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        for hook in self.hooks:
            loss = hook.on_forward(loss, step)
        return loss

    def after_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(step)

    def after_save(self) -> None:
        for hook in self.hooks:
            hook.after_save()
