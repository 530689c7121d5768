"""The DeepSpeed engine: the Llama model (activation checkpointing, compiled blocks) wrapped by
`deepspeed.initialize` with the config dict from dsconfig and AdamW's weight-decay groups, and the one
step-time quirk of DeepSpeed's stage-0 fp32 path (a bare torch optimizer) that the loop must work around."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmtrain.config import TrainConfig
from llmtrain.model import build_model
from llmtrain.parallel.layout import process_groups


def build_engine(
    cfg: TrainConfig, ds_config: dict[str, Any], device: torch.device, world_size: int = 1
) -> Any:
    """The model built on `device`, wrapped by deepspeed.initialize with the optimizer's param groups
    and the process groups of the run's layout over `world_size` ranks.

    Every rank builds the whole model from the same seed; AutoTP then keeps each rank's slices, so a
    tensor-parallel run starts from exactly the weights of a one-process run.
    """
    import deepspeed

    mpu = process_groups(cfg.layout(world_size))
    if cfg.parallel.pp > 1:
        return _build_pipeline_engine(cfg, ds_config, device)
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing, cfg.train.checkpoint_every_k)
    if cfg.parallel.sp > 1:
        model.set_sequence_parallel(mpu.get_sequence_parallel_group())
    if cfg.train.compile:
        model.compile_blocks()
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config, mpu=mpu)
    return engine


def _build_pipeline_engine(cfg: TrainConfig, ds_config: dict[str, Any], device: torch.device) -> Any:
    """This rank's pipeline stage in DeepSpeed's PipelineEngine (the module brings its own process
    groups), running the configured schedule."""
    import deepspeed

    from llmtrain.engine import pipeline

    pipe = pipeline.build_pipeline(cfg, device)
    groups = param_groups(pipeline.named_parameters(pipe), cfg.optim.weight_decay)
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=groups, config=ds_config)
    pipeline.install_schedule(engine, cfg.parallel.pp_schedule)
    return engine


def param_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only (model.py's names): not on norms, not on the (possibly tied)
    embedding."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for name, param in named_parameters:
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


# Buffers DeepSpeed keeps beside the model states (reduce buckets, staging copies, norm scratch): the
# memory estimator lists them as terms of their own, so they are not model-state bytes.
BUFFER_ATTRIBUTES = (
    "ipg_bucket",
    "ipg_buffer",
    "temp_grad_buffer",
    "param_buffer_of_bit16_for_cpu_offload",
    "_global_grad_norm",
    "norm_for_param_grads",
    "inf_or_nan_tracker",
)


@dataclass(frozen=True)
class HeldStates:
    params: int  # parameter storage on this rank (ZeRO's flat low-precision buffers included)
    total: int  # parameters, gradients and optimizer states (fp32 masters and moments)


def held_model_states(engine: Any) -> HeldStates:
    """Bytes of the model states this rank's engine holds, each storage counted once: what the memory
    estimator's model-state terms predict (the calibration tests and `bench parallel` measure it)."""
    params: list[tuple[str, torch.Tensor]] = []
    for name, param in engine.module.named_parameters():
        params.append((name, param.data))
        if hasattr(param, "ds_tensor"):  # ZeRO-3's partition
            params.append((name, param.ds_tensor))
    others = [(n + ".grad", p.grad) for n, p in engine.module.named_parameters() if p.grad is not None]
    _reachable_tensors(engine.optimizer, "optimizer", set(), others)
    for group in engine.optimizer.param_groups:  # fp32 master partitions and their (offloaded) grads
        for master in group["params"]:
            others.append(("master", master))
            if master.grad is not None:
                others.append(("master.grad", master.grad))
    counted: set[tuple[str, int]] = set()
    param_bytes = _new_bytes(params, counted)  # first: ZeRO's flat buffers share storage with params
    return HeldStates(param_bytes, param_bytes + _new_bytes(others, counted))


def _new_bytes(found: list[tuple[str, torch.Tensor]], counted: set[tuple[str, int]]) -> int:
    total = 0
    for path, tensor in found:
        storage = tensor.untyped_storage()
        key = (tensor.device.type, storage.data_ptr())
        if storage.nbytes() == 0 or key in counted or any(b in path for b in BUFFER_ATTRIBUTES):
            continue
        counted.add(key)
        total += storage.nbytes()
    return total


def _reachable_tensors(
    obj: Any, path: str, seen: set[int], out: list[tuple[str, torch.Tensor]], depth: int = 0
) -> None:
    """Every tensor reachable from a DeepSpeed optimizer through attributes, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if depth > 6 or id(obj) in seen or isinstance(obj, torch.nn.Module):
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items: Any = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for key, value in items:
        _reachable_tensors(value, f"{path}.{key}" if isinstance(key, str) else path, seen, out, depth + 1)
