"""The trainer as `llmtrain train` builds it inside a launcher, for tests that run in `dist.run_distributed`
ranks: every scenario builds a fresh engine and trains in its own run directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def build(rank: int, world_size: int, run_dir: str, flags: dict[str, Any], faults: str = "") -> Any:
    """A Trainer for `flags` (config keys), derived numbers fixed as run.prepare does."""
    from llmtrain.config import resolve
    from llmtrain.parallel.distributed import World
    from llmtrain.run import prepare
    from llmtrain.train import faults as faults_mod
    from llmtrain.train.trainer import build_trainer

    cfg = resolve(flags={**flags, "launch.gpus": world_size, "run_dir": run_dir})
    prepare.derive(cfg)
    os.environ[faults_mod.ENV] = faults  # read by the Trainer when it is built
    try:
        world = World(rank, rank, world_size, "cpu", local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
        return build_trainer(cfg, world, Path(run_dir), resume=False)
    finally:
        os.environ.pop(faults_mod.ENV, None)


def losses(run_dir: str | Path) -> list[float | None]:
    from llmtrain.train.metrics import METRICS_FILE, read_metrics

    return [r["loss"] for r in read_metrics(Path(run_dir) / METRICS_FILE) if "loss" in r]


def train_all(rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Train each scenario in turn; rank 0 returns each run's per-step losses from metrics.jsonl."""
    out: dict[str, Any] = {}
    for name, flags in scenarios.items():
        run_dir = str(Path(root) / name)
        summary = build(rank, world_size, run_dir, flags).train()
        out[name] = {"losses": losses(run_dir) if rank == 0 else None, "summary": summary}
    return out
