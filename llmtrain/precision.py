"""`--precision auto`, the default: bf16 where the hardware computes it natively, fp32 otherwise.

A run decides once, when it is prepared (`run.prepare.derive`, in the process the user started, before
any worker): config.yaml then records the concrete value, so every worker and every resume reads it and
decides nothing again. An explicit `--precision bf16|fp16|fp32` is kept as given and nothing is measured.

- On a CUDA device: bf16 where `torch.cuda.is_bf16_supported()` (Ampere and later), else fp32.
- On a CPU: bf16 where the CPU has bf16 instructions (AMX or AVX-512-bf16; Arm's bf16 extension) *and*
  a bf16 matmul measured in this process is not much slower than an fp32 one. The flags alone do not
  say what runs: `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` make oneDNN and ATen use their AVX2
  kernels only, and on an AMX Xeon a 1024² bf16 matmul then drops from ~1,000 GFLOP/s to 1.0 while fp32
  stays at ~280. A CPU without the instructions emulates bf16: on an AVX2-only CPU a bf16 matmul is
  ~250x slower than fp32, so a bf16 run there would take hours where fp32 takes minutes. The workers
  inherit this process's environment, so the kernels measured here are theirs.

`decide` is a pure function of the facts `measure` gathers, so a test can give it either kind of machine.
This module imports torch only to measure.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from llmtrain.config import Precision, TrainConfig

AUTO = "auto"
# A bf16 matmul this many times slower than fp32 is emulated, not native. Native bf16 (AMX,
# AVX-512-bf16) runs at about fp32's time or faster; emulated bf16 (AVX2 kernels) at 15-30x fp32's time
# on one core of an AVX2-only EPYC at PROBE_SIZE (more on larger matrices: 60x at 512²), so the gap
# leaves room for timing noise on a busy machine.
MAX_BF16_SLOWDOWN = 4.0
# Square matmuls of this size: ~4 MFLOP each, so an emulated bf16 one takes ~2.5 ms on an AVX2 EPYC core
# (1.7 GFLOP/s; ~15 ms at the slowest rate reported, 0.3 GFLOP/s) and the whole probe stays well under
# 0.5 s (~20 ms there), while fp32's (~0.1 ms on that core) is far above the timer's resolution.
PROBE_SIZE = 128
PROBE_REPEATS = 10  # the best of these: noise from other processes only ever adds time
PROBE_BUDGET_S = 0.1  # per precision: stop repeating once the timed calls have taken this long
# torch.cpu.get_capabilities() keys that mean native bf16 matmuls: x86's AMX and AVX-512-bf16, Arm's.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")


@dataclass(frozen=True)
class Facts:
    """What `decide` reads: reported by torch, or measured here."""

    accelerator: str  # "cuda" or "cpu"
    gpu_bf16: bool | None = None  # cuda: torch.cuda.is_bf16_supported(); None: no GPU visible here
    cpu_bf16_instructions: bool | None = None  # cpu: one of NATIVE_BF16_FLAGS reported; None: unknown
    cpu_bf16_slowdown: float | None = None  # cpu: a bf16 matmul's time over an fp32 one's


@dataclass(frozen=True)
class Decision:
    precision: Literal["bf16", "fp32"]
    reason: str

    def line(self) -> str:
        """The one line a run says at start."""
        return f"precision: {self.precision} (auto: {self.reason})"


def decide(facts: Facts) -> Decision:
    """bf16 or fp32 for `facts`; a pure function of them."""
    if facts.accelerator == "cuda":
        return _decide_gpu(facts.gpu_bf16)
    return _decide_cpu(facts.cpu_bf16_instructions, facts.cpu_bf16_slowdown)


def _decide_gpu(bf16_supported: bool | None) -> Decision:
    if bf16_supported is None:
        # `config` or an estimate for a GPU run, prepared on a machine without one.
        return Decision(
            "bf16", "a GPU run, planned without a GPU visible here: bf16, as GPUs since Ampere run it"
        )
    if bf16_supported:
        return Decision("bf16", "this GPU computes bf16 natively")
    return Decision(
        "fp32", "this GPU has no bf16 (before Ampere); --precision fp16 uses its half-precision units"
    )


def _decide_cpu(instructions: bool | None, slowdown: float | None) -> Decision:
    if slowdown is None:
        raise ValueError("a CPU's precision is decided from a measured bf16 slowdown")
    measured = f"bf16 matmuls measured {_relative(slowdown)} fp32"
    if instructions is False:
        return Decision("fp32", f"this CPU has no native bf16 (no AMX or AVX-512-bf16); {measured}")
    if slowdown > MAX_BF16_SLOWDOWN:
        # The instructions are there (or not reported), but the kernels in use do not run them: an
        # ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY cap, or an unknown CPU that emulates bf16.
        return Decision("fp32", f"bf16 is emulated here, not native; {measured}")
    return Decision("bf16", f"this CPU computes bf16 natively; {measured}")


def _relative(slowdown: float) -> str:
    """'180x slower than' or '3.1x faster than' (for a ratio of bf16's time to fp32's)."""
    if slowdown >= 1:
        return f"{slowdown:.{0 if slowdown >= 10 else 1}f}x slower than"
    return f"{1 / slowdown:.1f}x faster than"


# ---------------------------------------------------------------- measured here (torch)


@functools.cache
def measure(accelerator: str) -> Facts:
    """The facts of this machine for `accelerator`, once per process (neither the hardware nor the
    environment variables the kernels read change while it runs)."""
    import torch

    if accelerator == "cuda":
        visible = torch.cuda.is_available()
        return Facts("cuda", gpu_bf16=bool(torch.cuda.is_bf16_supported()) if visible else None)
    return Facts("cpu", cpu_bf16_instructions=_cpu_bf16_instructions(), cpu_bf16_slowdown=_bf16_slowdown())


def _cpu_bf16_instructions() -> bool | None:
    """Whether the CPU reports native bf16 instructions; None on an architecture whose flags torch does
    not report (there the measurement alone decides)."""
    import torch

    capabilities: dict[str, Any] = dict(torch.cpu.get_capabilities())
    # x86 reports its avx* flags, Arm its neon/sve ones; other architectures neither.
    if not any(key.startswith(("avx", "sve", "neon")) for key in capabilities):
        return None
    return any(bool(capabilities.get(flag)) for flag in NATIVE_BF16_FLAGS)


def _bf16_slowdown() -> float:
    """A bf16 matmul's time over an fp32 one's, each the best of a few after a warm-up call, on one
    thread: native or emulated is a property of each core's kernels, and on a busy machine a second
    thread waits for a core (a 128² fp32 matmul on both threads of a shared 2-core EPYC took 12 ms, on
    one 0.085 ms, which made bf16 look 10x faster than fp32 there)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator) for _ in range(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _best_seconds(a, b)
        bf16 = _best_seconds(a.bfloat16(), b.bfloat16())
    finally:
        torch.set_num_threads(threads)
    return bf16 / max(fp32, 1e-9)


def _best_seconds(a: Any, b: Any) -> float:
    import torch

    torch.mm(a, b)  # warm-up: oneDNN builds (and caches) its kernel on the first call
    best, spent = math.inf, 0.0
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > PROBE_BUDGET_S:
            break
    return best


def this_accelerator() -> str:
    """The accelerator a run here uses (DS_ACCELERATOR, else cuda when a GPU is visible)."""
    from llmtrain.parallel.accelerator import select_accelerator

    return select_accelerator()


# ---------------------------------------------------------------- used by runs and configs


def concrete(precision: str, accelerator: str | None = None) -> str:
    """`precision`, with auto decided for `accelerator` (default: this machine's, as a run here would)."""
    if precision != AUTO:
        return precision
    return decide(measure(accelerator or this_accelerator())).precision


def settle(cfg: TrainConfig, accelerator: str | None = None) -> Decision | None:
    """Replace auto in `cfg` by what this machine runs natively; the decision, or None when the config
    names its precision (an explicit choice is never measured, nor a resumed run's recorded one)."""
    if cfg.train.precision != AUTO:
        return None
    decision = decide(measure(accelerator or this_accelerator()))
    cfg.train.precision = decision.precision
    return decision


def for_gpu_plan(precision: Precision) -> Precision:
    """What auto means for a GPU run planned anywhere (`estimate-memory`): bf16, as every GPU since
    Ampere runs it. Torch-free, like the estimator."""
    return "bf16" if precision == AUTO else precision
