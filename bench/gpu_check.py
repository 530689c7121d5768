"""`make gpu-check`: the check of an installed llmtrain on a machine with a CUDA device, as one JSON file.

    python -m bench.gpu_check [--out DIR] [--time-limit SECONDS] [--dry-run] [--only SECTION ...]

Sections, each under its own time limit; a failing or timed-out section is recorded and the next runs,
and the results file (bench/results/gpu.json, or DIR/gpu.json) is rewritten after every section, so
whatever finished is kept:
1. environment: the machine (GPU, CPU, memory), torch / CUDA / DeepSpeed versions, the commit, the
   device's peak dense bf16 FLOP/s;
2. throughput_1b: the `1b` preset at ZeRO 1 in bf16 (eager and --compile), llmtrain's Trainer step on
   random tokens, MEASURE_STEPS steps after WARMUP_STEPS: median tokens/s, MFU (FLOPs per token
   6N + 12·L·h·s over the device's peak dense bf16 FLOP/s), torch.cuda.max_memory_allocated against
   estimate-memory's per-GPU peak;
3. tiny_matrix: `llmtrain train` on the tiny preset under ZeRO 0-3 in bf16 and fp16, and ZeRO 3 with
   --quantize-weights (ZeRO++ qwZ), a few steps each (four runs at a time on the one GPU): exit code,
   first and last loss, skipped steps;
4. gpu_tests: `pytest -m gpu tests`.
Without a CUDA device it says so in one line and exits 2. `--time-limit` bounds the whole check (none by
default: each section has its own limit). `--dry-run` (any machine) shows the plan instead of running it:
on stdout, or in DIR/gpu.json with --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO / "bench" / "results"
RESULT_FILE = "gpu.json"
# The headline measurement first: if a time limit cuts the run short, what is lost is the cheap part.
SECTIONS = ("environment", "throughput_1b", "tiny_matrix", "gpu_tests")

TINY_STEPS = 8
TINY_PARALLEL = 4
TINY_TIMEOUT_S = 300
GPU_TESTS_TIMEOUT_S = 600
FUSED_ADAM_BUILD_TIMEOUT_S = 600

PRESET_1B = "1b"
MICRO_BATCH_1B = 8
SEQ_LEN_1B = 2048
WARMUP_STEPS = 3
MEASURE_STEPS = 10
THROUGHPUT_TIMEOUT_S = {False: 600, True: 900}  # eager, --compile

_deadline: float | None = None  # time.monotonic() at which --time-limit runs out; None: no limit


def time_left() -> float:
    return math.inf if _deadline is None else _deadline - time.monotonic()


def cuda_refusal() -> str | None:
    """Why this machine cannot run the check (one line), or None when torch sees a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"no CUDA device is present: torch {torch.__version__} is a build without CUDA; "
            "install torch's CUDA build for this machine"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (
        f"no CUDA device is present: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none{hidden}"
    )


# ---------------------------------------------------------------- sections


def environment() -> dict[str, Any]:
    import torch

    from llmtrain import rundir

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        **rundir.machine_facts(),
    }
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # recorded, not fatal: the next sections say what it breaks
        info["deepspeed_error"] = repr(exc)
    if torch.cuda.is_available():
        from llmtrain.train.metrics import peak_flops

        info["device"] = torch.cuda.get_device_name(0)
        info["device_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        info["peak_bf16_flops"] = peak_flops("cuda:0")
    return info


def _run(cmd: list[str], timeout: float, cwd: Path = REPO) -> dict[str, Any]:
    """`cmd` under `timeout` seconds, or less where --time-limit leaves less."""
    timeout = max(1.0, min(timeout, time_left()))
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    return {
        "cmd": " ".join(cmd),
        "rc": rc,
        "seconds": round(time.perf_counter() - started, 1),
        "tail": out[-3000:],
    }


def gpu_tests() -> dict[str, Any]:
    return _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                GPU_TESTS_TIMEOUT_S)  # fmt: skip


# The tiny runs: every ZeRO stage in bf16 and fp16, and ZeRO 3 with ZeRO++'s int8 weight gathers (qwZ:
# DeepSpeed's quantizer kernels are CUDA-only, so only a GPU runs it; qgZ and hpZ need two nodes).
TINY_RUNS: list[tuple[int, str, tuple[str, ...]]] = [
    *[(stage, precision, ()) for precision in ("bf16", "fp16") for stage in (0, 1, 2, 3)],
    (3, "bf16", ("--quantize-weights",)),
]


def tiny_command(stage: int, precision: str, run_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "llmtrain", "train", "--preset", "tiny", "--steps", str(TINY_STEPS),
        "--micro-batch", "8", "--seq-len", "256", "--zero", str(stage), "--precision", precision,
        "--log-every", "2", "--warmup-steps", "2", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip


def _tiny_run(stage: int, precision: str, extra: tuple[str, ...], root: Path) -> dict[str, Any]:
    run_dir = root / "-".join(["tiny", f"z{stage}", precision, *(flag.lstrip("-") for flag in extra)])
    result = _run(tiny_command(stage, precision, run_dir, extra), TINY_TIMEOUT_S)
    records = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    result.update(
        stage=stage, precision=precision, flags=list(extra), steps=train[-1]["step"] if train else 0
    )
    if train:
        result.update(first_loss=train[0]["loss"], last_loss=train[-1]["loss"], skipped=train[-1]["skipped"])
        # The allocator peak a GPU run logs (plan --confirm sets it beside the estimate).
        result["peak_memory_bytes"] = train[-1].get("peak_memory_bytes")
    last = result.get("last_loss")
    peak = result.get("peak_memory_bytes")
    result["ok"] = (
        result["rc"] == 0
        and result["steps"] == TINY_STEPS
        and isinstance(last, float)
        and math.isfinite(last)
        and last < result["first_loss"]
        and isinstance(peak, int)
        and peak > 0
    )
    return result


def prebuild_fused_adam() -> dict[str, Any]:
    """DeepSpeed JIT-builds FusedAdam on first use: once here, so parallel runs do not race on it."""
    code = "import llmtrain; from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"
    result = _run([sys.executable, "-c", code], FUSED_ADAM_BUILD_TIMEOUT_S)
    return {
        "rc": result["rc"],
        "seconds": result["seconds"],
        **({"tail": result["tail"]} if result["rc"] else {}),
    }


def tiny_matrix() -> dict[str, Any]:
    build = prebuild_fused_adam()
    with (
        tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp,
        concurrent.futures.ThreadPoolExecutor(TINY_PARALLEL) as pool,
    ):
        results = list(pool.map(lambda run: _tiny_run(run[0], run[1], run[2], Path(tmp)), TINY_RUNS))
    return {"ok": all(r["ok"] for r in results), "fused_adam_build": build, "runs": results}


def throughput_1b() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for compiled in (False, True):
        name = "compile" if compiled else "eager"
        cmd = [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--measure-1b",
            "--compile" if compiled else "--eager",
        ]
        result = _run(cmd, THROUGHPUT_TIMEOUT_S[compiled])
        lines = [line for line in result["tail"].splitlines() if line.startswith("{")]
        if result["rc"] == 0 and lines:
            out[name] = json.loads(lines[-1])
        else:
            out[name] = {"error": f"rc {result['rc']}", "tail": result["tail"]}
    return out


# ---------------------------------------------------------------- the 1b measurement (its own process)


def measure_1b(compiled: bool) -> dict[str, Any]:
    """llmtrain's Trainer step for the 1b preset on random tokens; prints and returns one JSON object."""
    import torch

    from bench.bench_train import LlmtrainRunner, Setup, _config, random_batches
    from llmtrain.planning.flops import flops_per_token
    from llmtrain.planning.memory import estimate, setup_from_config
    from llmtrain.train.metrics import peak_flops

    setup = Setup("llmtrain", 1, "bf16", compile=compiled, preset=PRESET_1B, seq_len=SEQ_LEN_1B,
                  micro_batch=MICRO_BATCH_1B)  # fmt: skip
    cfg = _config(setup)
    runner = LlmtrainRunner(setup, Path(tempfile.mkdtemp(prefix="gpu_check-1b-")))
    batches = random_batches(cfg.model.vocab_size, setup.micro_batch, setup.seq_len)
    times = []
    for i in range(WARMUP_STEPS + MEASURE_STEPS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        runner.step(batches[i % len(batches)])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times[WARMUP_STEPS:])
    tokens_per_sec = setup.micro_batch * setup.seq_len / step_s
    fpt = flops_per_token(cfg.model, setup.seq_len)
    peak = peak_flops("cuda:0")
    est = estimate(setup_from_config(cfg)).to_dict()
    overhead = sum(t["bytes"] for t in est["per_gpu"] if t["term"] == "runtime overhead")
    measured = torch.cuda.max_memory_allocated()
    result = {
        "preset": PRESET_1B,
        "zero": 1,
        "precision": "bf16",
        "compile": compiled,
        "micro_batch": setup.micro_batch,
        "seq_len": setup.seq_len,
        "step_times_s": [round(t, 4) for t in times],
        "median_step_s": step_s,
        "tokens_per_sec": tokens_per_sec,
        "flops_per_token": fpt,
        "peak_bf16_flops": peak,
        "mfu": tokens_per_sec * fpt / peak if peak else None,
        "max_memory_allocated_bytes": measured,
        "estimated_peak_bytes": est["per_gpu_peak_bytes"],
        "estimated_peak_without_runtime_overhead_bytes": est["per_gpu_peak_bytes"] - overhead,
        "estimate_over_measured": (est["per_gpu_peak_bytes"] - overhead) / measured,
    }
    print(json.dumps(result), flush=True)
    return result


# ---------------------------------------------------------------- driver


RUNNERS = {
    "environment": environment,
    "gpu_tests": gpu_tests,
    "tiny_matrix": tiny_matrix,
    "throughput_1b": throughput_1b,
}


def plan() -> dict[str, Any]:
    """What a real run would do, for --dry-run."""
    return {
        "environment": "GPU, CPU, memory, versions, commit, peak bf16 FLOP/s",
        "gpu_tests": "pytest -q -m gpu tests",
        "tiny_matrix": [" ".join(tiny_command(s, p, Path("RUN_DIR"), extra)) for s, p, extra in TINY_RUNS],
        "throughput_1b": {
            "preset": PRESET_1B,
            "micro_batch": MICRO_BATCH_1B,
            "seq_len": SEQ_LEN_1B,
            "warmup_steps": WARMUP_STEPS,
            "measured_steps": MEASURE_STEPS,
            "variants": ["eager", "compile"],
        },
    }


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


def _failed(section: dict[str, Any]) -> bool:
    """An error, a failed check or a non-zero exit code, in the section or in the 1b measurement's eager
    and compile runs. (A failed FusedAdam prebuild is recorded only: the runs build it themselves.)"""
    parts = [section, *(section[k] for k in ("eager", "compile") if isinstance(section.get(k), dict))]
    return any("error" in p or p.get("ok") is False or p.get("rc", 0) != 0 for p in parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"write DIR/{RESULT_FILE} (default: bench/results)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="bound the whole check (default: none)",
    )
    parser.add_argument("--dry-run", action="store_true", help="show the plan, run nothing (no GPU needed)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        metavar="SECTION",
        help=", ".join(SECTIONS),
    )
    parser.add_argument("--measure-1b", action="store_true", help=argparse.SUPPRESS)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    mode.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error(f"--time-limit: must be a positive number of seconds, got {args.time_limit:g}")
    return args


def dry_run(args: argparse.Namespace, report: dict[str, Any]) -> int:
    steps = plan()
    report.update(dry_run=True, plan={name: steps[name] for name in args.only})
    if args.out is None:
        print(json.dumps(report, indent=2))
        return 0
    path = args.out / RESULT_FILE
    write_report(path, report)
    print(f"plan written to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    global _deadline
    args = parse_args(argv)
    if args.measure_1b:
        measure_1b(args.compile)
        return 0
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "sections": args.only}
    if args.dry_run:
        return dry_run(args, report)
    refusal = cuda_refusal()
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cuda")  # the runs this check starts name their accelerator
    if args.time_limit is not None:
        _deadline = time.monotonic() + args.time_limit
        report["time_limit_s"] = args.time_limit
    path = (args.out or DEFAULT_OUT_DIR) / RESULT_FILE
    failed = False
    for name in args.only:
        started = time.perf_counter()
        print(f"== {name}", flush=True)
        if time_left() <= 0:
            report[name] = {"error": f"not run: --time-limit {args.time_limit:g} s reached"}
        else:
            try:
                report[name] = RUNNERS[name]()
            except Exception as exc:  # one broken section must not cost the others
                report[name] = {"error": repr(exc)}
        report[name + "_seconds"] = round(time.perf_counter() - started, 1)
        failed |= _failed(report[name])
        write_report(path, report)
        print(json.dumps(report[name])[:2000], flush=True)
    print(f"results written to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
