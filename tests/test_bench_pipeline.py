"""bench_pipeline: its saved-activation counter on a small graph (no process started), and one short run
of the whole benchmark (two stage processes, debug shape) whose output has the promised structure and
sane numbers: bubbles between 0 and 1, activation peaks in the schedules' ratios, equal losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchkit import assert_printed_and_written

from bench.bench_pipeline import SavedActivations, main, parse_args

# ---------------------------------------------------------------- the saved-activation counter


def test_saved_tensors_are_counted_once_per_storage_and_released_by_backward() -> None:
    saved = SavedActivations()
    weight = torch.nn.Parameter(torch.randn(8, 8))
    saved.reset({weight.untyped_storage().data_ptr()})
    x = torch.randn(4, 8, requires_grad=True)
    with saved.counting():
        h = x @ weight  # saves x (128 B) and the weight (a parameter: not counted)
        y = (h * h).sum()  # saves h twice: one storage (128 B)
    assert saved.current == saved.peak == 2 * 4 * 8 * 4
    y.backward()
    assert saved.current == 0 and saved.peak == 256
    assert x.grad is not None and torch.allclose(x.grad, 2 * (x @ weight) @ weight.T)


def test_two_graphs_alive_at_once_make_the_peak() -> None:
    saved = SavedActivations()
    saved.reset(set())
    x = torch.randn(16, requires_grad=True)
    with saved.counting():
        first = x.exp().sum()  # exp saves its output: 64 B
        second = x.sin().sum()  # sin saves its input, x: 64 B
    assert saved.peak == 128
    first.backward()
    assert saved.current == 64
    with saved.counting():
        third = x.cos().sum()  # x again: the same storage, still alive through `second`
    assert saved.current == 64 and saved.peak == 128
    second.backward()
    third.backward()
    assert saved.current == 0


def test_flags() -> None:
    args = parse_args(["--micro-batches", "8,2,4,2"])
    assert args.micro_batches == (2, 4, 8)
    with pytest.raises(SystemExit):
        parse_args(["--micro-batches", "0,2"])
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


# ---------------------------------------------------------------- a short run


@pytest.mark.slow
def test_a_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "pipeline.json"
    result = main(
        [
            *("--preset", "debug", "--layers", "4", "--vocab-size", "0", "--seq-len", "32"),
            *("--micro-batch", "2", "--micro-batches", "2,4", "--warmup", "1", "--steps", "1"),
            *("--out", str(out)),
        ]
    )
    printed = capsys.readouterr().out
    assert_printed_and_written(printed, result, out)
    assert "GPipe / 1F1B:" in printed

    setups = result["setups"]
    assert set(setups) == {"1f1b 2", "gpipe 2", "1f1b 4", "gpipe 4"}
    for f in setups.values():
        m = f["micro_batches"]
        assert f["bubble_theory"] == pytest.approx(1 / (m + 1))
        assert f["tokens_per_step"] == 2 * 32 * m
        assert f["tokens_per_sec"] == pytest.approx(f["tokens_per_step"] / f["step_s"])
        assert f["tokens_per_sec"] > 0
        assert len(f["stages"]) == 2
        for stage in f["stages"]:
            assert 0 < stage["bubble"] < 1
            assert 0 < stage["bubble_without_optimizer_step"] <= stage["bubble"]
            assert stage["forward_ms_per_micro_batch"] > 0 and stage["backward_ms_per_micro_batch"] > 0
            assert stage["activation_peak_bytes"] > 0
            assert stage["activation_left_bytes"] == 0  # every saved tensor freed by the step's backwards

    # Activation peaks: counted, not timed, so they follow the schedules exactly. 1F1B holds 2
    # micro-batches on stage 0 and 1 on stage 1 whatever m is; GPipe holds all m on both.
    one_f1b = {m: [s["activation_peak_bytes"] for s in setups[f"1f1b {m}"]["stages"]] for m in (2, 4)}
    gpipe = {m: [s["activation_peak_bytes"] for s in setups[f"gpipe {m}"]["stages"]] for m in (2, 4)}
    assert one_f1b[2] == one_f1b[4]
    for m in (2, 4):
        assert gpipe[m][0] == pytest.approx(m / 2 * one_f1b[m][0], rel=0.02)
        assert gpipe[m][1] == pytest.approx(m * one_f1b[m][1], rel=0.02)
        ratios = result["gpipe_over_1f1b"][str(m)]
        assert ratios["activation_peak_theory"] == [m / 2, m]
        assert ratios["activation_peak"] == pytest.approx(ratios["activation_peak_theory"], rel=0.02)
        assert ratios["tokens_per_sec"] > 0
        # Both schedules accumulate the same gradients in the same order: the same losses.
        assert setups[f"gpipe {m}"]["losses"] == pytest.approx(setups[f"1f1b {m}"]["losses"], rel=1e-5)
