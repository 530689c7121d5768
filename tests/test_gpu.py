"""GPU tests (`pytest -m gpu`, run by `make gpu-check`; skipped without CUDA), and the gpu-check driver.

On a GPU: the fast paths hold there too (no mask, flash/efficient kernels in bf16, the chunked loss),
the Trainer's step makes exactly the expected host synchronisations (CUDA's sync debug mode), and a
bf16 ZeRO-1 training step runs end to end with MFU reported. On any machine: `make gpu-check`'s plan,
and its one-line refusal where no CUDA device is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import ModelConfig, resolve
from llmtrain.model import build_model
from llmtrain.presets import PRESETS

REPO = Path(__file__).resolve().parent.parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_check(
    *args: str, cmd: tuple[str, ...] = (sys.executable, "-m", "bench.gpu_check"), **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cmd, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_gpu_check_dry_run_writes_the_plan(tmp_path: Path) -> None:
    proc = _gpu_check("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "gpu.json").read_text())["plan"]
    assert list(plan) == ["environment", "throughput_1b", "tiny_matrix", "gpu_tests"]
    runs = plan["tiny_matrix"]
    assert len(runs) == 9 and all("--preset tiny" in r for r in runs)
    assert runs[-1].endswith(
        "--zero 3 --precision bf16 --log-every 2 --warmup-steps 2 --run-dir RUN_DIR --quantize-weights"
    )
    assert {(r.split("--zero ")[1][0], r.split("--precision ")[1][:4]) for r in runs} == {
        (str(s), p) for s in range(4) for p in ("bf16", "fp16")
    }
    assert plan["throughput_1b"]["preset"] == "1b"


def test_gpu_check_dry_run_without_out_prints_the_plan() -> None:
    proc = _gpu_check("--dry-run", "--only", "gpu_tests", cmd=("bash", "scripts/gpu_check.sh"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan"] == {"gpu_tests": "pytest -q -m gpu tests"}


@pytest.mark.parametrize("cmd", [("bash", "scripts/gpu_check.sh"), (sys.executable, "-m", "bench.gpu_check")])
def test_gpu_check_without_a_cuda_device_refuses_in_one_line(tmp_path: Path, cmd: tuple[str, ...]) -> None:
    """No device visible (no driver, a CPU-only torch, or CUDA_VISIBLE_DEVICES hiding them): one line,
    exit 2, nothing written and nothing installed."""
    proc = _gpu_check("--out", str(tmp_path), cmd=cmd, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device is present"), lines
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_loss_in_low_precision_matches_fp32(dtype: torch.dtype) -> None:
    cfg = ModelConfig(**PRESETS["debug"])
    model = build_model(cfg, device="cuda", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda", generator=None)
    with torch.no_grad():
        reference = model(ids, labels=ids.roll(-1, 1)).item()
        low = model.to(dtype)(ids, labels=ids.roll(-1, 1)).item()
    assert abs(low - reference) <= 2e-2 * reference


@pytest.mark.gpu
@cuda
def test_gpu_attention_uses_a_fused_kernel_without_mask() -> None:
    """Plain causal bf16 attention with GQA: the flash or memory-efficient kernel accepts it (the math
    fallback, which materialises the [T, T] scores, is disabled here and would raise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = ModelConfig(**PRESETS["debug"])
    model = build_model(cfg, device="cuda", seed=0).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    with sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    ):
        loss = model(ids, labels=ids.roll(-1, 1))
        loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.gpu
@cuda
def test_gpu_fused_loss_equals_plain_cross_entropy() -> None:
    cfg = ModelConfig(**PRESETS["debug"])
    model = build_model(cfg, device="cuda", seed=0)
    model.lm_head.chunk_rows = 100
    ids = torch.randint(0, cfg.vocab_size, (3, 130), device="cuda")
    labels = ids.roll(-1, 1)
    fused = model(ids, labels=labels)
    fused.backward()
    fused_grad = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    plain = F.cross_entropy(model(ids).float().reshape(-1, cfg.vocab_size), labels.reshape(-1))
    plain.backward()
    assert abs(fused.item() - plain.item()) <= 1e-5
    torch.testing.assert_close(fused_grad, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def _trainer_syncs(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    from llmtrain.parallel import distributed
    from llmtrain.train.trainer import build_trainer

    cfg = resolve(
        flags={
            "preset": "debug",
            "train.seq_len": 128,
            "train.micro_batch": 4,
            "train.global_batch": 12,  # 3 micro-batches per optimizer step
            "train.precision": "bf16",
            "zero.stage": 1,
            "train.steps": 4,
        }
    )
    world = distributed.World(rank, rank, world_size, "cuda", world_size)
    torch.cuda.set_device(rank)
    trainer = build_trainer(cfg, world, Path(run_dir), resume=False)
    trainer.train_step(trainer.loader.next_step())  # warm-up: lazy allocations synchronise
    trainer.counters.step += 1
    micro_batches = trainer.loader.next_step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = trainer.train_step(micro_batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    trainer.loader.close()
    package = Path(distributed.__file__).parents[1]  # llmtrain's own files, not DeepSpeed's internal reads
    ours = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if package in Path(w.filename).parents]
    return {"ours": ours, "loss": result.loss}


@pytest.mark.gpu
@cuda
def test_gpu_trainer_step_synchronises_once_to_agree_and_once_for_the_grad_norm(tmp_path: Path) -> None:
    from dist import run_distributed

    (result,) = run_distributed(_trainer_syncs, 1, str(tmp_path), backend="nccl", timeout=300)
    # _agree's one read (trainer.py) and the grad norm the guard judges (read by the engine wrapper)
    reads = sorted(line.split(":")[0] for line in result["ours"])
    assert reads == ["ds_engine.py", "trainer.py"], result["ours"]
    assert result["loss"] > 0


@pytest.mark.gpu
@cuda
def test_gpu_training_reports_mfu(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain", "train", "--preset", "debug", "--steps", "6", "--micro-batch", "4",
         "--seq-len", "128", "--log-every", "3", "--zero", "1", "--precision", "bf16", "--run-dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train and all(0 < r["mfu"] < 1 for r in train)
    assert "mfu" in proc.stdout.lower()
