"""Data, tensor, sequence and pipeline parallelism, alone and together: memory per rank and throughput,
in one run.

`python -m bench parallel` (defaults) or `python -m bench.bench_parallel [--preset ...]` (flags below).
Six layouts of the same model, ZeRO 1: on world size 2 dp2 (two data-parallel ranks), tp2 (llmtrain's
column/row-parallel layers: each rank holds half of every attention and MLP matrix) and sp2 (DeepSpeed
Ulysses: each rank computes half of every sequence); on 4 and 8 processes the axes together: tp2 x pp2,
dp2 x tp2 x pp2 and tp2 x sp2. Each layout is its own group of processes (DeepSpeed's process groups are
per-process globals, so one process runs one layout), built by `ds_engine.build_engine` (or, under pp,
`pipeline.build_engine`) as `llmtrain train --tp/--sp/--pp` builds it; all 22 processes are alive
together and the groups take steps in turn (A B C ..., ... C B A), so load from other work on the
machine falls on all layouts alike. A pipeline's step is 2 x pp micro-batches (one train_batch).

Measured per layout:
1. Model states per rank: the bytes of parameters, gradients and optimizer states the engine holds
   (every tensor it and its optimizer reference, each storage once, after a backward so the gradients
   are held), as tests/test_memory_calibration.py counts them against the memory estimator.
2. Step peak per rank: the memory one optimizer step needs above what is resident before it
   (bench_train.measure_step_memory: peak RSS minus RSS on CPU), the larger of the two ranks.
3. Throughput: tokens of the whole job per second, median over the measured steps after warm-up. tp, sp
   and pp ranks share their samples, so per step the job trains dp x micro-batch x seq_len tokens
   (times the micro-batches of a pipeline's step). With more processes than cores the larger layouts
   share the cores: their tokens/s measures this machine's oversubscription as much as the layout.
4. The longest seq_len whose step peak fits a per-rank budget, dp2 against sp2: the step peak measured
   at a few seq_lens, a straight line fitted per layout and solved for the budget. The output says
   whether that seq_len lies within the measured range or is extrapolated beyond it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.bench_train import THREADS, measure_step_memory, random_batches
from bench.ranks import REPO, RankGroup, all_ready, serve_commands, write_result

DEFAULT_OUT = REPO / "bench" / "results" / "parallel.json"
# name -> (world size, tp, sp, pp); the first is the baseline of every ratio.
LAYOUTS = {
    "dp2": (2, 1, 1, 1),
    "tp2": (2, 2, 1, 1),
    "sp2": (2, 1, 2, 1),
    "tp2xpp2": (4, 2, 1, 2),
    "dp2xtp2xpp2": (8, 2, 1, 2),
    "tp2xsp2": (4, 2, 2, 1),
}
BUDGET_LAYOUTS = ("dp2", "sp2")  # whose step peak is measured at every --memory-seq-lens
# A fitted seq_len is rounded down to a multiple of this: the fit is not finer, and the result stays
# divisible by sp.
SEQ_LEN_STEP = 64


@dataclass(frozen=True)
class Setup:
    """One layout's group of workers and the shape every layout shares."""

    name: str
    world_size: int
    tp: int
    sp: int
    pp: int
    preset: str
    precision: str
    seq_len: int
    micro_batch: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.sp * self.pp)

    @property
    def micro_batches(self) -> int:
        """Per step: one, or 2 x pp for a pipeline (a pipeline of one micro-batch is all bubble)."""
        return 2 * self.pp if self.pp > 1 else 1

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.micro_batches * self.micro_batch * self.seq_len


# ---------------------------------------------------------------- the worker side


def _config(setup: Setup) -> Any:
    from llmtrain.config import resolve

    return resolve(
        flags={
            "preset": setup.preset,
            "zero.stage": 1,
            "train.precision": setup.precision,
            "train.micro_batch": setup.micro_batch,
            "train.seq_len": setup.seq_len,
            "train.global_batch": setup.dp * setup.micro_batches * setup.micro_batch,
            "parallel.tp": setup.tp,
            "parallel.sp": setup.sp,
            "parallel.pp": setup.pp,
            "train.compile": False,  # eager everywhere: the default compiles only some of the setups
            "launch.gpus": setup.world_size,
        }
    )


class Runner:
    """The layout's engine as `llmtrain train` builds it, stepped on the benchmark's random batches."""

    def __init__(self, setup: Setup) -> None:
        from llmtrain.engine import ds_engine, pipeline
        from llmtrain.parallel import distributed
        from llmtrain.planning import dsconfig

        cfg = _config(setup)
        world = distributed.init()
        self.device = world.device
        self.vocab_size = cfg.model.vocab_size
        self.micro_batch, self.micro_batches = setup.micro_batch, setup.micro_batches
        ds_config = dsconfig.build(cfg, world.world_size, world.accelerator)
        build = pipeline.build_engine if setup.pp > 1 else ds_engine.build_engine
        self.engine = build(cfg, ds_config, world.device, world.world_size).ds
        self.pipelined = setup.pp > 1
        self.engine.before_update = lambda loss_sum, count: False  # the trainer's agreement: never skip
        self.batches: dict[int, list[dict[str, Any]]] = {}
        self.steps = 0

    def _batch(self, seq_len: int) -> dict[str, Any]:
        # Every rank draws the same batches: tp and sp ranks must see the same samples.
        if seq_len not in self.batches:
            self.batches[seq_len] = random_batches(self.vocab_size, self.micro_batch, seq_len)
        batches = self.batches[seq_len]
        return {k: v.to(self.device) for k, v in batches[self.steps % len(batches)].items()}

    def backward(self, seq_len: int) -> float:
        loss = self.engine(**self._batch(seq_len))
        self.engine.backward(loss)
        self.steps += 1
        return float(loss.detach())

    def step(self, seq_len: int) -> float:
        import torch

        if self.pipelined:
            loss = self._train_batch(seq_len)
        else:
            loss = self.backward(seq_len)
            self.engine.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return loss

    def _train_batch(self, seq_len: int) -> float:
        """One pipeline step: every micro-batch through the schedule, then the update. The loss is the
        last stage's (DeepSpeed broadcasts it to every stage)."""
        from llmtrain.engine import pipeline

        batches = [self._batch(seq_len) for _ in range(self.micro_batches)]
        self.steps += self.micro_batches - 1
        return float(self.engine.train_batch(pipeline.feed(batches)))

    def states(self, seq_len: int) -> Any:
        """The model states held as an update starts (gradients reduced, Adam's moments there)."""
        from llmtrain.engine.ds_engine import held_model_states

        if not self.pipelined:
            self.backward(seq_len)
            held = held_model_states(self.engine)
            self.engine.step()
            return held
        # train_batch runs forward, backward and update as one schedule: the measurement rides in the
        # update's instruction.
        from deepspeed.runtime.pipe.schedule import OptimizerStep

        found: list[Any] = []
        instructions = self.engine._INSTRUCTION_MAP
        update = instructions[OptimizerStep]

        def measured_update(engine: Any, **kwargs: Any) -> None:
            found.append(held_model_states(engine))
            update(engine, **kwargs)

        self.engine._INSTRUCTION_MAP = {**instructions, OptimizerStep: measured_update}
        try:
            self._train_batch(seq_len)
        finally:
            self.engine._INSTRUCTION_MAP = instructions
        return found[0]


def answer(runner: Runner, setup: Setup, command: str, args: list[str]) -> dict[str, Any]:
    """The reply to one command from the parent."""
    if command == "step":
        started = time.perf_counter()
        loss = runner.step(setup.seq_len)
        return {"seconds": time.perf_counter() - started, "loss": loss}
    if command == "states":
        held = runner.states(setup.seq_len)
        return {"params": held.params, "total": held.total}
    if command == "memory":
        seq_len = int(args[0])
        if seq_len not in runner.batches:
            runner.step(seq_len)  # the first step at a length allocates what is sized by it and kept
        return measure_step_memory(lambda: runner.step(seq_len), runner.device)
    raise ValueError(f"unknown command {command!r}")


def worker(setup: Setup) -> None:
    """Build the layout's engine, then answer `step`, `states` and `memory SEQ_LEN` until `quit`
    (ranks.serve_commands)."""
    import torch

    from llmtrain.parallel import distributed

    torch.set_num_threads(THREADS)

    def build() -> Callable[[str, list[str]], dict[str, Any]]:
        runner = Runner(setup)
        return lambda command, args: answer(runner, setup, command, args)

    serve_commands(build)
    distributed.shutdown()  # barrier and destroy_process_group: without them gloo aborts at exit now and then


# ---------------------------------------------------------------- the parent side


class Layout(RankGroup):
    """The ranks of one layout, and the step times and losses measured on them."""

    def __init__(self, setup: Setup, log_dir: Path) -> None:
        super().__init__("bench.bench_parallel", setup, setup.world_size, log_dir)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self) -> None:
        """One optimizer step on every rank; the step takes as long as its slowest rank."""
        replies = self.ask("step")
        self.times.append(max(r["seconds"] for r in replies))
        self.losses.append(replies[0]["loss"])


@dataclass(frozen=True)
class Measured:
    """One layout's figures, per rank unless said otherwise (the larger rank's where they differ)."""

    setup: Setup
    param_bytes: int
    state_bytes: int
    tokens_per_sec: float  # the whole job's
    step_peak_mib: dict[int, float]  # seq_len -> step peak
    losses: list[float]
    step_times_s: list[float]  # every step, warm-up included


def measure(setups: list[Setup], args: argparse.Namespace, log_dir: Path) -> list[Measured]:
    """Interleaved timed steps of every layout, then each one's model states and step peaks."""
    with all_ready(Layout(setup, log_dir) for setup in setups) as group:
        for round_ in range(args.warmup + args.steps):
            for layout in group if round_ % 2 == 0 else reversed(group):
                layout.step()
        results = []
        for layout in group:
            states = layout.ask("states")
            seq_lens = args.memory_seq_lens if layout.setup.name in BUDGET_LAYOUTS else [args.seq_len]
            peaks = {n: max(r["step_peak_mib"] for r in layout.ask(f"memory {n}")) for n in seq_lens}
            median_s = statistics.median(layout.times[args.warmup :])
            results.append(
                Measured(
                    setup=layout.setup,
                    param_bytes=max(s["params"] for s in states),
                    state_bytes=max(s["total"] for s in states),
                    tokens_per_sec=layout.setup.tokens_per_step / median_s,
                    step_peak_mib=peaks,
                    losses=layout.losses,
                    step_times_s=layout.times,
                )
            )
    return results


# ---------------------------------------------------------------- the seq_len that fits a budget


@dataclass(frozen=True)
class Fit:
    """step peak (MiB) = intercept + slope * seq_len, least squares over the measured seq_lens."""

    intercept: float
    slope: float
    max_residual: float

    @classmethod
    def of(cls, points: dict[int, float]) -> Fit:
        xs, ys = list(points), list(points.values())
        slope, intercept = statistics.linear_regression(xs, ys)
        residual = max(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys, strict=True))
        return cls(intercept, slope, residual)

    def longest_seq_len(self, budget_mib: float) -> int:
        """The longest seq_len (a multiple of SEQ_LEN_STEP) whose fitted peak is within the budget; 0 if none."""
        if self.slope <= 0:
            raise ValueError(f"step peak does not grow with seq_len (slope {self.slope:.4f} MiB/token)")
        longest = (budget_mib - self.intercept) / self.slope
        return max(0, int(longest) // SEQ_LEN_STEP * SEQ_LEN_STEP)


# ---------------------------------------------------------------- printing


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def print_table(results: list[Measured], default_seq: int) -> dict[str, Any]:
    base = results[0]
    print(
        f"  {'layout':<12}{'procs':>6}{'model states/rank':>20}{'(params)':>14}{'step peak/rank':>17}"
        f"{'tokens/s (job)':>17}   loss first -> last"
    )
    out: dict[str, Any] = {}
    for m in results:
        peak = m.step_peak_mib[default_seq]
        print(
            f"  {m.setup.name:<12}{m.setup.world_size:>6}{_mib(m.state_bytes):>20}{_mib(m.param_bytes):>14}"
            f"{peak:>13,.0f} MiB{m.tokens_per_sec:>17,.0f}   {m.losses[0]:.3f} -> {m.losses[-1]:.3f}"
        )
        out[m.setup.name] = {
            "model_state_bytes": m.state_bytes,
            "param_bytes": m.param_bytes,
            "step_peak_mib": peak,
            "tokens_per_sec": m.tokens_per_sec,
            "step_peaks_mib_by_seq_len": m.step_peak_mib,
            "step_times_s": m.step_times_s,
            "losses": m.losses,
        }
    for m in results[1:]:
        ratios = {
            "model_states": m.state_bytes / base.state_bytes,
            "step_peak": m.step_peak_mib[default_seq] / base.step_peak_mib[default_seq],
            "tokens_per_sec": m.tokens_per_sec / base.tokens_per_sec,
        }
        print(
            f"  {m.setup.name}/{base.setup.name}: model states {ratios['model_states']:.2f}x, "
            f"step peak {ratios['step_peak']:.2f}x, tokens/s {ratios['tokens_per_sec']:.2f}x"
        )
        out[m.setup.name]["ratios_to_" + base.setup.name] = ratios
    return out


def print_budget(results: list[Measured], budget_mib: float) -> dict[str, Any]:
    by_name = {m.setup.name: m for m in results}
    out: dict[str, Any] = {}
    for name in BUDGET_LAYOUTS:
        m = by_name[name]
        fit = Fit.of(m.step_peak_mib)
        longest = fit.longest_seq_len(budget_mib)
        measured = ", ".join(f"{n}: {p:,.0f}" for n, p in m.step_peak_mib.items())
        where = (
            "interpolated: within the measured seq_lens"
            if longest <= max(m.step_peak_mib)
            else "EXTRAPOLATED beyond the largest measured seq_len"
        )
        print(
            f"  {name}: measured step peak (MiB) {measured}; fitted {fit.intercept:,.0f} MiB + "
            f"{fit.slope * 1024:,.1f} MiB per 1k tokens of seq_len (largest residual {fit.max_residual:,.1f} MiB)"
            f" -> longest seq_len {longest:,} ({where})"
        )
        out[name] = {
            "measured_step_peak_mib": m.step_peak_mib,
            "fit": asdict(fit),
            "longest_seq_len": longest,
        }
    ratio = out["sp2"]["longest_seq_len"] / max(out["dp2"]["longest_seq_len"], 1)
    print(f"  sp2/dp2 longest seq_len within {budget_mib:,.0f} MiB: {ratio:.2f}x")
    out["sp2_over_dp2"] = ratio
    return out


# ---------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_parallel", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", default="tiny", help="model size (llmtrain's presets)")
    # fp32 by default: on a CPU without bf16 matmuls (AVX2 only) bf16 runs about 250x slower, and the
    # ratios compare layouts, not precisions.
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seq-len", type=int, default=256, help="seq_len of the timed steps")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (the median counts)")
    parser.add_argument(
        "--memory-seq-lens",
        type=lambda s: sorted({int(n) for n in s.split(",")}),
        default=[256, 512, 1024],
        help="comma-separated seq_lens whose step peak is measured (the fit's points)",
    )
    # 512 MiB: with the default shape both answers fall within the measured seq_lens. At 1,024 MiB the
    # line extrapolated sp2 to 1,920 tokens, where its peak measured 16% above the line.
    parser.add_argument("--budget-mib", type=float, default=512.0, help="per-rank step-peak budget")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    args = parser.parse_args(argv)
    args.memory_seq_lens = sorted({*args.memory_seq_lens, args.seq_len})
    if len(args.memory_seq_lens) < 2 or any(n % 2 for n in args.memory_seq_lens):
        parser.error("the fit needs at least two seq_lens, and sp2 needs each to be even")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    from llmtrain import rundir
    from llmtrain.presets import PRESETS, count_parameters

    args = parse_args(argv or [])
    setups = [
        Setup(name, world, tp, sp, pp, args.preset, args.precision, args.seq_len, args.micro_batch)
        for name, (world, tp, sp, pp) in LAYOUTS.items()
    ]
    params = count_parameters(**PRESETS[args.preset])
    print(
        f"{args.preset} preset ({params / 1e6:.1f}M parameters), {args.precision}, ZeRO 1, "
        f"{THREADS} thread(s) per rank (BENCH_THREADS), micro-batch {args.micro_batch} per rank (2 x pp "
        f"of them per pipeline step), seq_len {args.seq_len}; layouts in their own process groups, steps "
        f"interleaved; median over {args.steps} steps after {args.warmup} warm-up"
    )
    with tempfile.TemporaryDirectory(prefix="bench_parallel-") as tmp:
        results = measure(setups, args, Path(tmp))
    print(
        "Measured (model states as the update starts, on the largest rank; step peak above resident memory):"
    )
    table = print_table(results, args.seq_len)
    print(
        f"Longest seq_len whose step peak fits {args.budget_mib:,.0f} MiB per rank at micro-batch "
        f"{args.micro_batch}: step peak measured at seq_len {', '.join(map(str, args.memory_seq_lens))}, "
        "a straight line fitted per layout and solved for the budget:"
    )
    budget = print_budget(results, args.budget_mib)
    result = {
        # Not the output path: the file is where it is, and the path would name this machine.
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "parameters": params,
        "machine": rundir.environment(max(s.world_size for s in setups)),
        "layouts": table,
        "budget": budget,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Setup(**json.loads(sys.argv[2])))
    else:
        main(sys.argv[1:])
