"""`--profile START:STEPS`: a torch.profiler trace of optimizer steps START .. START+STEPS-1.

Steps are numbered from 1, as the progress lines print them. The profiler starts before the window's
first step fetches its batches and stops after its last step's update. Each step of the window is a
`ProfilerStep#N` range in the trace, N being llmtrain's step number (torch.profiler's own name for a
step, by which trace viewers and analysis tools split a trace into steps). At the window's end every
rank writes its own RUN_DIR/profile/rankR.json (Chrome trace format: https://ui.perfetto.dev or
chrome://tracing) and, on CUDA, RUN_DIR/profile/memory_rankR.pickle (the caching allocator's history
over the window, for https://pytorch.org/memory_viz); rank 0 prints the top operators and the paths.

A run resumed inside the window profiles the steps of it that remain; a run stopped inside it writes
nothing. The profiler only records: the losses are those of the same run without it
(tests/test_profile.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.profiler

from llmtrain import rundir
from llmtrain.config import TrainConfig, profile_window
from llmtrain.parallel.distributed import World
from llmtrain.train.hooks import TrainHook

TABLE_ROWS = 15
# Allocation events the memory snapshot keeps (the torch documentation's example; a few KB each).
MEMORY_HISTORY_ENTRIES = 100_000


def hooks_from_config(cfg: TrainConfig, world: World, run_dir: Path) -> list[TrainHook]:
    """The profiler hook for this rank with --profile; none otherwise."""
    if cfg.logging.profile is None:
        return []
    window = profile_window(cfg.logging.profile)
    return [StepProfiler(window, run_dir / rundir.PROFILE_DIR, world.rank, world.accelerator == "cuda")]


def top_operators(
    prof: torch.profiler.profile,
    sort_by: str = "self_cpu_time_total",
    rows: int = TABLE_ROWS,
    by_shape: bool = False,
) -> str:
    """torch.profiler's operator table: the `rows` operators with the most `sort_by` first."""
    table: str = prof.key_averages(group_by_input_shape=by_shape).table(
        sort_by=sort_by, row_limit=rows, max_name_column_width=45, max_shapes_column_width=60
    )
    return table


class StepProfiler(TrainHook):
    """Profiles the optimizer steps numbered in `window` (1-based) on one rank."""

    def __init__(self, window: range, out_dir: Path, rank: int, cuda: bool) -> None:
        self.window, self.out_dir, self.rank, self.cuda = window, out_dir, rank, cuda
        self.prof: torch.profiler.profile | None = None
        self.step_range: torch.profiler.record_function | None = None
        self.first = window.start  # a resumed run's first step inside the window

    def before_step(self, step: int) -> None:
        number = step + 1
        if number not in self.window:
            return
        if self.prof is None:
            self.first = number
            self._start()
        self.step_range = torch.profiler.record_function(f"ProfilerStep#{number}")
        self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self.step_range is None:
            return
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step + 1 == self.window[-1]:
            self._finish()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.prof.start()

    def _finish(self) -> None:
        assert self.prof is not None
        self.prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{self.rank}.json"
        tmp = trace.with_name(f".{trace.name}.tmp{os.getpid()}")
        self.prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)  # a viewer never opens half a trace
        memory = self._dump_memory() if self.cuda else None
        if self.rank == 0:
            self._report(trace, memory)
        self.prof = None  # the recorded events are written: free them

    def _dump_memory(self) -> Path:
        """The allocator's history over the window, for pytorch.org/memory_viz; recording then stops."""
        path = self.out_dir / f"memory_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        return path

    def _report(self, trace: Path, memory: Path | None) -> None:
        assert self.prof is not None
        by = "self CUDA" if self.cuda else "self CPU"
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        last = self.window[-1]
        steps = f"steps {self.first}-{last}" if last > self.first else f"step {last}"
        print(f"profile of {steps}, rank 0: top operators by {by} time", flush=True)
        print(top_operators(self.prof, sort_by), flush=True)
        print(f"profile trace: {trace} (one per rank; open in https://ui.perfetto.dev)", flush=True)
        if memory is not None:
            print(f"profile memory snapshot: {memory} (open in https://pytorch.org/memory_viz)", flush=True)
