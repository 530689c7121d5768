"""StabilityGuard with plain numbers. History [1, 3, 1, 3]: mean 2, population std 1."""

from __future__ import annotations

import json
import math

import pytest

from llmtrain.config import ConfigError, StabilityConfig
from llmtrain.train.stability import StabilityGuard, TrainingDiverged, Verdict

HISTORY = [1.0, 3.0, 1.0, 3.0]


def guard(policy: str = "skip", max_skips: int = 3, window: int = 10) -> StabilityGuard:
    cfg = StabilityConfig(
        policy=policy,  # type: ignore[arg-type]
        loss_spike_std=3.0,
        grad_spike_std=3.0,
        window=window,
        min_history=4,
        max_consecutive_skips=max_skips,
    )
    g = StabilityGuard(cfg)
    for value in HISTORY:
        assert g.check(value, value) == Verdict(skip=False)
    return g


def test_non_finite_always_skips_and_stays_out_of_the_window() -> None:
    g = guard(policy="warn")  # even under warn
    before = g.state_dict()
    v = g.check(math.nan, 1.0)
    assert v.skip and v.reason == "non-finite loss"
    assert g.check(2.0, math.inf).reason == "non-finite grad norm"
    assert g.skipped_total == 2 and g.consecutive_skips == 2 and g.spikes_total == 0
    assert g.state_dict()["loss_window"] == before["loss_window"]


def test_non_finite_skips_before_any_history() -> None:
    g = StabilityGuard(StabilityConfig())
    assert g.check(-math.inf, None).skip


def test_spike_threshold_is_exactly_k_std() -> None:
    g = guard()
    assert g.judge(5.0, 2.0) == Verdict(skip=False)  # exactly 3 std above the mean: not a spike
    assert g.judge(5.0001, 2.0).skip  # just above: a spike
    assert g.judge(2.0, 5.0) == Verdict(skip=False)
    grad = g.judge(2.0, 5.0001)
    assert grad.skip and grad.reason == "grad-norm spike 3.0σ"
    assert g.judge(-100.0, 0.0) == Verdict(skip=False)  # falling fast is not a spike


def test_reason_names_the_size_and_both_spikes() -> None:
    g = guard()
    assert g.judge(11.0, 2.0).reason == "loss spike 9.0σ"
    assert g.judge(11.0, 8.0).reason == "loss spike 9.0σ, grad-norm spike 6.0σ"


def test_no_spikes_judged_before_min_history() -> None:
    g = StabilityGuard(StabilityConfig(loss_spike_std=3.0, window=10, min_history=4))
    for value in HISTORY[:3]:
        g.check(value, value)
    assert not g.check(1000.0, 1000.0).skip  # only 3 values of history
    assert g.judge(1e6, 1.0).skip  # now 4 values: judged


def test_skip_policy_skips_and_keeps_window() -> None:
    g = guard(policy="skip")
    v = g.check(11.0, 2.0)
    assert v.skip and v.spike and not v.warn
    assert g.skipped_total == 1 and g.spikes_total == 1 and g.consecutive_skips == 1
    assert list(g.loss_window) == HISTORY
    assert g.check(2.0, 2.0) == Verdict(skip=False)
    assert g.consecutive_skips == 0 and g.skipped_total == 1


def test_warn_policy_reports_and_applies() -> None:
    g = guard(policy="warn")
    v = g.check(11.0, 2.0)
    assert not v.skip and v.warn and v.reason == "loss spike 9.0σ"
    assert g.skipped_total == 0 and g.spikes_total == 1 and g.consecutive_skips == 0
    assert list(g.loss_window) == [*HISTORY, 11.0]  # applied values join the window


def test_consecutive_skips_stop_the_run() -> None:
    g = guard(max_skips=3)
    g.check(math.nan, 1.0)
    g.check(math.nan, 1.0)
    g.check(2.0, 2.0)  # a good step resets the streak
    g.check(math.nan, 1.0)
    g.check(11.0, 2.0)
    with pytest.raises(TrainingDiverged) as info:
        g.check(math.nan, 1.0)
    message = str(info.value)
    assert message.startswith("3 updates in a row were skipped (last: non-finite loss)")
    for hint in ("--lr", "stability.max_consecutive_skips", "earlier checkpoint"):
        assert hint in message
    assert g.skipped_total == 5 and g.consecutive_skips == 3


def _continuation() -> list[tuple[float, float]]:
    # Values that depend on the history: 4.5 is a spike only after the steady values 2.0-2.4.
    return [(2.0 + 0.1 * (i % 5), 1.0 + 0.05 * (i % 3)) for i in range(6)] + [
        (4.5, 1.0),
        (2.1, 3.0),
        (math.nan, 1.0),
        (2.2, 1.05),
        (3.0, 1.0),
    ]


def test_state_round_trip_gives_identical_verdicts() -> None:
    first = StabilityGuard(StabilityConfig(loss_spike_std=3.0, grad_spike_std=3.0, window=8, min_history=4))
    for i in range(30):
        first.check(2.0 + 0.1 * (i % 5), 1.0 + 0.05 * (i % 3))
    first.check(math.nan, 1.0)
    state = json.loads(json.dumps(first.state_dict()))  # plain data survives any serializer
    resumed = StabilityGuard(first.cfg)
    resumed.load_state_dict(state)
    fresh = StabilityGuard(first.cfg)

    verdicts = [(first.check(*v), resumed.check(*v), fresh.check(*v)) for v in _continuation()]
    assert [a for a, _, _ in verdicts] == [b for _, b, _ in verdicts]
    assert first.state_dict() == resumed.state_dict()
    assert [a for a, _, _ in verdicts] != [c for _, _, c in verdicts]  # the state matters
    assert [a.reason for a, _, _ in verdicts][6:] == [
        "loss spike 14.9σ",
        "grad-norm spike 49.8σ",
        "non-finite loss",
        None,
        "loss spike 5.3σ",
    ]


def test_load_into_smaller_window_keeps_newest() -> None:
    g = guard(window=10)
    small = StabilityGuard(StabilityConfig(window=3, min_history=2))
    small.load_state_dict(g.state_dict())
    assert list(small.loss_window) == HISTORY[-3:]


def test_flat_history_still_detects_a_rise() -> None:
    g = StabilityGuard(StabilityConfig(loss_spike_std=6.0, window=5, min_history=5))
    for _ in range(5):
        g.check(2.0, 1.0)
    assert not g.judge(2.0, 1.0).skip
    assert g.judge(2.01, 1.0).skip


def test_bad_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"--set stability.min_history: 60 exceeds stability.window=50"):
        StabilityGuard(StabilityConfig(min_history=60, window=50))
    with pytest.raises(ConfigError, match=r"--set stability.loss_spike_std: must be positive"):
        StabilityGuard(StabilityConfig(loss_spike_std=0))
