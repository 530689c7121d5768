"""Learning-rate schedules as pure functions of the step.

`step` is the number of optimizer steps already taken, so the LR used for the first update is
`lr_at(0, ...)` and the last update of a `total_steps` run uses `lr_at(total_steps - 1, ...)`.

Every schedule starts with the same linear warmup over `warmup_steps` updates:

    lr_at(step) = peak * (step + 1) / warmup_steps        for step < warmup_steps

so the first update uses peak / warmup_steps (never exactly 0, which would waste an update) and the
last warmup update (step warmup_steps - 1) uses the peak. With `warmup_steps = 0` step 0 is at the peak.
The "peak step" is that last warmup update (step 0 without warmup); decays run from the peak step,
where the LR is `peak`, to the last step `total_steps - 1`, where it is `min_lr_ratio * peak`:

- `cosine`:   min + (peak - min) * (1 + cos(pi * p)) / 2, p = (step - peak_step) / (last - peak_step)
- `linear`:   min + (peak - min) * (1 - p)
- `constant`: peak after the warmup (min_lr_ratio is ignored)
- `wsd`:      warmup-stable-decay. The final `decay_steps` updates (given, or
              round(decay_fraction * total_steps)) decay; everything between the warmup and them is at
              the peak. Decay progress is
              p = (step - last_stable_step) / decay_steps, so the last stable step is at the peak, the
              first decay step is already below it and the last step reaches min. The decay shape is
              `linear` (1 - p), `cosine` ((1 + cos(pi p)) / 2) or `sqrt` (1 - sqrt(p), Hägele et al. 2024).

Steps past the end of the run stay at the final LR. The run length itself is `TrainConfig.total_steps`
(`--steps`, or `--tokens` rounded up to whole steps).
"""

from __future__ import annotations

import dataclasses
import math

from llmtrain.config import ConfigError, ScheduleConfig, TrainConfig, flag_for


def lr_at(step: int, cfg: ScheduleConfig, peak_lr: float, total_steps: int) -> float:
    """The learning rate of the update made after `step` optimizer steps (see the module docstring)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    step = min(step, total_steps - 1)
    warmup = cfg.warmup_steps or 0  # TrainConfig.warmup_steps resolves `none` before this is called
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    if cfg.name == "constant":
        return peak_lr
    min_lr = cfg.min_lr_ratio * peak_lr
    if cfg.name == "wsd":
        decay = wsd_decay_steps(cfg, total_steps)
        last_stable = total_steps - 1 - decay
        if step <= last_stable:
            return peak_lr
        return _decayed(peak_lr, min_lr, (step - last_stable) / decay, cfg.decay_shape)
    # cosine and linear decay from the peak step to the last step.
    peak_step = max(warmup - 1, 0)
    span = total_steps - 1 - peak_step
    if span <= 0:
        return peak_lr
    progress = (step - peak_step) / span
    return _decayed(peak_lr, min_lr, progress, "cosine" if cfg.name == "cosine" else "linear")


def wsd_decay_steps(cfg: ScheduleConfig, total_steps: int) -> int:
    """Updates in the WSD decay phase: decay_steps, else decay_fraction of the run rounded half up,
    at least 1 (a fork that starts its cooldown now gives decay_steps)."""
    if cfg.decay_steps is not None:
        return min(total_steps, cfg.decay_steps)
    return min(total_steps, max(1, math.floor(cfg.decay_fraction * total_steps + 0.5)))


def _decayed(peak_lr: float, min_lr: float, progress: float, shape: str) -> float:
    """Interpolate from peak (progress 0) to min (progress 1) with the given shape."""
    if shape == "linear":
        remaining = 1.0 - progress
    elif shape == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif shape == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown decay shape {shape!r}")
    return min_lr + (peak_lr - min_lr) * remaining


def lr_for(cfg: TrainConfig, step: int) -> float:
    """`lr_at` with the run's schedule, peak LR (`--lr`) and length."""
    schedule = dataclasses.replace(cfg.schedule, warmup_steps=cfg.warmup_steps)
    return lr_at(step, schedule, cfg.optim.lr, cfg.total_steps)


def check_schedule(cfg: TrainConfig) -> None:
    """Reject schedules that cannot run as asked; raises ConfigError naming the flag to change."""
    s, total = dataclasses.replace(cfg.schedule, warmup_steps=cfg.warmup_steps), cfg.total_steps
    assert s.warmup_steps is not None
    warmup_flag = flag_for("schedule.warmup_steps")
    length = f"the run's {total} steps (--steps, or --tokens / tokens per step)"
    if s.warmup_steps > total:
        raise ConfigError(
            f"{warmup_flag}: {s.warmup_steps} warmup steps exceed {length}; "
            "lower --warmup-steps or train longer"
        )
    if s.name in ("cosine", "linear") and s.warmup_steps >= total and total > 1:
        raise ConfigError(
            f"{warmup_flag}: {s.warmup_steps} warmup steps leave no steps of {s.name} decay in {length}; "
            "lower --warmup-steps or train longer"
        )
    if s.name == "wsd":
        decay = wsd_decay_steps(s, total)
        if s.warmup_steps + decay > total:
            given = "decay_steps" if s.decay_steps is not None else "decay_fraction"
            raise ConfigError(
                f"{warmup_flag}: {s.warmup_steps} warmup steps plus {decay} decay steps "
                f"({flag_for('schedule.' + given)}={getattr(s, given)}) exceed {length}; "
                f"lower --warmup-steps or schedule.{given}, or train longer"
            )
