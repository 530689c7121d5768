"""metrics.jsonl, console lines, resume truncation, wandb offline (real wandb) and MFU arithmetic."""

from __future__ import annotations

import io
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest

from llmtrain import config
from llmtrain.config import ModelConfig
from llmtrain.planning.flops import flops_per_token, matmul_parameters
from llmtrain.presets import PRESETS
from llmtrain.train.metrics import (
    METRICS_FILE,
    WANDB_ID_FILE,
    MetricsLogger,
    mfu,
    peak_flops,
    peak_flops_for_name,
    read_metrics,
    truncate_metrics,
)

TRAIN_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "elapsed_s", "skipped", "spikes"}


def strict_lines(path: Path) -> list[dict[str, Any]]:
    """Each line parsed as strict JSON (NaN / Infinity rejected)."""

    def reject(token: str) -> None:
        raise AssertionError(f"non-strict JSON constant {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def make_logger(run_dir: Path, **kw: Any) -> tuple[MetricsLogger, io.StringIO]:
    out = io.StringIO()
    logger = MetricsLogger(run_dir, total_steps=kw.pop("total_steps", 4), interactive=False, stream=out, **kw)
    return logger, out


# ---------------------------------------------------------------- FLOPs and MFU


def test_flops_per_token_debug_preset() -> None:
    model = ModelConfig(**PRESETS["debug"])
    # 158_016 parameters, minus the 512 x 64 input embedding (a lookup, not a matmul).
    assert matmul_parameters(model) == 158_016 - 32_768 == 125_248
    # 6 N + 12 L h s = 6 * 125_248 + 12 * 2 * 64 * 256
    assert flops_per_token(model, 256) == 751_488 + 393_216 == 1_144_704
    tied = ModelConfig(**{**PRESETS["debug"], "tie_word_embeddings": True})
    assert matmul_parameters(tied) == 125_248  # the shared matrix counts once, as the output projection


def test_mfu_arithmetic() -> None:
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    # 8 x H100 at 100k tokens/s on a model with 7e9 matmul parameters (6N = 4.2e10 FLOPs per token)
    peak_total = 8 * peak_flops_for_name("NVIDIA H100 80GB HBM3")  # type: ignore[operator]
    assert peak_total == 8 * 989e12
    assert mfu(100_000.0, 4.2e10, peak_total) == pytest.approx(4.2e15 / 7.912e15)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", None),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_table(name: str, peak: float | None) -> None:
    assert peak_flops_for_name(name) == peak


def test_no_peak_and_no_mfu_on_cpu(tmp_path: Path) -> None:
    assert peak_flops("cpu") is None
    cfg = config.resolve(flags={"preset": "debug"})
    logger = MetricsLogger.from_config(cfg, tmp_path, device="cpu", interactive=False)
    record = logger.log_step(1, loss=5.0, lr=1e-3, grad_norm=1.0, tokens=2048)
    logger.close()
    assert "mfu" not in record and logger.flops_per_token == flops_per_token(cfg.model, cfg.train.seq_len)


def test_configured_peak_times_the_real_world_size_gives_the_mfu(tmp_path: Path) -> None:
    # --gpus 1 (cfg.world_size 1) while the launcher started 2 processes: the peak is the group's.
    cfg = config.resolve(flags={"preset": "debug"}, sets=["logging.peak_flops=1e12"])
    assert cfg.logging.peak_flops == 1e12 and cfg.world_size == 1
    logger = MetricsLogger.from_config(cfg, tmp_path, device="cpu", world_size=2, interactive=False)
    assert logger.peak_flops_total == 2e12
    time.sleep(0.01)
    record = logger.log_step(1, loss=5.0, lr=1e-3, grad_norm=1.0, tokens=2048)
    summary = logger.close()
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    assert record["tokens_per_sec"] > 0
    assert record["mfu"] == record["tokens_per_sec"] * per_token / (1e12 * 2)
    assert summary["mfu"] == pytest.approx(summary["tokens_per_sec"] * per_token / 2e12)


@pytest.mark.parametrize("value", ["0", "-1e12"])
def test_peak_flops_must_be_positive(value: str) -> None:
    with pytest.raises(config.ConfigError, match=r"logging\.peak_flops: must be positive"):
        config.resolve(flags={"preset": "debug"}, sets=[f"logging.peak_flops={value}"])


# ---------------------------------------------------------------- metrics.jsonl and console


def test_records_have_required_keys_and_numbers(tmp_path: Path) -> None:
    logger, out = make_logger(tmp_path, flops_per_token=1e6, peak_flops_total=1e12)
    for step in range(1, 5):
        logger.log_step(step, loss=6.0 - step, lr=3e-4, grad_norm=1.23, tokens=2048 * step, skipped=step // 3)
    logger.log_eval(4, val_loss=2.5)
    summary = logger.close()

    records = strict_lines(tmp_path / METRICS_FILE)
    train, evals = records[:4], records[4:]
    for step, r in enumerate(train, start=1):
        assert TRAIN_KEYS | {"mfu"} == set(r)
        assert (r["step"], r["loss"], r["lr"], r["grad_norm"], r["tokens"]) == (
            step,
            6.0 - step,
            3e-4,
            1.23,
            2048 * step,
        )
        assert r["tokens_per_sec"] > 0
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * 1e6 / 1e12)
        assert r["skipped"] == step // 3
    assert [r["elapsed_s"] for r in train] == sorted(r["elapsed_s"] for r in train)
    assert evals == [{"step": 4, "val_loss": 2.5, "val_ppl": pytest.approx(math.exp(2.5))}]

    lines = out.getvalue().splitlines()
    assert lines[1].startswith("step 2/4 loss 4.0000 lr 3.0e-04 gnorm 1.230 tok/s ")
    assert " mfu " in lines[1] and " eta 0:00:00" in lines[1]
    assert "skipped 1" in lines[2]
    assert lines[4] == "eval step 4 val_loss 2.5000 val_ppl 12.18"
    assert summary["steps"] == 4 and summary["tokens"] == 8192 and summary["final_loss"] == 2.0
    assert summary["best_val_loss"] == 2.5 and summary["skipped_steps"] == 1
    table = out.getvalue()
    for row in (
        "steps",
        "tokens",
        "final loss",
        "best val loss",
        "tokens/s",
        "MFU",
        "skipped steps",
        "wall time",
    ):
        assert row in table


def _eta_of(line: str) -> str | None:
    match = re.search(r" eta (\S+)$", line)
    return match.group(1) if match else None


@pytest.mark.parametrize(
    ("log_every", "etas"), [(1, [None, "0:01:58", "0:01:57"]), (10, [None, "0:01:40", "0:01:30"])]
)
def test_the_eta_leaves_out_the_first_interval_which_holds_the_compile(
    tmp_path: Path, log_every: int, etas: list[str | None]
) -> None:
    """A compiled 120-step run: the first step takes 100 s (torch.compile), each later one 1 s. The first
    line has no eta (its interval holds the compile: it would say 3:18:20 for a 4-minute run); from the
    second on, the pace of the steps since the previous line. Plain numbers: the clock is the test's."""
    now = [0.0]
    logger, out = make_logger(tmp_path, total_steps=120, clock=lambda: now[0])
    for step in (log_every, 2 * log_every, 3 * log_every):
        now[0] = 100.0 + (step - 1) * 1.0
        logger.log_step(step, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=64 * step)
    assert [_eta_of(line) for line in out.getvalue().splitlines()] == etas


def test_a_resumed_session_leaves_out_its_own_first_interval(tmp_path: Path) -> None:
    """After a resume the first step compiles again: no eta until the session's second line."""
    now = [0.0]
    logger, out = make_logger(tmp_path, total_steps=100, clock=lambda: now[0])
    logger.start(50, 50 * 64)
    now[0] = 60.0
    logger.log_step(51, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=51 * 64)
    now[0] = 62.0
    logger.log_step(52, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=52 * 64)
    assert [_eta_of(line) for line in out.getvalue().splitlines()] == [None, "0:01:36"]  # 48 steps x 2 s


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    logger, out = make_logger(tmp_path)
    logger.log_step(1, loss=math.nan, lr=1e-3, grad_norm=math.inf, tokens=10)
    logger.log_eval(1, val_loss=math.inf)
    logger.close()
    records = strict_lines(tmp_path / METRICS_FILE)
    assert records[0]["loss"] is None and records[0]["grad_norm"] is None
    assert records[1] == {"step": 1, "val_loss": None, "val_ppl": None}
    assert "loss nan" in out.getvalue()


def test_other_ranks_write_and_print_nothing(tmp_path: Path) -> None:
    logger, out = make_logger(tmp_path, rank=1)
    record = logger.log_step(1, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=10)
    logger.warn("spike")
    logger.close()
    assert record["loss"] == 2.0
    assert not (tmp_path / METRICS_FILE).exists() and out.getvalue() == ""


def _write_run(run_dir: Path) -> None:
    logger, _ = make_logger(run_dir, total_steps=6)
    for step in range(1, 7):
        logger.log_step(step, loss=10.0 - step, lr=1e-3, grad_norm=1.0, tokens=100 * step)
        if step % 3 == 0:
            logger.log_eval(step, val_loss=8.0 - step)
    logger.close()
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write('{"step": 7, "loss": 3.')  # torn by a crash mid-write


def test_truncate_metrics_drops_later_steps_and_torn_lines(tmp_path: Path) -> None:
    _write_run(tmp_path)
    kept = truncate_metrics(tmp_path / METRICS_FILE, 4)
    assert [(r["step"], "val_loss" in r) for r in kept] == [
        (1, False),
        (2, False),
        (3, False),
        (3, True),
        (4, False),
    ]
    assert strict_lines(tmp_path / METRICS_FILE) == kept
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_appends_without_duplicate_steps(tmp_path: Path) -> None:
    _write_run(tmp_path)
    before = {r["step"]: r for r in read_metrics(tmp_path / METRICS_FILE) if "loss" in r}
    logger, out = make_logger(tmp_path, total_steps=6, resume_step=4)
    assert logger.best_val_loss == 5.0  # from the eval record at step 3, kept
    record = logger.log_step(5, loss=4.5, lr=1e-3, grad_norm=1.0, tokens=500)
    logger.close()
    assert record["elapsed_s"] >= before[4]["elapsed_s"]  # wall time continues across the resume
    train_steps = [r["step"] for r in strict_lines(tmp_path / METRICS_FILE) if "loss" in r]
    assert train_steps == [1, 2, 3, 4, 5]
    assert out.getvalue().startswith("step 5/6 loss 4.5000")


def test_truncate_after_on_a_live_logger(tmp_path: Path) -> None:
    logger, _ = make_logger(tmp_path, total_steps=6)
    for step in range(1, 5):
        logger.log_step(step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=step)
    kept = logger.truncate_after(2)
    logger.log_step(3, loss=0.5, lr=1e-3, grad_norm=1.0, tokens=3)
    logger.close()
    assert [r["step"] for r in kept] == [1, 2]
    assert [r["step"] for r in strict_lines(tmp_path / METRICS_FILE)] == [1, 2, 3]


def test_interactive_display_renders_progress_and_summary(tmp_path: Path) -> None:
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=2, interactive=True, stream=out)
    logger.log_step(1, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=64)
    logger.warn("step 1: loss spike 9.1σ, update skipped")
    logger.log_step(2, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=128)
    logger.close()
    text = out.getvalue()
    assert "step 2/2" in text and "loss 2.0000" in text
    assert "warning: step 1: loss spike 9.1σ, update skipped" in text
    assert "training summary" in text
    assert len(read_metrics(tmp_path / METRICS_FILE)) == 2


# ---------------------------------------------------------------- wandb (real, offline)


def read_wandb_file(path: Path) -> list[Any]:
    """Records of a .wandb file: a LevelDB-style log (7-byte header, 32 KiB blocks) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = pb.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_file: Path) -> dict[int, dict[str, Any]]:
    # wandb-core writes the file from its own process and may still be flushing when finish() returns:
    # wait for the run's closing `exit` record.
    deadline = time.monotonic() + 30
    records = read_wandb_file(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = read_wandb_file(run_file)
    rows: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            # wandb 0.31 fills the repeated `nested_key`; older writers used `key`.
            row = {
                item.key or ".".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.setdefault(row["_step"], {}).update(row)
    return rows


def test_wandb_offline_logs_metrics_and_never_the_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_key = "llmtrainfake" + "0123456789abcdef" * 2
    monkeypatch.setenv("WANDB_API_KEY", fake_key)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the flag alone must select offline mode
    cfg = config.resolve(flags={"preset": "debug", "logging.wandb": "offline"})
    logger = MetricsLogger.from_config(cfg, tmp_path, interactive=False)
    for step in (1, 2, 3):
        logger.log_step(step, loss=5.0 - step, lr=1e-3, grad_norm=0.5, tokens=1000 * step)
    logger.log_eval(3, val_loss=1.5)
    logger.close()

    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    run_files = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(run_files) == 1
    history = wandb_history(run_files[0])
    assert [history[s]["loss"] for s in (1, 2, 3)] == [4.0, 3.0, 2.0]
    assert history[3]["tokens"] == 3000 and history[3]["val_loss"] == 1.5

    # A resume continues the same wandb run id.
    logger = MetricsLogger.from_config(cfg, tmp_path, resume_step=3, interactive=False)
    logger.log_step(4, loss=1.0, lr=1e-3, grad_norm=0.5, tokens=4000)
    logger.close()
    # A second run of the same id within the same second gets wandb's "-1" suffix on its folder.
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))) == 2

    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 5
    leaked = [p for p in files if fake_key.encode() in p.read_bytes()]
    assert leaked == []
