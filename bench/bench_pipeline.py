"""Pipeline parallelism on two processes (pp 2): the 1F1B and GPipe schedules' bubble, throughput and
activation memory at m micro-batches per step, in one run.

`python -m bench pipeline` (defaults) or `python -m bench.bench_pipeline [--preset ...]` (flags below).
One process per pipeline stage (gloo, CPU), each building, for every (schedule, m) setup, the engine
`llmtrain train --pp 2 --pp-schedule S` builds (`pipeline.build_engine`: LlamaPipeline in DeepSpeed's
PipelineEngine, `pipeline.install_schedule`), stepped as the trainer steps it
(`engine.train_batch(pipeline.feed(micro_batches))`, with `engine.before_update` doing the one
all-reduce of the step's loss and returning "do not skip"). Every setup shares one shape and the same
random batches (global batch = micro-batch x m, dp 1). The setups take steps in turn (A B C ..., then
... C B A), one untimed warm-up round first, so load from other work on the machine falls on all alike;
both stages start every step together (a barrier before it, outside the timing). The default shape is
tiny's width with 9 blocks and a 2,048-token vocabulary, fp32, micro-batch 2 x 256 tokens: a micro-batch
takes each stage about 300 ms of forward and backward, against a few ms to send its activation on, and
both stages compute about equally long (see --layers), as the theory below assumes.

Measured per setup and stage:
1. Bubble: the share of the step the stage is not computing, 1 - (time in its ForwardPass and
   BackwardPass instructions) / step wall time, the instructions timed by wrapping the entries of
   `engine._INSTRUCTION_MAP` (an instance dict after install_schedule). Printed next to the theory for
   equal forward and backward times, (pp - 1) / (m + pp - 1). The step wall time also holds what no
   schedule can overlap (the optimizer step, the loss all-reduce and broadcast, sends and receives), so
   the share with the OptimizerStep instruction's time taken out of the wall is given as well; and the
   stages' compute per micro-batch, whose imbalance idles the faster stage beyond the theory.
2. Throughput: tokens of the step (micro-batch x seq_len x m) over its wall time (the slower stage's),
   median over the measured steps.
3. Activation peak: the bytes of tensors autograd saves for backward that are alive at once, each
   storage counted once, peak over the step (torch.autograd.graph.saved_tensors_hooks around the step:
   the pack hook counts a storage's bytes when its first saved tensor is packed, and the packed handle's
   release, when autograd frees the saved tensor, uncounts them after its last). Parameters (saved by
   the linear layers for the input gradient) are not activations and are left out; tensors that
   torch.utils.checkpoint keeps for its recomputation (the chunked loss's hidden-state rows, on the last
   stage) never pass through the hooks. The theory: stage s holds min(pp - s, m) micro-batches under 1F1B,
   all m under GPipe (llmtrain.planning.memory.pipeline.in_flight).

Prints a table, the GPipe / 1F1B ratios of tokens/s and activation peak, and the results as one JSON
line, also written to bench/results/pipeline.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.bench_train import THREADS, random_batches
from bench.ranks import REPO, free_port, rank_env, write_result
from llmtrain.planning.memory.pipeline import SCHEDULES  # the config's schedule names

PP = 2  # stages, one process each: the world
COMPUTE = ("ForwardPass", "BackwardPass")
DEFAULT_OUT = REPO / "bench" / "results" / "pipeline.json"
WORKER_TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class Shape:
    """What every setup shares; `micro_batches` lists the m of the setups."""

    preset: str
    layers: int | None  # None: the preset's
    vocab_size: int | None  # None: the preset's
    precision: str
    seq_len: int
    micro_batch: int
    micro_batches: tuple[int, ...]
    partition: str
    warmup: int
    steps: int


def setups(shape: Shape) -> list[tuple[str, int]]:
    return [(schedule, m) for m in shape.micro_batches for schedule in SCHEDULES]


def stage_contents(model: Any, partition: str) -> str:
    """What each stage runs, as the estimator describes it: `stage 0: embedding, blocks 0-4; ...`."""
    from llmtrain.planning.memory.pipeline import describe_span, stage_spans

    return "; ".join(
        f"stage {span.index}: {describe_span(span)}" for span in stage_spans(model, PP, partition)
    )


def bubble_theory(m: int) -> float:
    """(pp - 1) / (m + pp - 1), as the estimator computes it (llmtrain.planning.stages)."""
    from llmtrain.planning.stages import bubble_fraction

    return bubble_fraction(PP, m)


# ---------------------------------------------------------------- the worker side


def _config(shape: Shape, schedule: str, m: int) -> Any:
    from llmtrain.config import resolve

    return resolve(
        flags={
            "preset": shape.preset,
            "model.num_hidden_layers": shape.layers,
            "model.vocab_size": shape.vocab_size,
            "zero.stage": 1,  # the pipeline engine runs ZeRO 0 and 1; llmtrain allows 1
            "train.precision": shape.precision,
            "train.micro_batch": shape.micro_batch,
            "train.global_batch": shape.micro_batch * m,  # dp 1: m micro-batches per step
            "train.seq_len": shape.seq_len,
            "parallel.pp": PP,
            "parallel.pp_schedule": schedule,
            "parallel.pp_partition": shape.partition,
            "launch.gpus": PP,
        }
    )


class SavedActivations:
    """Bytes of the tensors autograd saves for backward, alive at once, each storage once; and the peak.

    `with saved.counting():` around a step installs the saved_tensors_hooks; `reset(excluded)` before it
    names the storages not counted (the parameters').
    """

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage address -> [saved tensors holding it, its bytes]
        self.current = 0
        self.peak = 0
        self.excluded: set[int] = set()

    def reset(self, excluded: set[int]) -> None:
        self.peak = self.current
        self.excluded = excluded

    def pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self.excluded:
            return tensor
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # Detached: the handle must not hold the tensor's grad_fn (a saved output would make a cycle).
        return _Saved(tensor.detach(), key, self)

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.current -= entry[1]

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


class _Saved:
    """A saved tensor, as autograd holds it between forward and backward; uncounted when freed."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, tensor: Any, key: int, owner: SavedActivations) -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


def _timed(fn: Callable[..., None], name: str, totals: dict[str, float]) -> Callable[..., None]:
    """`fn`, an entry of engine._INSTRUCTION_MAP (called as fn(engine, **kwargs)), adding its time."""

    def run(engine: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            fn(engine, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started

    return run


class Runner:
    """One setup's engine on this stage, as `llmtrain train --pp` builds it, its instructions timed."""

    def __init__(self, shape: Shape, schedule: str, m: int, world: Any) -> None:
        from llmtrain.engine import pipeline
        from llmtrain.planning import dsconfig

        cfg = _config(shape, schedule, m)
        self.schedule, self.m = schedule, m
        self.device = world.device
        ds_config = dsconfig.build(cfg, world.world_size, world.accelerator)
        self.engine = pipeline.build_engine(cfg, ds_config, world.device, world.world_size).ds
        assert self.engine.micro_batches == m, (self.engine.micro_batches, m)
        self.stage = int(self.engine.stage_id)
        self.totals: dict[str, float] = defaultdict(float)
        instructions = self.engine._INSTRUCTION_MAP
        for cmd, fn in list(instructions.items()):
            instructions[cmd] = _timed(fn, cmd.__name__, self.totals)
        self.losses: list[float] = []
        self.engine.before_update = self._before_update
        self.batches = random_batches(cfg.model.vocab_size, shape.micro_batch, shape.seq_len)
        self.saved = SavedActivations()
        self.steps = 0

    def _before_update(self, loss_sum: Any, count: int) -> bool:
        """The trainer's agreement, less the guard: one all-reduce of the loss; never skip."""
        import torch
        import torch.distributed as dist

        vector = torch.stack(
            [loss_sum.double(), torch.tensor(float(count), dtype=torch.float64, device=loss_sum.device)]
        )
        dist.all_reduce(vector)
        total, n = vector.tolist()
        self.losses.append(total / n)
        return False

    def _micro_batches(self) -> list[dict[str, Any]]:
        n = len(self.batches)
        picked = [self.batches[(self.steps * self.m + i) % n] for i in range(self.m)]
        return [{k: v.to(self.device) for k, v in b.items()} for b in picked]

    def step(self) -> dict[str, Any]:
        import torch.distributed as dist

        from llmtrain.engine import pipeline

        micro_batches = self._micro_batches()
        self.totals.clear()
        self.saved.reset({p.untyped_storage().data_ptr() for p in self.engine.module.parameters()})
        dist.barrier()  # both stages start the step together
        started = time.perf_counter()
        with self.saved.counting():
            self.engine.train_batch(pipeline.feed(micro_batches))
        wall = time.perf_counter() - started
        self.steps += 1
        if not self.totals.get("ForwardPass"):
            raise RuntimeError(
                "no ForwardPass instruction was timed: the engine no longer runs the entries of its "
                "instance _INSTRUCTION_MAP that install_schedule set (bench_pipeline wraps them)"
            )
        return {
            "wall_s": wall,
            "instructions_s": dict(self.totals),
            "activation_peak_bytes": self.saved.peak,
            "activation_left_bytes": self.saved.current,  # after the step: should be 0
            "loss": self.losses[-1],
        }


def worker(shape: Shape, result_path: Path) -> None:
    """Build every setup's engine, run the interleaved rounds, write this stage's records to `result_path`."""
    import torch

    from llmtrain.parallel import distributed

    torch.set_num_threads(THREADS)
    world = distributed.init()
    runners = [Runner(shape, schedule, m, world) for schedule, m in setups(shape)]
    records: dict[str, list[dict[str, Any]]] = {f"{r.schedule} {r.m}": [] for r in runners}
    for round_ in range(shape.warmup + shape.steps):
        for runner in runners if round_ % 2 == 0 else reversed(runners):
            record = runner.step()
            if round_ >= shape.warmup:
                records[f"{runner.schedule} {runner.m}"].append(record)
    result_path.write_text(json.dumps({"stage": runners[0].stage, "records": records}))
    distributed.shutdown()  # barrier and destroy_process_group: without them gloo aborts at exit now and then


# ---------------------------------------------------------------- the parent side


def run_stages(shape: Shape, log_dir: Path) -> list[dict[str, Any]]:
    """Start one worker per stage, wait for both, and return their results, stage 0 first.

    A worker that fails ends the run at once (its peer would wait in a collective for the timeout).
    """
    port = free_port()
    logs = [log_dir / f"rank{rank}.log" for rank in range(PP)]
    results = [log_dir / f"rank{rank}.json" for rank in range(PP)]
    procs = []
    for rank in range(PP):
        env = rank_env(rank, PP, port)
        with open(logs[rank], "w") as log:  # the worker keeps its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "bench.bench_pipeline", "--worker"),
                        *(json.dumps(asdict(shape)), str(results[rank])),
                    ],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) or (code == 0 and not results[rank].exists()):
                    tail = "".join(logs[rank].read_text().splitlines(keepends=True)[-30:])
                    raise RuntimeError(f"bench worker rank {rank} failed (exit {code}):\n{tail}")
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench workers still running after {WORKER_TIMEOUT_S:.0f}s")
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted((json.loads(path.read_text()) for path in results), key=lambda r: r["stage"])


# ---------------------------------------------------------------- the figures


def summarise(shape: Shape, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setup: tokens/s, and per stage the bubble (measured and theory), compute and activation peak."""
    from llmtrain.planning.memory.pipeline import in_flight

    tokens_per_micro_batch = shape.micro_batch * shape.seq_len
    out: dict[str, Any] = {}
    for schedule, m in setups(shape):
        key = f"{schedule} {m}"
        per_stage = [s["records"][key] for s in stages]
        walls = [max(step) for step in zip(*([r["wall_s"] for r in recs] for recs in per_stage), strict=True)]
        stage_figures = []
        for stage, recs in enumerate(per_stage):
            compute = [sum(r["instructions_s"].get(n, 0.0) for n in COMPUTE) for r in recs]
            optimizer = [r["instructions_s"].get("OptimizerStep", 0.0) for r in recs]
            bubble = [1 - c / r["wall_s"] for c, r in zip(compute, recs, strict=True)]
            bubble_pipe = [
                1 - c / (r["wall_s"] - o) for c, o, r in zip(compute, optimizer, recs, strict=True)
            ]
            stage_figures.append(
                {
                    "bubble": statistics.median(bubble),
                    "bubble_without_optimizer_step": statistics.median(bubble_pipe),
                    "wall_s": statistics.median(r["wall_s"] for r in recs),
                    "forward_ms_per_micro_batch": 1e3
                    * statistics.median(r["instructions_s"].get("ForwardPass", 0.0) for r in recs)
                    / m,
                    "backward_ms_per_micro_batch": 1e3
                    * statistics.median(r["instructions_s"].get("BackwardPass", 0.0) for r in recs)
                    / m,
                    "optimizer_step_ms": 1e3 * statistics.median(optimizer),
                    # every instruction's time in the step (receives include the wait for the peer)
                    "instructions_ms": {
                        name: 1e3 * statistics.median(r["instructions_s"].get(name, 0.0) for r in recs)
                        for name in sorted({n for r in recs for n in r["instructions_s"]})
                    },
                    "activation_peak_bytes": max(r["activation_peak_bytes"] for r in recs),
                    "activation_left_bytes": max(r["activation_left_bytes"] for r in recs),
                    "micro_batches_in_flight_theory": in_flight(schedule, PP, m, stage),
                }
            )
        out[key] = {
            "schedule": schedule,
            "micro_batches": m,
            "tokens_per_step": tokens_per_micro_batch * m,
            "step_s": statistics.median(walls),
            "tokens_per_sec": tokens_per_micro_batch * m / statistics.median(walls),
            "bubble_theory": bubble_theory(m),
            "stages": stage_figures,
            "losses": [r["loss"] for r in per_stage[0]],
        }
    return out


def ratios(shape: Shape, figures: dict[str, Any]) -> dict[str, Any]:
    """GPipe / 1F1B per m: tokens/s, and per stage the activation peak (measured and theory)."""
    out: dict[str, Any] = {}
    for m in shape.micro_batches:
        gpipe, ofob = figures[f"gpipe {m}"], figures[f"1f1b {m}"]
        out[str(m)] = {
            "tokens_per_sec": gpipe["tokens_per_sec"] / ofob["tokens_per_sec"],
            "activation_peak": [
                g["activation_peak_bytes"] / max(o["activation_peak_bytes"], 1)
                for g, o in zip(gpipe["stages"], ofob["stages"], strict=True)
            ],
            "activation_peak_theory": [
                g["micro_batches_in_flight_theory"] / o["micro_batches_in_flight_theory"]
                for g, o in zip(gpipe["stages"], ofob["stages"], strict=True)
            ],
        }
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def print_table(shape: Shape, figures: dict[str, Any], compared: dict[str, Any]) -> None:
    print(
        f"  {'schedule':<9}{'m':>3}{'tokens/s':>10}{'step s':>8}{'bubble theory':>15}"
        f"{'bubble s0 / s1':>16}{'(no opt. step)':>16}{'fwd+bwd ms/mb s0 / s1':>23}"
        f"{'act. peak MiB s0 / s1':>23}{'in flight':>11}"
    )
    for f in figures.values():
        s0, s1 = f["stages"]
        per_mb = [st["forward_ms_per_micro_batch"] + st["backward_ms_per_micro_batch"] for st in (s0, s1)]
        print(
            f"  {f['schedule']:<9}{f['micro_batches']:>3}{f['tokens_per_sec']:>10,.0f}{f['step_s']:>8.3f}"
            f"{f['bubble_theory']:>15.3f}{s0['bubble']:>9.3f} / {s1['bubble']:.3f}"
            f"{s0['bubble_without_optimizer_step']:>9.3f} / {s1['bubble_without_optimizer_step']:.3f}"
            f"{per_mb[0]:>14.1f} / {per_mb[1]:<6.1f}"
            f"{_mib(s0['activation_peak_bytes']):>14} / {_mib(s1['activation_peak_bytes']):<6}"
            f"{s0['micro_batches_in_flight_theory']:>5} / {s1['micro_batches_in_flight_theory']}"
        )
    print("GPipe / 1F1B:")
    for m, r in compared.items():
        peaks = ", ".join(
            f"stage {s} {got:.2f}x (theory {want:.2f}x)"
            for s, (got, want) in enumerate(
                zip(r["activation_peak"], r["activation_peak_theory"], strict=True)
            )
        )
        print(f"  m {m}: tokens/s {r['tokens_per_sec']:.2f}x; activation peak {peaks}")


# ---------------------------------------------------------------- main


def _ints(text: str) -> tuple[int, ...]:
    values = sorted({int(n) for n in text.split(",")})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"positive integers expected, got {text!r}")
    return tuple(values)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_pipeline", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", default="tiny", help="model shape (llmtrain's presets)")
    # 9 blocks and a 2,048-token vocabulary: the last stage's output layer and chunked loss then cost
    # about one block, so stage 0 (embedding, 5 blocks) and stage 1 (4 blocks, output layer) compute
    # about equally long per micro-batch, as the bubble's theory assumes. With tiny's own 8 blocks and
    # 8,192 tokens stage 1 computed about twice as long as stage 0 (460 against 240 ms per micro-batch),
    # and stage 0 idled half of every step whatever m was.
    parser.add_argument("--layers", type=int, default=9, help="blocks (0: the preset's)")
    parser.add_argument("--vocab-size", type=int, default=2048, help="vocabulary (0: the preset's)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument(
        "--micro-batches", type=_ints, default=(2, 4, 8), help="comma-separated m: micro-batches per step"
    )
    parser.add_argument("--partition", default="blocks", choices=["blocks", "parameters"])
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--steps", type=int, default=6, help="timed rounds (the median counts)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    from llmtrain import rundir
    from llmtrain.presets import count_parameters

    args = parse_args(argv or [])
    shape = Shape(
        args.preset,
        args.layers or None,
        args.vocab_size or None,
        args.precision,
        args.seq_len,
        args.micro_batch,
        args.micro_batches,
        args.partition,
        args.warmup,
        args.steps,
    )
    model = _config(shape, "1f1b", shape.micro_batches[0]).model
    params = count_parameters(**asdict(model))
    print(
        f"{args.preset} preset, {model.num_hidden_layers} blocks, vocab {model.vocab_size} "
        f"({params / 1e6:.1f}M parameters), {args.precision}, ZeRO 1, pp {PP} (one process per stage, gloo; "
        f"{stage_contents(model, args.partition)}), {THREADS} thread(s) per stage (BENCH_THREADS); micro-batch "
        f"{args.micro_batch} x seq_len {args.seq_len}, m = {', '.join(map(str, args.micro_batches))} per step; "
        f"setups interleaved, median over {args.steps} steps after {args.warmup} warm-up"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_pipeline-") as tmp:
        stages = run_stages(shape, Path(tmp))
    figures = summarise(shape, stages)
    compared = ratios(shape, figures)
    print(
        "Measured per stage (s0, s1): bubble = 1 - (ForwardPass + BackwardPass time) / step wall time, "
        "theory (pp-1)/(m+pp-1); activation peak = bytes saved for backward alive at once; "
        "in flight = micro-batches held at the peak in theory:"
    )
    print_table(shape, figures, compared)
    result = {
        "settings": {
            **asdict(shape),
            "micro_batches": list(shape.micro_batches),
            "pp": PP,
            "threads": THREADS,
            "parameters": params,
        },
        "machine": rundir.environment(PP),
        "setups": figures,
        "gpipe_over_1f1b": compared,
        "seconds": time.perf_counter() - started,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        raw = json.loads(sys.argv[2])
        worker(Shape(**{**raw, "micro_batches": tuple(raw["micro_batches"])}), Path(sys.argv[3]))
    else:
        main(sys.argv[1:])
