"""`--precision auto`, the default: the pure decision for every kind of machine, an explicit precision
kept and never measured, the estimator's GPU plan, and a real run under the environment variables that
cap oneDNN and ATen at AVX2 (fp32 recorded in config.yaml, said in one line, kept by a resume)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmtrain import precision, rundir
from llmtrain.config import resolve
from llmtrain.precision import Facts, decide

AMX = Facts("cpu", cpu_bf16_instructions=True, cpu_bf16_slowdown=0.3)
# What `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` (CAPPED) does to an AMX Xeon: the instructions
# are there, but bf16 matmuls run ~1,000x slower than fp32 (1.0 GFLOP/s against ~1,000 uncapped).
AMX_CAPPED_AT_AVX2 = Facts("cpu", cpu_bf16_instructions=True, cpu_bf16_slowdown=1000.0)
AVX2_ONLY = Facts("cpu", cpu_bf16_instructions=False, cpu_bf16_slowdown=180.0)
CAPPED = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
X86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="CAPPED names x86 kernels")


# ---------------------------------------------------------------- the decision, a pure function


def test_a_cpu_with_native_bf16_trains_in_bf16() -> None:
    assert decide(AMX) == precision.Decision(
        "bf16", "this CPU computes bf16 natively; bf16 matmuls measured 3.3x faster than fp32"
    )
    # AVX-512-bf16 without AMX: about fp32's speed, still native.
    assert decide(Facts("cpu", cpu_bf16_instructions=True, cpu_bf16_slowdown=1.2)).precision == "bf16"


def test_an_avx2_only_cpu_trains_in_fp32_and_says_why_in_one_line() -> None:
    assert decide(AVX2_ONLY).line() == (
        "precision: fp32 (auto: this CPU has no native bf16 (no AMX or AVX-512-bf16); "
        "bf16 matmuls measured 180x slower than fp32)"
    )
    # No instructions: fp32 even where oneDNN's emulation is only a little slower (AVX-512 without bf16).
    assert decide(Facts("cpu", cpu_bf16_instructions=False, cpu_bf16_slowdown=1.5)).precision == "fp32"


def test_kernels_capped_below_the_cpus_bf16_instructions_mean_fp32() -> None:
    decision = decide(AMX_CAPPED_AT_AVX2)
    assert decision.precision == "fp32"
    assert (
        decision.reason == "bf16 is emulated here, not native; bf16 matmuls measured 1000x slower than fp32"
    )


@pytest.mark.parametrize(
    ("slowdown", "expected"),
    [(precision.MAX_BF16_SLOWDOWN, "bf16"), (precision.MAX_BF16_SLOWDOWN + 0.1, "fp32")],
)
def test_the_measured_slowdown_decides_where_the_cpu_reports_no_flags(slowdown: float, expected: str) -> None:
    """An architecture whose flags torch does not report: the measurement alone, at the threshold."""
    assert decide(Facts("cpu", cpu_bf16_slowdown=slowdown)).precision == expected


def test_a_gpu_trains_in_bf16_where_it_supports_it() -> None:
    assert decide(Facts("cuda", gpu_bf16=True)) == precision.Decision(
        "bf16", "this GPU computes bf16 natively"
    )
    assert decide(Facts("cuda", gpu_bf16=False)).precision == "fp32"  # before Ampere
    # A GPU run planned where no GPU is visible (`config` with DS_ACCELERATOR=cuda): as GPUs since Ampere.
    assert decide(Facts("cuda")).precision == "bf16"


def test_a_cpu_decision_needs_the_measurement() -> None:
    with pytest.raises(ValueError, match="measured"):
        decide(Facts("cpu", cpu_bf16_instructions=True))


# ---------------------------------------------------------------- where auto is settled, and where not


def _measuring_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(accelerator: str) -> Facts:
        raise AssertionError(f"measured the {accelerator} where the precision was already decided")

    monkeypatch.setattr(precision, "measure", refuse)


@pytest.mark.parametrize("given", ["bf16", "fp16", "fp32"])
def test_an_explicit_precision_is_kept_and_nothing_is_measured(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmtrain.run import prepare

    _measuring_forbidden(monkeypatch)
    cfg = resolve(flags={"preset": "debug", "train.precision": given, "run_dir": str(tmp_path)})
    assert prepare.derive(cfg) is None
    rundir.write_config(tmp_path, cfg)
    assert yaml.safe_load((tmp_path / rundir.CONFIG_FILE).read_text())["train"]["precision"] == given


def test_auto_is_settled_into_the_config_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrain.run import prepare

    monkeypatch.setattr(precision, "measure", lambda accelerator: AVX2_ONLY)
    cfg = resolve(flags={"preset": "debug", "run_dir": str(tmp_path)})
    assert cfg.train.precision == "auto"
    assert prepare.derive(cfg) == decide(AVX2_ONLY)
    assert cfg.train.precision == "fp32"
    _measuring_forbidden(monkeypatch)
    assert prepare.derive(cfg) is None  # decided: a second derive (a worker's, a resume's) keeps it


def test_the_estimator_plans_auto_as_bf16_and_leaves_the_config_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """estimate-memory sizes GPU runs: auto is bf16 there whatever the machine it runs on."""
    from llmtrain.planning.memory.setup import setup_from_config

    _measuring_forbidden(monkeypatch)
    cfg = resolve(flags={"preset": "7b", "zero.stage": "2"})
    setup = setup_from_config(cfg)
    assert setup.precision == "bf16" and setup.ds["bf16"]["enabled"]
    assert cfg.train.precision == "auto"


def test_the_probe_is_cheap() -> None:
    """The bf16-vs-fp32 measurement costs under a second of CPU (its budget: 0.5 s even on a slow CPU). It
    runs on this thread alone (one intra-op thread), so this thread's CPU time is its cost, whatever else
    the machine is running: wall time on a loaded CI machine would measure the neighbours."""
    started = time.thread_time()
    slowdown = precision._bf16_slowdown()
    took = time.thread_time() - started
    print(f"bf16 matmul / fp32 matmul: {slowdown:.1f}x, measured in {took * 1000:.0f} ms of CPU")
    assert slowdown > 0 and took < 1.0


# ---------------------------------------------------------------- a real run, capped at AVX2


def _llmtrain(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in CAPPED and k != "LLMTRAIN_FAULTS"}
    full_env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    cmd = [sys.executable, "-m", "llmtrain", *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def capped_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`llmtrain train` with the default precision under CAPPED: one process, 2 steps of the debug
    preset (~30 s on a busy 2-core machine, mostly imports; a fresh clone's first run also prepares the
    data cache); its run directory and what it printed."""
    run_dir = tmp_path_factory.mktemp("capped") / "run"
    args = ["train", "--preset", "debug", "--steps", "2", "--micro-batch", "2", "--seq-len", "32"]
    proc = _llmtrain([*args, "--log-every", "1", "--run-dir", str(run_dir)], **CAPPED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc.stdout + proc.stderr


def _precision_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("precision: ")]


@X86
def test_a_run_capped_at_avx2_trains_in_fp32_records_it_and_says_so(capped_run: tuple[Path, str]) -> None:
    run_dir, output = capped_run
    (line,) = _precision_lines(output)
    assert re.fullmatch(
        r"precision: fp32 \(auto: .*bf16 matmuls measured [\d.]+x slower than fp32\)", line
    ), line
    assert output.index(line) < output.index("step 1/2")  # said at start
    assert yaml.safe_load((run_dir / rundir.CONFIG_FILE).read_text())["train"]["precision"] == "fp32"
    assert "bf16" not in (run_dir / rundir.DS_CONFIG_FILE).read_text()


@X86
def test_a_resume_keeps_the_recorded_precision_without_deciding_again(
    capped_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llmtrain resume`'s preparation and freeze, in this process without the caps (on an AMX or
    AVX-512-bf16 CPU auto would now say bf16) and with measuring forbidden: still fp32, and config.yaml,
    which every worker reads, rewritten with it. In-process: a resumed subprocess would add ~20 s here
    and prove no more."""
    from llmtrain.run import prepare

    run_dir, _ = capped_run
    _measuring_forbidden(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)
    prepared = prepare.prepare_resume(run_dir, prepare.ConfigChanges(None, [], {"train.steps": 3}))
    assert prepared.cfg.train.precision == "fp32"
    prepare.freeze(prepared)
    saved = yaml.safe_load((run_dir / rundir.CONFIG_FILE).read_text())["train"]
    assert (saved["steps"], saved["precision"]) == (3, "fp32")  # rewritten, the precision kept
