"""`llmtrain plot`: the PNG draws every run given (checked in the image's own pixels), --x tokens places
the records by tokens, --text prints metrics.jsonl's numbers, and `train` leaves RUN_DIR/curves.png."""

from __future__ import annotations

import io
import statistics
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from trained_run import trained_run

from llmtrain import cli, config, rundir
from llmtrain.train import plot
from llmtrain.train.metrics import MetricsLogger, read_metrics

BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's C0 and C1: the first and second run


def _run(root: Path, name: str, losses: dict[int, float], val: dict[int, float] | None = None) -> Path:
    """A run directory as `train` leaves it: config.yaml, and metrics.jsonl written by the real logger
    with these losses and validation losses by step (256 tokens a step, lr 1e-3 x step)."""
    run_dir = root / name
    rundir.write_config(run_dir, config.resolve(None, [], {"preset": "debug"}))
    last = max(losses)
    with MetricsLogger(run_dir, total_steps=last, stream=io.StringIO(), interactive=False) as logger:
        for step in range(1, last + 1):
            if step in losses:
                logger.log_step(
                    step, loss=losses[step], lr=1e-3 * step, grad_norm=1.0 / step, tokens=256 * step
                )
            if val and step in val:
                logger.log_eval(step, val[step])
    return run_dir


def _pixels_of(png: Path, colour: tuple[int, int, int]) -> int:
    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return int((np.abs(rgb - np.array(colour)).sum(axis=-1) <= 30).sum())


def test_two_runs_are_drawn_in_one_png_and_an_existing_out_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _run(tmp_path, "runA", {s: 6.0 - 0.2 * s for s in range(1, 13)}, val={4: 5.5, 8: 4.8, 12: 4.0})
    b = _run(tmp_path, "runB", {s: 6.5 - 0.1 * s for s in range(1, 13)}, val={6: 6.0, 12: 5.4})
    out = tmp_path / "c.png"
    assert cli.main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    image = Image.open(out)
    assert (image.format, image.size) == ("PNG", plot.PIXELS)
    assert _pixels_of(out, BLUE) > 1000 and _pixels_of(out, ORANGE) > 1000  # both runs' lines

    before = out.read_bytes()
    assert cli.main(["plot", str(b), "--out", str(out)]) == 2  # another verb's rule: no silent replace
    assert out.read_bytes() == before
    assert cli.main(["plot", str(b), "--out", str(out), "--force"]) == 0
    assert _pixels_of(out, ORANGE) == 0  # runB alone now, in the first colour

    # One run: its own RUN_DIR/curves.png (the file `train` redraws), replaced without --force.
    for _ in range(2):
        assert cli.main(["plot", str(a)]) == 0
    assert _pixels_of(a / rundir.CURVES_FILE, BLUE) > 1000 and _pixels_of(a / rundir.CURVES_FILE, ORANGE) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "runA", "runB"]  # no temporary file left


def test_runs_of_the_same_name_are_told_apart_by_their_parents(tmp_path: Path) -> None:
    names = plot.run_labels([tmp_path / "a" / "tiny", tmp_path / "b" / "tiny", tmp_path / "b" / "small"])
    assert names == ["a/tiny", "b/tiny", "small"]


def test_tokens_on_the_x_axis_put_evaluations_between_the_logged_steps(tmp_path: Path) -> None:
    run = _run(tmp_path, "r", {1: 6.0, 3: 5.5, 6: 5.0, 9: 4.5}, val={4: 5.6, 9: 4.7})
    fig = plot.figure(plot.load_runs([run]), "tokens")
    train_line, val_line = fig.axes[0].lines
    assert list(train_line.get_xdata()) == [256, 768, 1536, 2304]
    # step 4 logged no training record: its evaluation sits where the run's tokens were by then
    assert list(val_line.get_xdata()) == [1024, 2304] and list(val_line.get_ydata()) == [5.6, 4.7]


def test_text_prints_a_sparkline_and_the_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    losses = dict(enumerate([6.0, 5.0, 4.0, 4.5, 3.0, 3.5], start=1))
    run = _run(tmp_path, "r", losses, val={3: 4.1, 6: 3.6})
    assert cli.main(["plot", str(run), "--text"]) == 0
    speeds = [r["tokens_per_sec"] for r in read_metrics(run / rundir.METRICS_FILE) if "loss" in r]
    assert capsys.readouterr().out.splitlines() == [
        "r  6 steps, 1,536 tokens",
        "  loss █▆▃▅▁▂  first 6.0000  last 3.5000  min 3.0000 (step 5)",
        "  val  best 3.6000 at step 6 (2 evaluations)",
        f"  lr   last 6.0e-03  tokens/s median {statistics.median(speeds):,.0f}",
    ]
    assert not (run / rundir.CURVES_FILE).exists()


def test_a_long_loss_becomes_sixty_characters_from_lowest_to_highest() -> None:
    line = plot.sparkline([float(v) for v in range(600, 0, -1)])
    assert len(line) == 60 and line[0] == "█" and line[-1] == "▁"
    assert list(line) == sorted(line, key=plot.SPARK.index, reverse=True)


def test_train_leaves_its_curves_drawn_after_the_last_record(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    run_dir = trained_run(tmp_path_factory)
    png = run_dir / rundir.CURVES_FILE
    assert Image.open(png).size == plot.PIXELS
    assert png.stat().st_mtime_ns >= (run_dir / rundir.METRICS_FILE).stat().st_mtime_ns
    assert _pixels_of(png, BLUE) > 1000
    assert not list(run_dir.glob(f".{rundir.CURVES_FILE}.tmp*"))
    # llmtrain's own file: a fresh `train` may still start over in this directory (.trained: the fixture's)
    assert rundir.foreign_names(run_dir) == [".trained"]
