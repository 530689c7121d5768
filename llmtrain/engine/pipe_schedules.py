"""The two pipeline schedules, as DeepSpeed `PipeSchedule`s: 1F1B (DeepSpeed's TrainSchedule) and GPipe.

Both process the step's m micro-batches on `stages` stages and end with the same instructions: first
`AgreeOnUpdate` (llmtrain's: every rank learns the step's loss and whether to skip the update, before
any gradient is reduced), then DeepSpeed's tied-gradient and data-parallel reductions and the optimizer
step. They differ in order, hence in memory and idle time:

- GPipe runs all m forwards, then all m backwards: a stage holds the activations of all m micro-batches.
- 1F1B starts backwards as soon as the last stage has a loss: stage s holds at most min(stages - s, m).

Both idle for the same bubble, (stages - 1) / (m + stages - 1) of a step (planning.stages.bubble_fraction),
filling and draining the pipe.
Backwards run in micro-batch order in both, so gradients accumulate in the same order as a
one-process run's and the two schedules give bitwise-equal updates.
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.runtime.pipe import schedule as ds


class AgreeOnUpdate(ds.PipeInstruction):
    """Every rank joins one all-reduce of the step's loss and flags; a skipped update poisons this
    rank's gradients so DeepSpeed's overflow check drops the step everywhere (PipelineEngine runs it
    through llmtrain.engine.pipeline.agree_on_update)."""


def _with_agreement(cmds: list[ds.PipeInstruction]) -> list[ds.PipeInstruction]:
    """The step's closing instructions, with the agreement before any gradient is reduced."""
    for i, cmd in enumerate(cmds):
        if isinstance(cmd, ds.ReduceTiedGrads):
            return [*cmds[:i], AgreeOnUpdate(), *cmds[i:]]
    return cmds


class OneForwardOneBackward(ds.TrainSchedule):
    """DeepSpeed's 1F1B schedule, with the agreement before the reductions."""

    def steps(self) -> Iterator[list[ds.PipeInstruction]]:
        for cmds in super().steps():
            yield _with_agreement(cmds)


class GPipe(ds.PipeSchedule):
    """All forwards, then all backwards: one buffer per micro-batch.

    Each forward step receives the previous stage's activation, computes and sends it on; each backward
    step receives the next stage's gradient, computes and sends it back. Every stage walks the
    micro-batches in the same order, so a blocking send always meets its receive.
    """

    def steps(self) -> Iterator[list[ds.PipeInstruction]]:
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        for mb in range(self.micro_batches):
            cmds: list[ds.PipeInstruction] = []
            if not first:
                cmds.append(ds.RecvActivation(mb))
            if first or last:
                cmds.append(ds.LoadMicroBatch(mb))
            cmds.append(ds.ForwardPass(mb))
            if not last:
                cmds.append(ds.SendActivation(mb))
            yield cmds
        for mb in range(self.micro_batches):
            cmds = []
            if not last:
                cmds.append(ds.RecvGrad(mb))
            cmds.append(ds.BackwardPass(mb))
            if not first:
                cmds.append(ds.SendGrad(mb))
            yield cmds
        yield [AgreeOnUpdate(), ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        return self.micro_batches


SCHEDULES: dict[str, type[ds.PipeSchedule]] = {"1f1b": OneForwardOneBackward, "gpipe": GPipe}
