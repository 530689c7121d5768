"""bench_memory: its sampling steps, metrics reader and verdict (no process started), and one short run of
the whole benchmark (a real 1-process `llmtrain train`) whose samples and result file are what it promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from benchkit import assert_printed_and_written

from bench.bench_memory import MetricsTail, growth, main, parse_args, sample_steps, verdict_line


def test_sample_steps_are_the_first_every_nth_after_it_and_the_last() -> None:
    assert sample_steps(100, 250, 3000) == [100, *range(250, 3000, 250), 3000]
    assert sample_steps(10, 10, 30) == [10, 20, 30]
    assert sample_steps(300, 250, 600) == [300, 500, 600]  # none before the baseline


def test_flags() -> None:
    assert parse_args([]).steps == 3000
    for bad in (["--first", "3000"], ["--first", "0"], ["--every", "0"], ["--limit", "0.9"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_metrics_reader_skips_a_half_written_line_and_non_step_records(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() is None  # no file yet
    path.write_text('{"step": 10, "loss": 5.0}\n{"step": 20, "lo')
    assert tail.poll() == {"step": 10, "loss": 5.0}
    with path.open("a") as f:
        f.write('ss": 4.0}\n{"step": 20, "val_loss": 4.5}\n')
    assert tail.poll() == {"step": 20, "loss": 4.0}


def _samples(*mib: float) -> list[dict[str, Any]]:
    return [{"step": 100 * (i + 1), "rss_bytes": int(m * 2**20)} for i, m in enumerate(mib)]


def test_the_verdict_is_the_last_sample_over_the_first() -> None:
    flat = growth(_samples(400, 500, 419), 1.05)
    assert flat["ratio"] == pytest.approx(419 / 400) and flat["pass"]
    assert flat["grew_mib"] == pytest.approx(19, abs=1e-5)
    grown = growth(_samples(400, 420), 1.05)
    assert not grown["pass"]
    assert verdict_line(grown).startswith("FAIL: RSS at step 200 / step 100 = 1.0500")


@pytest.mark.slow
def test_a_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "memory.json"
    # A generous limit: this checks the mechanics (the first steps of a run still grow: allocator, checkpoint).
    flags = ["--steps", "20", "--first", "10", "--every", "10", "--save-every", "20", "--limit", "3"]
    result = main([*flags, "--out", str(out)])
    printed = capsys.readouterr().out
    assert_printed_and_written(printed, result, out)
    assert "PASS: RSS at step 20 / step 10" in printed

    samples = result["samples"]
    assert [s["step"] for s in samples] == [10, 20]
    assert [s["logged_step"] for s in samples] == [10, 20]  # seen before the next record (10 steps on)
    assert [s["checkpoint_due"] for s in samples] == [False, True]
    for s in samples:
        assert s["processes"] == 1  # one process trains in place, no launcher
        assert 50 * 2**20 < s["rss_bytes"] < 8 * 2**30  # torch and DeepSpeed imported: tens of MiB at least
        assert s["rss_mib"] == s["rss_bytes"] / 2**20
    assert result["growth"]["ratio"] == samples[-1]["rss_bytes"] / samples[0]["rss_bytes"]
    assert result["command"][:3] == ["llmtrain", "train", "--preset"]
    assert result["command"][result["command"].index("--steps") + 1] == "30"  # a log interval past the last
    assert result["machine"]["world_size"] == 1 and "git_sha" in result["machine"]
