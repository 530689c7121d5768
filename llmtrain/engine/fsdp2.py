"""The FSDP2 engine: the same Llama, `fully_shard` per block and then on the root, with torch's AdamW.

How the flags map:
- `--dp-shard N` (by default a node's ranks when the run spans nodes): HSDP, a 2-D mesh of
  replicate x shard; each parameter is sharded over N data-parallel ranks, the gradient shards are
  all-reduced across the replicas. Over all of them (one node, or N = dp) it is plain FSDP.
- `--tp N`: a third, innermost mesh dimension; parallel.dtensor_tp splits the weights over it before
  fully_shard shards them over the data-parallel dimensions.
- `--zero 3`: parameters resharded after each block's forward (gathered again for backward);
  `--zero 2`: kept gathered from forward to backward (more memory, one all-gather fewer per block).
  FSDP2 always shards gradients and optimizer states with the parameters: ZeRO 0 and 1, and NVMe
  offload, are refused (planning.rules), as are fp16, sp and pp.
- `--precision bf16`: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): compute in bf16,
  gradients reduced and accumulated in fp32, the sharded fp32 parameters are the masters. fp32: none.
- `--offload cpu`: CPUOffloadPolicy (sharded parameters, gradients and the optimizer step on the CPU).
- Gradient accumulation: gradient sync off for all but the last micro-batch, so there is one
  reduce-scatter per step; the loss is divided by the micro-batches per step, as DeepSpeed does.
- Activation checkpointing and `--compile` per block, as on DeepSpeed (model.py's own switches).
Checkpoints are torch.distributed.checkpoint (checkpoint/dcp.py): a different process count, shard
group or tp degree on resume is resharded by DCP itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmtrain.checkpoint import dcp
from llmtrain.checkpoint.reading import checkpoint_dir
from llmtrain.config import TrainConfig
from llmtrain.engine import pretrained
from llmtrain.engine.base import Batch, Engine, JudgeNorm, never_skip
from llmtrain.engine.ds_engine import HeldStates, param_groups
from llmtrain.model import Llama
from llmtrain.parallel import dtensor_tp


def build_engine(
    cfg: TrainConfig, plan: dict[str, Any], device: torch.device, accelerator: str
) -> FSDP2Engine:
    """Every rank builds the whole model from the same seed, then fully_shard keeps its shards (so a
    run starts from exactly the weights of a one-process run), and AdamW gets the same weight-decay
    groups as on DeepSpeed; every setting comes from `plan` (fsdp2_plan.build)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    model = pretrained.model_for(cfg, device)
    model.set_activation_checkpointing(plan["activation_checkpointing"], cfg.train.checkpoint_every_k)
    if plan["compile_blocks"]:
        model.compile_blocks()
    units = plan["fully_shard"]
    dtypes = {key: getattr(torch, name) for key, name in units["mp_policy"].items() if name is not None}
    offload = (
        CPUOffloadPolicy(pin_memory=accelerator == "cuda")
        if units["offload_policy"] == "cpu"
        else OffloadPolicy()
    )
    # The mesh's dimensions above 1 (the shard dimension always), outermost first as Layout orders
    # ranks: replicate, shard, tp.
    dims = {name: size for name, size in plan["mesh"].items() if size > 1 or name == "shard"}
    mesh = init_device_mesh(accelerator, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if "tp" in dims:
        dtensor_tp.parallelize(model, mesh["tp"])
    shard: dict[str, Any] = {
        "mesh": mesh[tuple(name for name in dims if name != "tp")],
        "reshard_after_forward": units["reshard_after_forward"],
        "mp_policy": MixedPrecisionPolicy(**dtypes),
        "offload_policy": offload,
    }
    for block in model.layers:
        fully_shard(block, **shard)
    fully_shard(model, **shard)  # the root unit: the embedding, final norm and output layer
    o = plan["optimizer"]
    optimizer = torch.optim.AdamW(
        param_groups(model.named_parameters(), o["weight_decay"]),
        lr=o["lr"],
        betas=tuple(o["betas"]),
        eps=o["eps"],
        foreach=o["foreach"],  # False: the per-parameter loop of DeepSpeed's torch AdamW, the same arithmetic
    )
    accumulation, clip = plan["gradient_accumulation_steps"], plan["gradient_clipping"]
    return FSDP2Engine(model, optimizer, device, accumulation, clip, cfg.zero.stage)


class FSDP2Engine(Engine):
    def __init__(
        self,
        model: Llama,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        accumulation: int,
        grad_clip: float,
        zero_stage: int,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.wrapper = model
        self.accumulation, self.grad_clip, self.zero_stage = accumulation, grad_clip, zero_stage

    def forward(self, batch: Batch) -> Tensor:
        return self.model(**self.to_device(batch))

    def backward(self, loss: Tensor, *, last: bool, skip: bool) -> None:
        # One reduce-scatter per step: earlier micro-batches accumulate unsharded gradients locally.
        # A skipped step still reduces (every rank runs the same collectives); update() drops it.
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        (loss / self.accumulation).backward()

    def update(self, *, skip: bool, judge_norm: JudgeNorm = never_skip) -> float | None:
        """The norm is known here before the optimizer steps, so a grad-norm spike can still skip."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
        total = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # A non-finite norm drops the update, as DeepSpeed's overflow check does.
        if not skip and math.isfinite(total) and not judge_norm(total):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _state(self) -> dict[str, Any]:
        """The model's and optimizer's sharded state dicts (DTensors), by parameter names."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, staging_root: Path, tag: str) -> tuple[list[str], list[Path]]:
        return dcp.write(self._state(), staging_root / tag)

    def load(self, ckpt_root: Path, tag: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()  # the layout to load into: this run's shards
        dcp.read(state, checkpoint_dir(ckpt_root, tag))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def checkpoint_facts(self) -> dict[str, Any]:
        return {"engine": "fsdp2", "zero_stage": self.zero_stage}


def held_model_states(engine: FSDP2Engine) -> HeldStates:
    """Bytes of the model states this rank holds, each storage counted once: every parameter's local
    shard (padded to a multiple of the world size's rows), the gradient shards (views of each unit's
    reduce-scatter output) and AdamW's state; what the memory estimator's FSDP2 model-state terms
    predict (tests/test_memory_fsdp2.py measures it between a backward and the update)."""
    from torch.distributed.tensor import DTensor

    def local(tensor: Tensor) -> Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    params = [local(p) for p in engine.model.parameters()]
    grads = [local(p.grad) for p in engine.model.parameters() if p.grad is not None]
    optim = [
        local(t) for state in engine.optimizer.state.values() for t in state.values() if isinstance(t, Tensor)
    ]
    counted: set[tuple[str, int]] = set()
    param_bytes = _storage_bytes(params, counted)
    return HeldStates(param_bytes, param_bytes + _storage_bytes(grads + optim, counted))


def _storage_bytes(tensors: list[Tensor], counted: set[tuple[str, int]]) -> int:
    """Bytes of the storages under `tensors` not in `counted` yet (which then holds them)."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device.type, storage.data_ptr())
        if key not in counted:
            counted.add(key)
            total += storage.nbytes()
    return total
