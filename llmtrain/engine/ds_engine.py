"""The DeepSpeed engine: the Llama model (activation checkpointing, compiled blocks) wrapped by
`deepspeed.initialize` with the config dict from dsconfig and AdamW's weight-decay groups, and the one
step-time quirk of DeepSpeed's stage-0 fp32 path (a bare torch optimizer) that the loop must work around."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from llmtrain.config import TrainConfig
from llmtrain.model import Llama, build_model
from llmtrain.parallel.layout import Layout, process_groups


def build_engine(
    cfg: TrainConfig, ds_config: dict[str, Any], device: torch.device, world_size: int = 1
) -> Any:
    """The model built on `device`, wrapped by deepspeed.initialize with the optimizer's param groups
    and the process groups of the run's layout over `world_size` ranks.

    Every rank builds the whole model from the same seed; AutoTP then keeps each rank's slices, so a
    tensor-parallel run starts from exactly the weights of a one-process run.
    """
    import deepspeed

    mpu = process_groups(Layout.of(cfg, world_size))
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing, cfg.train.checkpoint_every_k)
    if cfg.parallel.sp > 1:
        model.set_sequence_parallel(mpu.get_sequence_parallel_group())
    if cfg.train.compile:
        model.compile_blocks()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg.optim.weight_decay), config=ds_config, mpu=mpu
    )
    return engine


def param_groups(model: Llama, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only: not on norms, not on the (possibly tied) embedding."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        is_matrix = param.ndim >= 2 and not name.startswith("embed_tokens")
        (decay if is_matrix else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@contextlib.contextmanager
def update_suppressed(optimizer: Any, suppress: bool) -> Iterator[None]:
    """Stage 0 fp32: the bare torch optimizer must not see a non-finite gradient. DeepSpeed's step still
    runs (clipping, zero_grad, step counters stay in line); only the optimizer's update is a no-op.
    (Setting the gradients to None instead makes DeepSpeed's fp32 clipping fail on an empty list.)"""
    if not suppress:
        yield
        return
    optimizer.step = lambda *args, **kwargs: None  # shadows the class's step for this one call
    try:
        yield
    finally:
        del optimizer.step
