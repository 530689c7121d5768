"""bench_parallel's own arithmetic, without starting a process: the straight-line fit of step peak
against seq_len, the longest seq_len it allows within a budget, and the checks on its flags."""

from __future__ import annotations

import pytest

from bench.bench_parallel import Fit, parse_args


def test_fit_recovers_the_line_and_solves_for_the_budget() -> None:
    fit = Fit.of({n: 50 + 0.2 * n for n in (256, 512, 1024)})
    assert fit.intercept == pytest.approx(50)
    assert fit.slope == pytest.approx(0.2)
    assert fit.max_residual == pytest.approx(0, abs=1e-9)
    assert fit.longest_seq_len(450) == 1984  # 2000 tokens, rounded down to a multiple of 64
    assert fit.longest_seq_len(40) == 0  # below the intercept: nothing fits


def test_a_peak_that_does_not_grow_is_refused() -> None:
    with pytest.raises(ValueError, match="does not grow"):
        Fit.of({256: 100.0, 512: 90.0}).longest_seq_len(1000)


def test_the_timed_seq_len_is_one_of_the_fitted_points() -> None:
    args = parse_args(["--seq-len", "128", "--memory-seq-lens", "512,256"])
    assert args.memory_seq_lens == [128, 256, 512]


@pytest.mark.parametrize("seq_lens", ["256", "256,513"])
def test_too_few_or_odd_seq_lens_are_refused(seq_lens: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--memory-seq-lens", seq_lens])
