"""Guard against non-finite and spiking losses and gradient norms, with state that survives resume.

Each optimizer step, before the update is applied, the trainer calls `guard.check(loss, grad_norm)`:

- a non-finite loss or gradient norm (NaN, ±inf) always skips the update;
- once `min_history` accepted values are in the running window, a loss more than `loss_spike_std`
  population standard deviations above the window mean is a loss spike, and a gradient norm more than
  `grad_spike_std` deviations above its window mean is a gradient-norm spike. Only upward jumps count.
  Policy `skip` skips the update; policy `warn` applies it and only reports the spike;
- skipped values never enter the windows (a spike must not raise the bar for the next one); applied
  values, including warned spikes, do;
- the `max_consecutive_skips`-th skip in a row raises `TrainingDiverged`.

Distributed runs: the guard is deterministic, so every rank reaches the same verdict only if every rank
feeds it identical numbers. The trainer must all-reduce the loss (mean) and the gradient norm (global)
before calling `check`, on every rank, so that all ranks skip or apply the same update.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from llmtrain.config import ConfigError, StabilityConfig, flag_for
from llmtrain.errors import RunFailure


class TrainingDiverged(RunFailure):
    """Too many updates in a row were skipped; the run stops with its last checkpoint intact."""

    on_every_rank = True  # the skips are agreed by every rank's update verdict


@dataclass(frozen=True)
class Verdict:
    """What to do with this step's update. `reason` is set for every skip and every warned spike."""

    skip: bool
    reason: str | None = None
    spike: bool = False  # a loss or grad-norm spike was detected (under either policy)

    @property
    def warn(self) -> bool:
        """A spike reported under the `warn` policy: the update is applied."""
        return self.reason is not None and not self.skip


OK = Verdict(skip=False)


class StabilityGuard:
    """Judges each step's (loss, grad_norm); counts skips and spikes; `state_dict()` for resume."""

    def __init__(self, cfg: StabilityConfig) -> None:
        _validate(cfg)
        self.cfg = cfg
        self.loss_window: deque[float] = deque(maxlen=cfg.window)
        self.grad_window: deque[float] = deque(maxlen=cfg.window)
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.spikes_total = 0
        self.nonfinite_total = 0

    # ---- the one call the trainer makes per step
    def check(self, loss: float, grad_norm: float | None) -> Verdict:
        """Judge this step and record the outcome. Raises TrainingDiverged on too many skips in a row.

        `grad_norm=None` means the norm is unknown this step; only the loss is judged then.
        """
        verdict = self.judge(loss, grad_norm)
        self.record(loss, grad_norm, verdict)
        return verdict

    def judge(self, loss: float, grad_norm: float | None) -> Verdict:
        """The verdict for these values, without changing any state."""
        nonfinite = [
            name
            for name, value in (("loss", loss), ("grad norm", grad_norm))
            if value is not None and not math.isfinite(value)
        ]
        if nonfinite:
            return Verdict(skip=True, reason="non-finite " + " and ".join(nonfinite))
        spikes = []
        loss_sigma = _sigma_above(loss, self.loss_window, self.cfg.min_history)
        if loss_sigma is not None and loss_sigma > self.cfg.loss_spike_std:
            spikes.append(f"loss spike {loss_sigma:.1f}σ")
        if grad_norm is not None:
            grad_sigma = _sigma_above(grad_norm, self.grad_window, self.cfg.min_history)
            if grad_sigma is not None and grad_sigma > self.cfg.grad_spike_std:
                spikes.append(f"grad-norm spike {grad_sigma:.1f}σ")
        if not spikes:
            return OK
        return Verdict(skip=self.cfg.policy == "skip", reason=", ".join(spikes), spike=True)

    def record(self, loss: float, grad_norm: float | None, verdict: Verdict) -> None:
        """Apply a verdict to the counters and windows (what `check` does after `judge`)."""
        if verdict.spike:
            self.spikes_total += 1
        if not verdict.skip:
            self.consecutive_skips = 0
            self.loss_window.append(float(loss))
            if grad_norm is not None:
                self.grad_window.append(float(grad_norm))
            return
        self.skipped_total += 1
        self.consecutive_skips += 1
        if not verdict.spike:
            self.nonfinite_total += 1
        if self.consecutive_skips >= self.cfg.max_consecutive_skips:
            raise TrainingDiverged(
                f"{self.consecutive_skips} updates in a row were skipped (last: {verdict.reason}); "
                f"the run stopped with its last checkpoint intact. Lower --lr, raise "
                f"{flag_for('stability.max_consecutive_skips')} (now {self.cfg.max_consecutive_skips}), "
                "or resume from an earlier checkpoint"
            )

    # ---- resume
    def state_dict(self) -> dict[str, Any]:
        """Plain data (lists of floats, ints): safe for torch.save, JSON and YAML."""
        return {
            "loss_window": list(self.loss_window),
            "grad_window": list(self.grad_window),
            "skipped_total": self.skipped_total,
            "consecutive_skips": self.consecutive_skips,
            "spikes_total": self.spikes_total,
            "nonfinite_total": self.nonfinite_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output. With a smaller window now, the newest values are kept."""
        self.loss_window = deque(_floats(state["loss_window"]), maxlen=self.cfg.window)
        self.grad_window = deque(_floats(state["grad_window"]), maxlen=self.cfg.window)
        self.skipped_total = int(state["skipped_total"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.spikes_total = int(state["spikes_total"])
        self.nonfinite_total = int(state.get("nonfinite_total", 0))


def _floats(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values]


def _sigma_above(value: float, window: deque[float], min_history: int) -> float | None:
    """How many population standard deviations `value` lies above the window mean; None if too early.

    A perfectly flat window has std 0; a floor of 1e-6 x |mean| (and 1e-12 absolute) keeps the ratio
    finite, so any clear rise above a flat history still counts as a spike.
    """
    if len(window) < max(min_history, 2):
        return None
    mean = math.fsum(window) / len(window)
    variance = math.fsum((x - mean) ** 2 for x in window) / len(window)
    std = max(math.sqrt(variance), 1e-6 * abs(mean), 1e-12)
    return (value - mean) / std


def _validate(cfg: StabilityConfig) -> None:
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{flag_for(key)}: {message}")

    require(cfg.policy in ("warn", "skip"), "stability.policy", f"must be warn or skip, got {cfg.policy!r}")
    require(cfg.loss_spike_std > 0, "stability.loss_spike_std", f"must be positive, got {cfg.loss_spike_std}")
    require(cfg.grad_spike_std > 0, "stability.grad_spike_std", f"must be positive, got {cfg.grad_spike_std}")
    require(cfg.window > 1, "stability.window", f"must be at least 2, got {cfg.window}")
    require(cfg.min_history >= 0, "stability.min_history", f"must be >= 0, got {cfg.min_history}")
    require(
        cfg.min_history <= cfg.window,
        "stability.min_history",
        f"{cfg.min_history} exceeds stability.window={cfg.window}, so spikes would never be judged; "
        "lower it or raise the window",
    )
    require(
        cfg.max_consecutive_skips > 0,
        "stability.max_consecutive_skips",
        f"must be positive, got {cfg.max_consecutive_skips}",
    )
