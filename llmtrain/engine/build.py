"""The engine a config asks for: FSDP2, DeepSpeed's pipeline engine (--pp > 1), or DeepSpeed."""

from __future__ import annotations

from typing import Any

from llmtrain.config import TrainConfig
from llmtrain.engine import ds_engine, fsdp2, pipeline
from llmtrain.engine.base import Engine
from llmtrain.parallel.distributed import World


def build_engine(cfg: TrainConfig, world: World, ds_config: dict[str, Any] | None) -> Engine:
    """`ds_config` is dsconfig.build's dict for a DeepSpeed run, None for FSDP2 (which has none)."""
    if ds_config is None:
        return fsdp2.build_engine(cfg, world.device, world.world_size, world.accelerator)
    if cfg.parallel.pp > 1:
        return pipeline.build_engine(cfg, ds_config, world.device, world.world_size)
    return ds_engine.build_engine(cfg, ds_config, world.device, world.world_size)
