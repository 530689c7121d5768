"""`train --init-from`: the source's weights put where each engine keeps its parameters.

The tensors are read one at a time, by our parameter names (model.py's: Hugging Face's without the
leading `model.`), from the safetensors files of a Hugging Face directory (memory-mapped: a rank reads
only what it copies) or from a run's checkpoint (consolidated to fp32 on first use). Where they go:

- ZeRO 0-2, tensor and sequence parallelism, FSDP2: every rank holds (or slices, or shards after) the
  whole model, so it is allocated without a random draw and filled tensor by tensor (`build_loaded`).
- ZeRO 3 (data parallelism): the model is built inside deepspeed.zero.Init, which partitions every
  parameter as its module is constructed; each parameter is then gathered alone, filled on rank 0 and
  re-partitioned (`build_partitioned`). No rank ever holds more than one whole parameter, and only
  rank 0 reads the source.
- Pipeline stages: each stage fills its own parameters (`fill`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmtrain import init_source
from llmtrain.config import ConfigError, ModelConfig, TrainConfig
from llmtrain.model import Llama, build_model


class SourceWeights:
    """Our parameter name -> the source's tensor, read when asked for."""

    def __init__(self, read: Callable[[str], Tensor], where: str) -> None:
        self._read, self.where = read, where

    def get(self, name: str) -> Tensor:
        return self._read(name)


def open_weights(spec: str) -> SourceWeights:
    """The weights of `train.init_from` (checked against the model's shapes before the run started)."""
    source = init_source.parse(spec)
    if source.kind == "hf":
        return _hf_weights(source.path)
    return _run_weights(source)


def _hf_weights(directory: Path) -> SourceWeights:
    from safetensors import safe_open

    files = init_source.hf_weight_files(directory)  # our name -> (file, the name in it)
    handles: dict[Path, Any] = {}

    def read(name: str) -> Tensor:
        file, stored = files[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        tensor: Tensor = handles[file].get_tensor(stored)
        return tensor

    return SourceWeights(read, str(directory))


def _run_weights(source: init_source.InitSource) -> SourceWeights:
    from llmtrain import inference

    @functools.cache
    def consolidated() -> dict[str, Tensor]:
        return inference.load_weights(inference.open_run(source.path, source.checkpoint))

    return SourceWeights(lambda name: consolidated()[name], source.describe())


# ---------------------------------------------------------------- into the model


@torch.no_grad()
def fill(params: Iterable[tuple[str, Tensor]], weights: SourceWeights) -> None:
    """Copy the source's tensor into each (name, parameter), converting its dtype."""
    for name, param in params:
        value = weights.get(name)
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(
                f"{init_source.FLAG} {weights.where}: {name} has shape {tuple(value.shape)}, "
                f"the model needs {tuple(param.shape)}"
            )
        param.copy_(value)


def build_loaded(cfg: ModelConfig, weights: SourceWeights, device: torch.device | str) -> Llama:
    """The whole model on `device`, holding the source's weights (no random initialisation drawn)."""
    model = build_model(cfg, device="meta")
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    fill(model.named_parameters(), weights)
    return model


def build_partitioned(cfg: ModelConfig, weights: SourceWeights, ds_config: dict[str, Any]) -> Llama:
    """ZeRO 3: the model partitioned as it is built; each parameter gathered alone, filled on rank 0
    (the only reader of the source) and broadcast back into the partitions."""
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Llama(cfg)
    for name, param in model.named_parameters():  # a tied weight once
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                fill([(name, param)], weights)
    return model


def model_for(cfg: TrainConfig, device: torch.device, ds_config: dict[str, Any] | None = None) -> Llama:
    """The model an engine wraps: random from the seed, or `train.init_from`'s weights (partitioned as
    built when `ds_config` is ZeRO 3's and no tensor or sequence parallelism needs the whole model)."""
    if cfg.train.init_from is None:
        return build_model(cfg.model, device=device, seed=cfg.train.seed)
    weights = open_weights(cfg.train.init_from)
    if ds_config is not None and zero3_partitioned_build(cfg):
        return build_partitioned(cfg.model, weights, ds_config)
    return build_loaded(cfg.model, weights, device)


def zero3_partitioned_build(cfg: TrainConfig) -> bool:
    """ZeRO 3 over plain data parallelism: tensor parallelism slices a whole model, and Ulysses' groups
    are not zero.Init's default one."""
    return cfg.zero.stage == 3 and cfg.parallel.tp == 1 and cfg.parallel.sp == 1


def stage_fill(stage_params: dict[str, list[nn.Parameter]], weights: SourceWeights) -> None:
    """A pipeline stage's parameters (each name's copies: a tied embedding on a one-stage pipe)."""
    fill(((name, copy) for name, copies in stage_params.items() for copy in copies), weights)
