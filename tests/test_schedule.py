"""LR schedules with plain numbers: peak 2.0, min_lr_ratio 0.1 (min 0.2)."""

from __future__ import annotations

import itertools
import math

import pytest

from llmtrain import config
from llmtrain.config import ConfigError, ScheduleConfig
from llmtrain.train.schedule import check_schedule, lr_at, lr_for, wsd_decay_steps

PEAK = 2.0
MIN = 0.2


def sched(name: str, warmup: int = 10, **kw: object) -> ScheduleConfig:
    return ScheduleConfig(name=name, warmup_steps=warmup, min_lr_ratio=0.1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_warmup_endpoints(name: str) -> None:
    s = sched(name)
    assert lr_at(0, s, PEAK, 110) == pytest.approx(0.2)  # peak * 1/10: the first update is not wasted
    assert lr_at(4, s, PEAK, 110) == pytest.approx(1.0)
    assert lr_at(9, s, PEAK, 110) == pytest.approx(PEAK)  # last warmup update is at the peak


def test_no_warmup_starts_at_peak() -> None:
    for name in ("cosine", "linear", "constant"):
        assert lr_at(0, sched(name, warmup=0), PEAK, 110) == pytest.approx(PEAK)


@pytest.mark.parametrize(
    ("name", "quarter", "mid"),
    [
        # decay runs from step 9 (peak) to step 109 (min): p = (step - 9) / 100
        ("cosine", MIN + (PEAK - MIN) * (1 + math.cos(math.pi / 4)) / 2, 1.1),
        ("linear", 1.55, 1.1),
    ],
)
def test_decay_shape_and_min_at_last_step(name: str, quarter: float, mid: float) -> None:
    s = sched(name)
    assert lr_at(34, s, PEAK, 110) == pytest.approx(quarter)
    assert lr_at(59, s, PEAK, 110) == pytest.approx(mid)
    assert lr_at(10, s, PEAK, 110) < PEAK
    assert lr_at(109, s, PEAK, 110) == pytest.approx(MIN)
    assert lr_at(500, s, PEAK, 110) == pytest.approx(MIN)  # past the end: stays at the final LR
    lrs = [lr_at(step, s, PEAK, 110) for step in range(9, 110)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_constant_holds_peak_to_the_end() -> None:
    s = sched("constant")
    assert [lr_at(step, s, PEAK, 110) for step in (10, 60, 109)] == [PEAK, PEAK, PEAK]


def test_wsd_phase_boundaries() -> None:
    # 100 steps, decay_fraction 0.2: steps 80..99 decay, step 79 is the last stable step.
    s = sched("wsd", decay_fraction=0.2, decay_shape="linear")
    assert wsd_decay_steps(s, 100) == 20
    assert lr_at(10, s, PEAK, 100) == PEAK
    assert lr_at(79, s, PEAK, 100) == PEAK
    assert lr_at(80, s, PEAK, 100) == pytest.approx(MIN + (PEAK - MIN) * 19 / 20)
    assert lr_at(99, s, PEAK, 100) == pytest.approx(MIN)


@pytest.mark.parametrize(
    ("shape", "quarter", "mid"),
    [
        ("linear", 1.55, 1.1),
        ("cosine", MIN + (PEAK - MIN) * (1 + math.cos(math.pi / 4)) / 2, 1.1),
        ("sqrt", 1.1, MIN + (PEAK - MIN) * (1 - math.sqrt(0.5))),
    ],
)
def test_wsd_decay_shapes(shape: str, quarter: float, mid: float) -> None:
    s = sched("wsd", decay_fraction=0.2, decay_shape=shape)
    assert lr_at(84, s, PEAK, 100) == pytest.approx(quarter)  # p = 5/20
    assert lr_at(89, s, PEAK, 100) == pytest.approx(mid)  # p = 10/20
    assert lr_at(99, s, PEAK, 100) == pytest.approx(MIN)


def test_tokens_to_steps_and_lr_for() -> None:
    cfg = config.resolve(flags={"train.tokens": 1_000_000, "train.global_batch": 8, "train.seq_len": 256})
    assert cfg.tokens_per_step == 2048
    assert cfg.total_steps == 489  # ceil(1_000_000 / 2048)
    assert cfg.warmup_steps == 48  # default: a tenth of the run, at most 100
    assert lr_for(cfg, 0) == pytest.approx(cfg.optim.lr / 48)
    assert lr_for(cfg, 47) == pytest.approx(cfg.optim.lr)
    long_run = config.resolve(flags={"train.steps": 5000})
    assert long_run.warmup_steps == 100
    assert lr_for(cfg, 488) == pytest.approx(cfg.optim.lr * cfg.schedule.min_lr_ratio)


def test_check_schedule_rejects_warmup_longer_than_run() -> None:
    cfg = config.resolve(
        flags={"train.tokens": 1_000_000, "train.global_batch": 8, "schedule.warmup_steps": 600}
    )
    with pytest.raises(ConfigError, match=r"--warmup-steps: 600 warmup steps exceed the run's 489 steps"):
        check_schedule(cfg)


def test_check_schedule_wsd_needs_room_for_decay() -> None:
    cfg = config.resolve(flags={"train.steps": 100, "schedule.name": "wsd", "schedule.warmup_steps": 90})
    with pytest.raises(ConfigError, match=r"--warmup-steps: 90 warmup steps plus 20 decay steps"):
        check_schedule(cfg)
    cfg.schedule.warmup_steps = 80  # warmup ends exactly where the decay begins
    check_schedule(cfg)


def test_check_schedule_decay_needs_a_step_after_warmup() -> None:
    cfg = config.resolve(flags={"train.steps": 100, "schedule.warmup_steps": 100})
    with pytest.raises(ConfigError, match="--warmup-steps"):
        check_schedule(cfg)
    cfg.schedule.name = "constant"
    check_schedule(cfg)
    cfg.schedule.warmup_steps = 99
    cfg.schedule.name = "cosine"
    check_schedule(cfg)
    assert lr_for(cfg, 98) == pytest.approx(cfg.optim.lr)
    assert lr_for(cfg, 99) == pytest.approx(cfg.optim.lr * cfg.schedule.min_lr_ratio)
