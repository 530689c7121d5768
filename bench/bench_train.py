"""Training throughput and step memory, against what users run today, measured in one run.

Comparisons (each setup in its own worker process: DeepSpeed's state is global):
1. llmtrain's Trainer (its real step: LR, forward, agreement all-reduce, stability guard, backward, step)
   against Hugging Face transformers' `LlamaForCausalLM` (attn_implementation "sdpa", built from
   `export.hf_config` of the same ModelConfig) trained under DeepSpeed with the same DeepSpeed config
   (`dsconfig.build`), batch, bf16 and ZeRO stage, at ZeRO 1, ZeRO 3 and ZeRO 3 with CPU offload, on two
   shapes (SHAPES). llmtrain runs with the settings `llmtrain train` chooses by default for such a run
   (a 1000-step run without tp/sp/pp: compiled blocks, TrainConfig.compiles).
2. llmtrain (ZeRO 0, fp32, eager) against a bare PyTorch loop (same model class, torch.optim.AdamW,
   gradient clipping, no DeepSpeed): the framework's overhead, with identical arithmetic on both sides.
3. The memory one training step needs above what is resident before it (weights, optimizer states,
   gradient buffers): peak RSS of the step minus RSS before it on CPU (after returning freed heap to
   the OS), `torch.cuda.max_memory_allocated` minus `memory_allocated` on GPU.

Every setup trains on the same random token batches. The workers of a comparison are alive together
and take steps in turn (A B C, C B A, ...), so load from other processes on a shared machine falls on
all of them alike; throughput is the median over the measured steps after warm-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The shapes: big enough that a 2-core CPU shows real differences, small enough for ~10 minutes in all.
# "tiny" is the default preset (vocabulary 8,192 against a width of 256: the output layer and loss are a
# large share of the step); "vocab512" has a vocabulary of 512, where the transformer blocks are nearly all.
PRESET = "tiny"
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "vocab512": {"model.vocab_size": 512, "model.num_hidden_layers": 4},
}
SEQ_LEN = 256
MICRO_BATCH = 8
WARMUP_STEPS = 3
MEASURED_STEPS = 20
N_BATCHES = 4  # distinct random batches, cycled
# Intra-op threads per worker. One by default: on a shared 2-core machine two OpenMP threads per process
# made steps about 4x slower and erratic (a descheduled thread stalls every parallel region's barrier).
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
WORKER_TIMEOUT_S = 600.0
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "train.json"


@dataclass(frozen=True)
class Setup:
    """One worker: what trains, under which ZeRO stage and precision."""

    kind: str  # "llmtrain", "hf" or "bare"
    stage: int
    precision: str
    compile: bool | None = None  # None: llmtrain's default (TrainConfig.compiles)
    offload: str = "none"
    shape: str = "tiny"
    preset: str = PRESET
    seq_len: int = SEQ_LEN
    micro_batch: int = MICRO_BATCH

    @property
    def label(self) -> str:
        names = {
            "llmtrain": "llmtrain" + {None: "", True: " --compile", False: " --no-compile"}[self.compile],
            "hf": "HF LlamaForCausalLM (sdpa) + DeepSpeed",
            "bare": "bare PyTorch loop (AdamW, no DeepSpeed)",
        }
        return names[self.kind]


# ---------------------------------------------------------------- the worker side


def _config(setup: Setup) -> Any:
    from llmtrain.config import resolve

    return resolve(
        flags={
            "preset": setup.preset,
            "zero.stage": setup.stage,
            "train.precision": setup.precision,
            "train.micro_batch": setup.micro_batch,
            "train.seq_len": setup.seq_len,
            "train.compile": setup.compile,
            "zero.offload": setup.offload,
            **SHAPES[setup.shape],
            "train.steps": 1000,
            # DeepSpeed's lr for the HF setup and the bare loop's: a constant 3e-4, no warm-up.
            "schedule.name": "constant",
            "schedule.warmup_steps": 0,
            "logging.log_every": 1000,
        }
    )


def random_batches(vocab_size: int, micro_batch: int, seq_len: int) -> list[dict[str, Any]]:
    """N_BATCHES micro-batches {input_ids, labels} of random tokens, identical in every worker."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(N_BATCHES):
        window = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=generator)
        batches.append({"input_ids": window[:, :-1].contiguous(), "labels": window[:, 1:].contiguous()})
    return batches


class LlmtrainRunner:
    """llmtrain's Trainer as `llmtrain train` builds it; steps are fed the benchmark's batches."""

    def __init__(self, setup: Setup, run_dir: Path) -> None:
        from llmtrain.parallel import distributed
        from llmtrain.train.trainer import build_trainer

        cfg = _config(setup)
        world = distributed.init()
        self.device = world.device
        self.trainer = build_trainer(cfg, world, run_dir, resume=False)
        self.trainer.open_metrics()
        assert self.trainer.metrics is not None
        self.trainer.metrics.start(0, 0)

    def step(self, batch: dict[str, Any]) -> float:
        """The body of Trainer.train's loop, for one optimizer step on `batch`."""
        t = self.trainer
        result = t.train_step([batch])
        t.counters.step += 1
        t.counters.tokens += t.tokens_per_step
        t.guard.record(result.loss, result.grad_norm, result.verdict)
        t.log(result)
        return result.loss


class HFDeepSpeedRunner:
    """LlamaForCausalLM with SDPA attention under deepspeed.initialize, the usual user loop."""

    def __init__(self, setup: Setup, run_dir: Path) -> None:
        import deepspeed
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from llmtrain.export import hf_config
        from llmtrain.parallel import distributed
        from llmtrain.planning import dsconfig

        cfg = _config(setup)
        world = distributed.init()
        self.device = world.device
        torch.manual_seed(cfg.train.seed)
        hf = {k: v for k, v in hf_config(cfg.model).items() if k != "architectures"}
        config = LlamaConfig(**hf)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config)
        assert model.config._attn_implementation == "sdpa"
        ds_config = dsconfig.build(cfg, world.world_size, world.accelerator)
        groups = _decay_groups(model, cfg.optim.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)

    def step(self, batch: dict[str, Any]) -> float:
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        loss = self.engine(input_ids=ids, labels=ids).loss  # HF shifts the labels itself
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())


class BareLoopRunner:
    """The same Llama class in a plain loop: AdamW, clip_grad_norm_, no DeepSpeed, fp32."""

    def __init__(self, setup: Setup, run_dir: Path) -> None:
        import torch

        from llmtrain.engine.ds_engine import param_groups
        from llmtrain.model import build_model
        from llmtrain.parallel.accelerator import select_accelerator

        if setup.precision != "fp32":
            raise ValueError("the bare loop is the fp32 reference")
        cfg = _config(setup)
        self.device = torch.device("cuda" if select_accelerator() == "cuda" else "cpu")
        self.model = build_model(cfg.model, device=self.device, seed=cfg.train.seed)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model.named_parameters(), o.weight_decay),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
        )
        self.grad_clip = o.grad_clip

    def step(self, batch: dict[str, Any]) -> float:
        import torch

        loss = self.model(**{k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _decay_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """llmtrain's grouping for an HF model: decay on matrices, not on norms or the embedding."""
    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and "embed_tokens" not in name else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


RUNNERS: dict[str, Any] = {"llmtrain": LlmtrainRunner, "hf": HFDeepSpeedRunner, "bare": BareLoopRunner}


def _proc_status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


def _release_free_heap() -> None:
    """Return freed heap pages to the OS, so RSS counts live memory and not glibc's free lists."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_step_memory(step: Any, device: Any) -> dict[str, float]:
    """Run `step()` once; the memory it needs above what was resident before it, in MiB."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"resident_mib": before / 2**20, "step_peak_mib": (peak - before) / 2**20}
    _release_free_heap()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    before = _proc_status_kib("VmRSS")
    step()
    peak = _proc_status_kib("VmHWM")
    return {"resident_mib": before / 1024, "step_peak_mib": (peak - before) / 1024}


def worker(setup: Setup) -> None:
    """Build the setup, say `ready`, then answer `step` / `memory` / `quit` lines on stdin.

    Replies go to the original stdout as JSON lines; everything libraries print goes to stderr.
    """
    import torch

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    torch.set_num_threads(THREADS)
    run_dir = Path(tempfile.mkdtemp(prefix="bench_train-run-"))
    runner = RUNNERS[setup.kind](setup, run_dir)
    vocab = _config(setup).model.vocab_size
    batches = random_batches(vocab, setup.micro_batch, setup.seq_len)
    replies.write(json.dumps({"ready": True}) + "\n")
    steps = 0

    def one_step() -> float:
        nonlocal steps
        loss = runner.step(batches[steps % len(batches)])
        steps += 1
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return loss

    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            started, cpu_started = time.perf_counter(), time.process_time()
            loss = one_step()
            cpu = time.process_time() - cpu_started  # all threads: robust to load from other processes
            reply = {"seconds": time.perf_counter() - started, "cpu_seconds": cpu, "loss": loss}
            replies.write(json.dumps(reply) + "\n")
        elif command == "memory":
            replies.write(json.dumps(measure_step_memory(one_step, runner.device)) + "\n")
        elif command == "quit":
            break
    from llmtrain.parallel import distributed

    distributed.shutdown()  # without it gloo aborts at exit now and then


# ---------------------------------------------------------------- the parent side


class Worker:
    def __init__(self, setup: Setup, log_dir: Path) -> None:
        self.setup = setup
        name = f"{setup.shape}-{setup.kind}-z{setup.stage}-{setup.offload}-{setup.precision}-compile-{setup.compile}"
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_train", "--worker", json.dumps(asdict(setup))],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_path, "w"),  # noqa: SIM115 (closed with the process)
            text=True,
        )
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []
        self.memory: dict[str, float] = {}

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"bench worker {self.setup.label} (stage {self.setup.stage}) died:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def wait_ready(self) -> None:
        self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.ask_nowait("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def ask_nowait(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.times[WARMUP_STEPS:])

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_times[WARMUP_STEPS:])

    @property
    def tokens_per_sec(self) -> float:
        return self.setup.micro_batch * self.setup.seq_len / self.median_step_s


@contextlib.contextmanager
def workers(setups: list[Setup], log_dir: Path) -> Iterator[list[Worker]]:
    started = [Worker(s, log_dir) for s in setups]
    try:
        for w in started:
            w.wait_ready()
        yield started
    finally:
        for w in started:
            w.close()


def compare(setups: list[Setup], log_dir: Path) -> list[Worker]:
    """Interleaved steps of every setup, then one memory-measured step each."""
    with workers(setups, log_dir) as group:
        for round_ in range(WARMUP_STEPS + MEASURED_STEPS):
            for w in group if round_ % 2 == 0 else reversed(group):
                reply = w.ask("step")
                w.times.append(reply["seconds"])
                w.cpu_times.append(reply["cpu_seconds"])
                w.losses.append(reply["loss"])
        for w in group:
            w.memory = w.ask("memory")
    return group


def _print_group(title: str, group: list[Worker], baseline: Worker) -> dict[str, Any]:
    print(title)
    out: dict[str, Any] = {}
    for w in group:
        speed = w.tokens_per_sec / baseline.tokens_per_sec
        memory = w.memory["step_peak_mib"] / baseline.memory["step_peak_mib"]
        ratio = "" if w is baseline else f"{speed:5.2f}x"
        mem_ratio = "" if w is baseline else f"{memory:5.2f}x"
        print(
            f"  {w.setup.label:<42} {w.tokens_per_sec:>8,.0f} tokens/s {ratio:>6}   "
            f"step memory {w.memory['step_peak_mib']:>7,.0f} MiB {mem_ratio:>6}   "
            f"(median step {w.median_step_s * 1000:,.0f} ms, CPU {w.median_cpu_s:.2f} s; "
            f"loss {w.losses[0]:.3f} -> {w.losses[-1]:.3f})"
        )
        out[w.setup.label] = {
            "tokens_per_sec": w.tokens_per_sec,
            "speedup": speed,
            "step_memory_mib": w.memory["step_peak_mib"],
            "memory_ratio": memory,
            "step_times_s": w.times,
            "step_cpu_s": w.cpu_times,
            "losses": w.losses,
        }
    return out


# ZeRO stage and offload of each comparison against HF transformers + DeepSpeed, on every shape.
ZERO_SETUPS = ((1, "none"), (3, "none"), (3, "cpu"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    import argparse

    from bench.ranks import write_result
    from llmtrain import rundir

    parser = argparse.ArgumentParser(prog="python -m bench.bench_train", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    out = parser.parse_args(argv or []).out
    print(
        f"seq_len {SEQ_LEN}, micro-batch {MICRO_BATCH}, bf16, 1 process, {THREADS} thread(s) (BENCH_THREADS); "
        f"each setup in its own process, steps interleaved; median tokens/s over {MEASURED_STEPS} steps after "
        f"{WARMUP_STEPS} warm-up; llmtrain with the settings `llmtrain train` uses by default"
    )
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
        log_dir = Path(tmp)
        for shape in SHAPES:
            print(f"{shape}: {_describe(shape)}")
            for stage, offload in ZERO_SETUPS:
                setups = [
                    Setup(kind, stage, "bf16", offload=offload, shape=shape) for kind in ("hf", "llmtrain")
                ]
                group = compare(setups, log_dir)
                title = (
                    f"  ZeRO {stage}{' + CPU offload' if offload == 'cpu' else ''}, against HF + DeepSpeed:"
                )
                results[f"{shape}/zero{stage}{'-offload' if offload == 'cpu' else ''}"] = _print_group(
                    title, group, baseline=group[0]
                )
        # eager: the same kernels as the bare loop, so that every step's loss must be equal
        group = compare([Setup("bare", 0, "fp32"), Setup("llmtrain", 0, "fp32", compile=False)], log_dir)
        results["overhead"] = _print_group(
            "framework overhead, tiny, fp32 (identical arithmetic), against a bare PyTorch loop:",
            group,
            baseline=group[0],
        )
        bare, ours = group
        check_same_arithmetic(bare, ours)
        overhead = bare.tokens_per_sec / ours.tokens_per_sec - 1
        print(f"  llmtrain's overhead over the bare loop: {overhead:+.1%} step time (goal <= 5%)")
        results["overhead"]["overhead_fraction"] = overhead
    result = {
        "settings": {
            "shapes": {shape: _describe(shape) for shape in SHAPES},
            "seq_len": SEQ_LEN,
            "micro_batch": MICRO_BATCH,
            "warmup_steps": WARMUP_STEPS,
            "measured_steps": MEASURED_STEPS,
            "threads": THREADS,
        },
        "machine": rundir.environment(1),
        **results,
        "seconds": time.perf_counter() - started,
    }
    write_result(result, out)
    return result


def _describe(shape: str) -> str:
    from llmtrain.presets import count_parameters

    m = _config(Setup("llmtrain", 1, "bf16", shape=shape)).model
    params = count_parameters(**asdict(m))
    return (
        f"{params / 1e6:.1f}M parameters: hidden {m.hidden_size}, {m.num_hidden_layers} layers, "
        f"vocabulary {m.vocab_size:,}"
    )


OVERHEAD_LOSS_RTOL = 1e-5


def check_same_arithmetic(bare: Worker, ours: Worker) -> None:
    """The overhead comparison is fair only if both loops compute the same thing: every step's loss
    equal (fp32; only the order of a few reductions may differ)."""
    for step, (a, b) in enumerate(zip(bare.losses, ours.losses, strict=True), 1):
        if abs(a - b) > OVERHEAD_LOSS_RTOL * abs(a):
            raise RuntimeError(
                f"overhead comparison invalid: step {step} loss {b!r} (llmtrain) != {a!r} (bare loop); "
                "the two loops no longer compute the same update"
            )
    print(
        f"  both loops end on the same loss: {ours.losses[-1]:.6f} (llmtrain), {bare.losses[-1]:.6f} (bare)"
    )


def profile(setup: Setup, steps: int = 2, rows: int = 15) -> str:
    """torch.profiler's top operators (self CPU time) over `steps` steps after two warm-up steps."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from llmtrain.train.profile import top_operators

    torch.set_num_threads(THREADS)
    runner = RUNNERS[setup.kind](setup, Path(tempfile.mkdtemp(prefix="bench_train-run-")))
    batches = random_batches(_config(setup).model.vocab_size, setup.micro_batch, setup.seq_len)
    for i in range(2):
        runner.step(batches[i])
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(steps):
            runner.step(batches[i])
    return top_operators(prof, rows=rows, by_shape=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Setup(**json.loads(sys.argv[2])))
    elif len(sys.argv) >= 3 and sys.argv[1] == "--profile":
        # python -m bench.bench_train --profile KIND [STAGE [PRECISION]]: the table the README quotes
        args = [*sys.argv[2:], "1", "bf16"][:3] if len(sys.argv) == 3 else [*sys.argv[2:], "bf16"][:3]
        print(profile(Setup(args[0], int(args[1]), args[2])))
    else:
        main(sys.argv[1:])
