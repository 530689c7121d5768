"""bench_engines: its figures and loss check on made-up samples (no process started), and one short
run of the whole benchmark (DeepSpeed ZeRO-3 and FSDP2 pairs, debug shape, fp32) whose ratios and JSON
are computed from its samples and whose engines end on the same losses."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from benchkit import assert_printed_and_written

from bench.bench_engines import (
    ENGINES,
    FP32_LOSS_RTOL,
    LossMismatch,
    Setup,
    check_losses,
    main,
    parse_args,
    summarise,
)

# ---------------------------------------------------------------- figures on made-up samples


def both(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks' replies to one command, alike."""
    return [reply, reply]


def _raw(seconds: list[float], losses: list[float], state_bytes: int, peak_mib: float) -> dict[str, Any]:
    """One engine's replies as run_row collects them: every step's, then states, memory and losses."""
    return {
        "steps": [both({"seconds": s, "cpu_seconds": s / 2, "loss": 0.0}) for s in seconds],
        "states": both({"param_bytes": state_bytes // 4, "model_state_bytes": state_bytes}),
        "memory": [both({"resident_mib": 400.0, "step_peak_mib": peak_mib})],
        "losses": both({"losses": losses, "final_loss": losses[-1]}),
    }


def _row(fsdp2_losses: list[float]) -> dict[str, Any]:
    setups = [Setup(engine, "fp32", "debug", 32, 2) for engine in ENGINES]
    samples = {
        "deepspeed": _raw([9.0, 1.0, 3.0, 2.0], [5.0, 4.0], state_bytes=1000, peak_mib=200.0),
        "fsdp2": _raw([9.0, 1.0, 1.5, 1.0], fsdp2_losses, state_bytes=800, peak_mib=100.0),
    }
    return summarise(setups, samples, warmup=1)


def test_figures_and_ratios_come_from_the_timed_samples() -> None:
    row = _row([5.0, 4.0])
    ds, fsdp2 = row["deepspeed"], row["fsdp2"]
    assert ds["step_s_samples"] == [1.0, 3.0, 2.0]  # the warm-up step left out
    assert ds["cpu_s"] == 1.0
    assert ds["tokens_per_sec"] == pytest.approx(2 * 2 * 32 / 2.0)
    assert fsdp2["tokens_per_sec"] == pytest.approx(2 * 2 * 32 / 1.0)
    assert row["fsdp2_over_deepspeed"] == pytest.approx(
        {
            "tokens_per_sec": 2.0,
            "cpu_s_per_step": 0.5,
            "model_states": 0.8,
            "params": 0.8,
            "step_peak": 0.5,
            "resident": 1.0,
        }
    )
    assert row["losses"]["agree"] and row["losses"]["max_relative_difference"] == 0
    check_losses({"fp32": row})


def test_losses_that_differ_fail_loudly() -> None:
    row = _row([5.0, 4.0 * (1 + 3 * FP32_LOSS_RTOL)])
    assert row["losses"]["max_relative_difference"] == pytest.approx(3 * FP32_LOSS_RTOL)
    assert not row["losses"]["agree"]
    with pytest.raises(LossMismatch, match=r"fp32: largest relative difference 3\.00e-05"):
        check_losses({"fp32": row})


def test_flags() -> None:
    assert parse_args(["--precisions", "bf16"]).precisions == ["bf16"]
    for bad in (["--precisions", "fp16"], ["--steps", "0"], ["--memory-steps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---------------------------------------------------------------- a short run


@pytest.mark.slow
def test_a_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "engines.json"
    result = main(
        [
            *("--preset", "debug", "--precisions", "fp32", "--seq-len", "32", "--micro-batch", "2"),
            *("--warmup", "1", "--steps", "3", "--memory-steps", "1", "--out", str(out)),
        ]
    )
    printed = capsys.readouterr().out
    assert_printed_and_written(printed, result, out)
    assert "fp32 FSDP2/DeepSpeed: tokens/s" in printed
    assert {"torch", "deepspeed", "git_sha", "cpu_count"} <= set(result["machine"])

    row = result["rows"]["fp32"]
    for engine in ENGINES:
        f = row[engine]
        assert len(f["step_s_samples"]) == 3
        assert f["step_s_samples"] == [max(ranks) for ranks in zip(*f["step_s_per_rank"], strict=True)]
        assert f["tokens_per_sec"] == pytest.approx(2 * 2 * 32 / statistics.median(f["step_s_samples"]))
        assert f["cpu_s"] == statistics.median(max(ranks) for ranks in zip(*f["cpu_s_per_rank"], strict=True))
        assert f["model_state_bytes"] == max(f["model_state_bytes_per_rank"]) > f["param_bytes"] > 0
        assert f["step_peak_mib"] > 0 and f["resident_mib"] > 0
        # warm-up, timed, states and memory steps: every one's loss, on both ranks
        assert [len(losses) for losses in f["losses_per_rank"]] == [1 + 3 + 1 + 1] * 2
    ds, fsdp2 = row["deepspeed"], row["fsdp2"]
    ratios = row["fsdp2_over_deepspeed"]
    assert ratios["tokens_per_sec"] == pytest.approx(fsdp2["tokens_per_sec"] / ds["tokens_per_sec"])
    assert ratios["cpu_s_per_step"] == pytest.approx(fsdp2["cpu_s"] / ds["cpu_s"])
    assert ratios["model_states"] == pytest.approx(fsdp2["model_state_bytes"] / ds["model_state_bytes"])
    assert ratios["step_peak"] == pytest.approx(fsdp2["step_peak_mib"] / ds["step_peak_mib"])

    # Per rank, fp32 model states are half the model's: FSDP2 holds 16 bytes a parameter (weights,
    # gradients, two AdamW moments); DeepSpeed 20 (its fp32 optimizer partition is a copy of the weights).
    parameters = result["parameters"]
    assert fsdp2["model_state_bytes"] == pytest.approx(16 * parameters / 2, rel=0.05)
    assert ds["model_state_bytes"] == pytest.approx(20 * parameters / 2, rel=0.05)

    # The same exact AdamW on the same gradients: the same losses at every step, and after the last.
    for engine_losses in zip(ds["losses_per_rank"], fsdp2["losses_per_rank"], strict=True):
        assert engine_losses[1] == pytest.approx(engine_losses[0], rel=FP32_LOSS_RTOL)
    assert fsdp2["final_loss_per_rank"] == pytest.approx(ds["final_loss_per_rank"], rel=FP32_LOSS_RTOL)
    assert row["losses"]["agree"] and row["losses"]["max_relative_difference"] <= FP32_LOSS_RTOL
