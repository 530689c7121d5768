"""DeepSpeed ZeRO-3 against PyTorch FSDP2 (`--engine fsdp2 --zero 3`) on two processes: throughput,
memory per rank and the losses, in one run.

`python -m bench engines` (defaults) or `python -m bench.bench_engines [--preset ...]` (flags below).
The same model, data and batch on both engines, world size 2 (gloo on CPU), each engine in its own pair
of processes (DeepSpeed's state is per-process and global), built as `llmtrain train` builds it:
`engine.build.engine_config` + `engine.build.build_engine`. Both are driven through the
engine interface the trainer drives (set_lr, forward, backward(last=True), update), one micro-batch per
rank per step, a constant LR. Each rank trains on its own random batches, the same on both engines.
The two pairs take steps in turn (A B, B A, ...), so load from other work on the machine falls on both
alike; the ranks of a pair start each step together (a barrier, outside the timing). One row per
precision; the rows run one after the other.

Measured per engine and precision:
1. Throughput: tokens of the job per second, median over the timed steps after warm-up (a step takes
   as long as its slower rank); and the CPU seconds a rank's process spends in a step (the larger
   rank's, median), which other work on a shared machine inflates far less than the wall time.
2. Model states per rank: the bytes of parameters, gradients and optimizer states the engine holds,
   after a backward (the gradients held, as at a step's peak), each storage once, as the memory
   estimator's calibration counts them: `ds_engine.held_model_states` and `fsdp2.held_model_states`.
3. Step peak per rank: the memory one optimizer step needs above what is resident before it
   (bench_train.measure_step_memory: peak RSS minus RSS on CPU, peak minus current allocation on GPU),
   and the resident memory before it (the whole process: libraries, buffers and model states).
4. The losses: every step's loss on every rank and, after the last update, each rank's evaluation
   loss on its first batch. In fp32 both engines run the same exact AdamW on the same gradients, so
   they must agree within FP32_LOSS_RTOL (relative): the benchmark fails otherwise. In bf16 both
   compute with the same bf16 rounding of fp32 master weights, but DeepSpeed reduce-scatters the
   gradients in bf16 (its communication_data_type) and FSDP2 in fp32 (reduce_dtype), so there the
   losses need only be close (BF16_LOSS_RTOL); the check still fails loudly beyond it.

Prints a table, the FSDP2 / DeepSpeed ratios and the results as one JSON line, also written to
bench/results/engines.json (--out) with the machine, the versions and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.bench_train import THREADS, measure_step_memory, random_batches
from bench.ranks import REPO, RankGroup, all_ready, serve_commands, write_result

if TYPE_CHECKING:
    from llmtrain.engine.ds_engine import HeldStates

WORLD_SIZE = 2
ENGINES = ("deepspeed", "fsdp2")  # the baseline first: ratios are fsdp2 / deepspeed
# fp32: the same arithmetic but for rounding (e.g. the order in which the gradient norm is summed), which
# training amplifies: measured with the defaults (tiny, 15 steps), 1e-7 relative (one rounding) over
# the first 10 steps, 4e-6 at the largest (step 14). Many more steps may need a looser limit.
FP32_LOSS_RTOL = 1e-5
# bf16: the gradients' reductions round differently (see the docstring), and the two trajectories drift
# apart as training goes on. Measured with the defaults (tiny, 15 steps): 1e-4 relative in the first 5
# steps, 2.3e-2 at the largest (step 13). The loss falls from 9.05 to about 7.7 in those steps, so an
# update that does nothing would be about 17% off.
BF16_LOSS_RTOL = 5e-2
LOSS_RTOL = {"fp32": FP32_LOSS_RTOL, "bf16": BF16_LOSS_RTOL}
DEFAULT_OUT = REPO / "bench" / "results" / "engines.json"


@dataclass(frozen=True)
class Setup:
    """One engine's pair of workers at one precision, and the shape every setup shares."""

    engine: str
    precision: str
    preset: str
    seq_len: int
    micro_batch: int

    @property
    def name(self) -> str:
        return f"{self.engine} {self.precision}"

    @property
    def tokens_per_step(self) -> int:
        return WORLD_SIZE * self.micro_batch * self.seq_len


# ---------------------------------------------------------------- the worker side


def _config(setup: Setup) -> Any:
    from llmtrain.config import resolve

    return resolve(
        flags={
            "preset": setup.preset,
            "train.engine": setup.engine,
            "zero.stage": 3,  # FSDP2: reshard after forward
            "train.precision": setup.precision,
            "train.micro_batch": setup.micro_batch,  # global batch: micro-batch x 2, no accumulation
            "train.seq_len": setup.seq_len,
            "train.steps": 1000,  # the run's length, which the LR schedule reads: more than the bench takes
            "train.compile": False,  # eager everywhere: the default compiles only some of the setups
            "schedule.name": "constant",
            "schedule.warmup_steps": 0,
            "launch.gpus": WORLD_SIZE,
        }
    )


def _build(cfg: Any, world: Any) -> Any:
    """The engine exactly as `llmtrain train` builds it (train.trainer.build_trainer)."""
    from llmtrain.engine.build import build_engine, engine_config

    return build_engine(cfg, world, engine_config(cfg, world))


class Runner:
    """One engine on this rank, stepped as the trainer steps it on the benchmark's batches."""

    def __init__(self, setup: Setup) -> None:
        from llmtrain.parallel import distributed

        self.cfg = _config(setup)
        world = distributed.init()
        self.rank, self.device = world.rank, world.device
        self.engine = _build(self.cfg, world)
        self.batches = random_batches(self.cfg.model.vocab_size, setup.micro_batch, setup.seq_len)
        self.steps = 0
        self.losses: list[float] = []

    def _batch(self, step: int) -> dict[str, Any]:
        # Each rank its own batch (data parallelism), the same one on both engines.
        return self.batches[(step * WORLD_SIZE + self.rank) % len(self.batches)]

    def backward(self) -> None:
        from llmtrain.train import schedule

        self.engine.set_lr(schedule.lr_for(self.cfg, self.steps))
        loss = self.engine.forward(self._batch(self.steps))
        self.engine.backward(loss, last=True, skip=False)
        self.losses.append(float(loss.detach()))

    def update(self) -> None:
        import torch

        self.engine.update(skip=False)
        self.steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        self.backward()
        self.update()

    def held_states(self) -> HeldStates:
        from llmtrain.engine import ds_engine, fsdp2

        if self.cfg.train.engine == "fsdp2":
            return fsdp2.held_model_states(self.engine)
        return ds_engine.held_model_states(self.engine.ds)

    def final_loss(self) -> float:
        """The loss after every update: the evaluation loss of this rank's first batch."""
        return self.engine.eval_loss(self._batch(0))


def answer(runner: Runner, command: str) -> dict[str, Any]:
    """The reply to one command from the parent."""
    import torch.distributed as dist

    if command == "step":
        dist.barrier()  # both ranks start together: the step's time is not the wait for the peer
        started, cpu_started = time.perf_counter(), time.process_time()
        runner.step()
        return {
            "seconds": time.perf_counter() - started,
            "cpu_seconds": time.process_time() - cpu_started,
            "loss": runner.losses[-1],
        }
    if command == "states":
        runner.backward()
        held = runner.held_states()
        runner.update()
        return {"param_bytes": held.params, "model_state_bytes": held.total}
    if command == "memory":
        return measure_step_memory(runner.step, runner.device)
    if command == "losses":
        return {"losses": runner.losses, "final_loss": runner.final_loss()}
    raise ValueError(f"unknown command {command!r}")


def worker(setup: Setup) -> None:
    """Build the engine, then answer `step`, `states`, `memory` and `losses` until `quit` (ranks.serve_commands)."""
    import torch

    from llmtrain.parallel import distributed

    torch.set_num_threads(THREADS)

    def build() -> Callable[[str, list[str]], dict[str, Any]]:
        runner = Runner(setup)
        return lambda command, args: answer(runner, command)

    serve_commands(build)
    distributed.shutdown()  # barrier and destroy_process_group: without them gloo aborts at exit now and then


# ---------------------------------------------------------------- the parent side


def run_row(setups: list[Setup], args: argparse.Namespace, log_dir: Path) -> dict[str, dict[str, Any]]:
    """Interleaved steps of the engines at one precision, then each one's states, memory and losses:
    every rank's raw replies, by engine. Every engine gets the same commands, so the same updates."""
    samples: dict[str, dict[str, Any]] = {s.engine: {"steps": []} for s in setups}
    with all_ready(RankGroup("bench.bench_engines", s, WORLD_SIZE, log_dir) for s in setups) as group:
        for round_ in range(args.warmup + args.steps):
            for pair in group if round_ % 2 == 0 else reversed(group):
                samples[pair.setup.engine]["steps"].append(pair.ask("step"))
        for pair in group:
            got = samples[pair.setup.engine]
            got["states"] = pair.ask("states")
            got["memory"] = [pair.ask("memory") for _ in range(args.memory_steps)]
            got["losses"] = pair.ask("losses")
    return samples


# ---------------------------------------------------------------- the figures


def engine_figures(setup: Setup, raw: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One engine's samples and what they give: median step time, tokens/s, the larger rank's memory."""
    timed = raw["steps"][warmup:]
    step_s = [max(rank["seconds"] for rank in step) for step in timed]
    cpu_s = [max(rank["cpu_seconds"] for rank in step) for step in timed]
    per_rank_memory = [[sample[rank] for sample in raw["memory"]] for rank in range(WORLD_SIZE)]
    return {
        "tokens_per_step": setup.tokens_per_step,
        "step_s_samples": step_s,
        "step_s_per_rank": [[step[rank]["seconds"] for step in timed] for rank in range(WORLD_SIZE)],
        "step_s": statistics.median(step_s),
        "tokens_per_sec": setup.tokens_per_step / statistics.median(step_s),
        "cpu_s_samples": cpu_s,
        "cpu_s_per_rank": [[step[rank]["cpu_seconds"] for step in timed] for rank in range(WORLD_SIZE)],
        "cpu_s": statistics.median(cpu_s),
        "param_bytes_per_rank": [r["param_bytes"] for r in raw["states"]],
        "model_state_bytes_per_rank": [r["model_state_bytes"] for r in raw["states"]],
        "param_bytes": max(r["param_bytes"] for r in raw["states"]),
        "model_state_bytes": max(r["model_state_bytes"] for r in raw["states"]),
        "memory_samples_per_rank": per_rank_memory,
        "step_peak_mib": max(s["step_peak_mib"] for rank in per_rank_memory for s in rank),
        "resident_mib": max(s["resident_mib"] for rank in per_rank_memory for s in rank),
        "losses_per_rank": [r["losses"] for r in raw["losses"]],
        "final_loss_per_rank": [r["final_loss"] for r in raw["losses"]],
    }


RATIOS = {  # name -> the figure compared
    "tokens_per_sec": "tokens_per_sec",
    "cpu_s_per_step": "cpu_s",
    "model_states": "model_state_bytes",
    "params": "param_bytes",
    "step_peak": "step_peak_mib",
    "resident": "resident_mib",
}


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    return {name: other[key] / base[key] for name, key in RATIOS.items()}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare_losses(base: dict[str, Any], other: dict[str, Any], limit: float) -> dict[str, Any]:
    """The largest relative difference of the two engines' losses, every step and rank and the final
    evaluation; `agree` when it is within `limit`."""
    steps = max(
        _relative(a, b)
        for ours, theirs in zip(other["losses_per_rank"], base["losses_per_rank"], strict=True)
        for a, b in zip(ours, theirs, strict=True)
    )
    final = max(
        _relative(a, b)
        for a, b in zip(other["final_loss_per_rank"], base["final_loss_per_rank"], strict=True)
    )
    largest = max(steps, final)
    return {
        "max_relative_difference": largest,
        "max_relative_difference_final": final,
        "limit": limit,
        "agree": largest <= limit,
    }


class LossMismatch(RuntimeError):
    """The engines trained the same model on the same data to different losses."""


def check_losses(rows: dict[str, Any]) -> None:
    failed = {p: row["losses"] for p, row in rows.items() if not row["losses"]["agree"]}
    if failed:
        detail = "; ".join(
            f"{p}: largest relative difference {c['max_relative_difference']:.2e} > {c['limit']:.0e}"
            for p, c in failed.items()
        )
        raise LossMismatch(f"DeepSpeed ZeRO-3 and FSDP2 losses disagree ({detail}): see the table above")


def summarise(setups: list[Setup], samples: dict[str, dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One precision's row: each engine's figures, the FSDP2 / DeepSpeed ratios and the loss check."""
    base_setup, other_setup = setups
    base = engine_figures(base_setup, samples[base_setup.engine], warmup)
    other = engine_figures(other_setup, samples[other_setup.engine], warmup)
    return {
        base_setup.engine: base,
        other_setup.engine: other,
        "fsdp2_over_deepspeed": ratios(base, other),
        "losses": compare_losses(base, other, LOSS_RTOL[base_setup.precision]),
    }


# ---------------------------------------------------------------- printing


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def print_row(precision: str, row: dict[str, Any]) -> None:
    for engine in ENGINES:
        f = row[engine]
        losses = [statistics.fmean(step) for step in zip(*f["losses_per_rank"], strict=True)]
        print(
            f"  {precision:<6}{engine:<11}{f['tokens_per_sec']:>10,.0f}{f['step_s']:>8.3f}{f['cpu_s']:>8.3f}"
            f"{_mib(f['model_state_bytes']):>14} ({_mib(f['param_bytes']):>6})"
            f"{f['resident_mib']:>11,.0f}{f['step_peak_mib']:>11,.0f}"
            f"   {losses[0]:.6f} -> {losses[-1]:.6f} (final {statistics.fmean(f['final_loss_per_rank']):.6f})"
        )
    r, c = row["fsdp2_over_deepspeed"], row["losses"]
    verdict = "agree" if c["agree"] else "DISAGREE"
    print(
        f"  {precision} FSDP2/DeepSpeed: tokens/s {r['tokens_per_sec']:.2f}x, CPU s per step "
        f"{r['cpu_s_per_step']:.2f}x, model states "
        f"{r['model_states']:.2f}x (params {r['params']:.2f}x), step peak {r['step_peak']:.2f}x, resident "
        f"{r['resident']:.2f}x; losses {verdict}: largest relative difference "
        f"{c['max_relative_difference']:.1e} (limit {c['limit']:.0e})"
    )


# ---------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_engines", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="model size (llmtrain's presets)")
    parser.add_argument(
        "--precisions",
        type=lambda s: s.split(","),
        default=["fp32", "bf16"],
        help="comma-separated rows: fp32, bf16",
    )
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median counts)")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps whose memory is measured")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    args = parser.parse_args(argv)
    if not args.precisions or set(args.precisions) - set(LOSS_RTOL):
        parser.error(f"--precisions: comma-separated, each one of {', '.join(LOSS_RTOL)}")
    if args.steps < 1 or args.warmup < 0 or args.memory_steps < 1:
        parser.error("--steps and --memory-steps must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    from llmtrain import rundir
    from llmtrain.presets import PRESETS, count_parameters

    args = parse_args(argv or [])
    params = count_parameters(**PRESETS[args.preset])
    print(
        f"{args.preset} preset ({params / 1e6:.1f}M parameters), DeepSpeed ZeRO-3 and FSDP2 (--zero 3), world "
        f"size {WORLD_SIZE} per engine (gloo), {THREADS} thread(s) per rank (BENCH_THREADS), micro-batch "
        f"{args.micro_batch} x seq_len {args.seq_len} per rank; engines in their own process pairs, steps "
        f"interleaved; median over {args.steps} steps after {args.warmup} warm-up"
    )
    started = time.perf_counter()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_engines-") as tmp:
        for precision in args.precisions:
            setups = [Setup(e, precision, args.preset, args.seq_len, args.micro_batch) for e in ENGINES]
            rows[precision] = summarise(setups, run_row(setups, args, Path(tmp)), args.warmup)
    print(
        "Measured (CPU s: the process's CPU time in a step; model states per rank after a backward, params "
        "in brackets; resident before a step and step peak above it; the larger rank's of each; losses "
        "averaged over the ranks):"
    )
    print(
        f"  {'prec.':<6}{'engine':<11}{'tokens/s':>10}{'step s':>8}{'CPU s':>8}{'states MiB':>14}{'(params)':>9}"
        f"{'resid. MiB':>11}{'peak MiB':>11}   loss first -> last"
    )
    for precision, row in rows.items():
        print_row(precision, row)
    check_losses(rows)
    result = {
        # Not the output path: the file is where it is, and the path would name this machine.
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "world_size": WORLD_SIZE,
            "threads": THREADS,
        },
        "parameters": params,
        "machine": rundir.environment(WORLD_SIZE),
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Setup(**json.loads(sys.argv[2])))
    else:
        main(sys.argv[1:])
