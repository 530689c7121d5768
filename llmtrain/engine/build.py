"""The engine a config asks for: FSDP2, DeepSpeed's pipeline engine (--pp > 1), or DeepSpeed, and the
settings it is built from (DeepSpeed's config dict, or FSDP2's plan)."""

from __future__ import annotations

from typing import Any

from llmtrain.config import TrainConfig
from llmtrain.engine import ds_engine, fsdp2, pipeline
from llmtrain.engine.base import Engine
from llmtrain.parallel.distributed import World
from llmtrain.planning import dsconfig, fsdp2_plan


def engine_config(cfg: TrainConfig, world: World, load_universal: bool = False) -> dict[str, Any]:
    """What the engine is built from, kept in the run directory: fsdp2_plan.build's dict for FSDP2,
    dsconfig.build's for DeepSpeed (`load_universal`: resuming from a universal checkpoint)."""
    if cfg.train.engine == "fsdp2":
        return fsdp2_plan.build(cfg, world.world_size, ranks_per_node=world.local_world_size)
    return dsconfig.build(
        cfg, world.world_size, world.accelerator, load_universal, ranks_per_node=world.local_world_size
    )


def build_engine(cfg: TrainConfig, world: World, engine_config: dict[str, Any]) -> Engine:
    """`engine_config`: dsconfig.build's dict for DeepSpeed, fsdp2_plan.build's for FSDP2."""
    if cfg.train.engine == "fsdp2":
        return fsdp2.build_engine(cfg, engine_config, world.device, world.accelerator)
    if cfg.parallel.pp > 1:
        return pipeline.build_engine(cfg, engine_config, world.device, world.world_size)
    return ds_engine.build_engine(cfg, engine_config, world.device, world.world_size)
