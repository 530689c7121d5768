"""The DeepSpeed engine: the Llama model (activation checkpointing, compiled blocks) wrapped by
`deepspeed.initialize` with the config dict from dsconfig and AdamW's weight-decay groups, behind
llmtrain's engine interface (`base.Engine`), with the one step-time quirk of DeepSpeed's stage-0 fp32
path (a bare torch optimizer) handled inside."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmtrain import checkpoint
from llmtrain.config import TrainConfig
from llmtrain.engine import pretrained
from llmtrain.engine.base import Batch, Engine, JudgeNorm, never_skip
from llmtrain.envvar import set_for_block
from llmtrain.parallel import tensor as tensor_parallel
from llmtrain.parallel.mesh import Mesh, process_groups
from llmtrain.planning.layout import Layout
from llmtrain.planning.partition import kv_replicas
from llmtrain.quiet import held_stdout


def build_engine(
    cfg: TrainConfig, ds_config: dict[str, Any], device: torch.device, world_size: int = 1
) -> DeepSpeedEngine:
    """The model built on `device`, wrapped by deepspeed.initialize with the optimizer's param groups
    and the process groups of the run's layout over `world_size` ranks.

    Every rank builds the whole model from the same seed, then keeps its tensor-parallel slices
    (parallel.tensor), so a tensor-parallel run starts from exactly the weights of a one-process run.
    With `train.init_from` the weights are the source's (engine.pretrained; under ZeRO 3 partitioned as
    they are built).
    """
    import deepspeed

    _import_deepspeed_muon_uncompiled()
    mpu = process_groups(cfg.layout(world_size))
    model = pretrained.model_for(cfg, device, ds_config)
    if mpu is not None and cfg.parallel.tp > 1:
        tensor_parallel.shard_over(model, mpu, cfg.model.num_key_value_heads)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing, cfg.train.checkpoint_every_k)
    use_deepspeed_checkpointing(model, ds_config, mpu, device)
    if mpu is not None and cfg.parallel.sp > 1:
        model.set_sequence_parallel(mpu.get_sequence_parallel_group())
        if cfg.zero.stage == 3:
            _partition_over_zero_group(model, mpu, ds_config)
    if cfg.compiles and cfg.zero.stage == 3:
        model.compile_elementwise()  # whole compiled blocks break into pieces at ZeRO 3's hooks
    elif cfg.compiles:
        model.compile_blocks()
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    with held_stdout():  # the bf16 optimizer prints memory reports
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config, mpu=mpu)
    plain = cfg.zero.stage == 0 and cfg.train.precision == "fp32"
    copies = kv_replicas(cfg.model.num_key_value_heads, cfg.parallel.tp)
    return DeepSpeedEngine(engine, device, cfg.layout(world_size), plain_optimizer=plain, kv_replicas=copies)


def use_deepspeed_checkpointing(
    model: torch.nn.Module, ds_config: dict[str, Any], mpu: Mesh | None, device: torch.device
) -> None:
    """Checkpointed blocks through DeepSpeed's activation checkpointing when the config's
    `activation_checkpointing` block asks for what torch's cannot do: each block's saved inputs
    partitioned over the mesh's tensor group, or kept in host memory. Configured from that block
    (dsconfig.activation_checkpointing); DeepSpeed keeps it in module globals, one layout per process.

    Host memory alone on a CPU device: the inputs are in host memory already, and DeepSpeed's blocking
    "copy to host" there returns the input itself, which it then empties in place (it would recompute
    from nothing), so torch's checkpoint keeps them, as it does anyway on that device."""
    settings = ds_config.get("activation_checkpointing")
    if settings is None or (device.type == "cpu" and not settings["partition_activations"]):
        return
    import deepspeed

    deepspeed.checkpointing.configure(mpu, deepspeed_config=ds_config)
    for module in model.modules():
        if hasattr(module, "recompute"):  # model.Llama, a pipeline's blocks
            module.recompute = _deepspeed_recompute  # type: ignore[assignment]  # typed there


def _deepspeed_recompute(block: Callable[..., Tensor], *inputs: Any) -> Tensor:
    """A block through deepspeed.checkpointing.checkpoint with its None inputs (no document mask) held
    back: DeepSpeed 0.19.8's partitioned recompute hands each None input back twice."""
    import deepspeed

    present = [i for i, value in enumerate(inputs) if value is not None]

    def run(*tensors: Tensor) -> Tensor:
        args = list(inputs)
        for i, tensor in zip(present, tensors, strict=True):
            args[i] = tensor
        return block(*args)

    out: Tensor = deepspeed.checkpointing.checkpoint(run, *(inputs[i] for i in present))
    return out


def _partition_over_zero_group(model: torch.nn.Module, mesh: Mesh, ds_config: dict[str, Any]) -> None:
    """ZeRO 3 under sequence parallelism: DeepSpeed 0.19.8 partitions the parameters of a model it
    converts itself over its mpu's data group (dp alone), while its optimizer reduces gradients over the
    sequence-data group (dp x sp), per parameter over the group the parameter was partitioned over:
    measured, the sp ranks' partial gradients then never meet (grad norm 2.94 against the one-process
    1.89 at sp 2). Converted here over the mesh's zero group; DeepSpeed keeps converted parameters."""
    import deepspeed

    deepspeed.zero.Init(
        module=model,
        data_parallel_group=mesh.get_sequence_data_parallel_group(),
        config_dict_or_path=ds_config,
        mpu=mesh,
    )


def _import_deepspeed_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with torch.compile switched off for the import alone.

    DeepSpeed's ZeRO optimizers import it on every run (to recognise a Muon optimizer, which llmtrain
    never builds), and the module decorates a function with torch.compile at import, which imports
    TorchInductor: measured 1.2 s of a 7.7 s two-step run on a 2-core CPU, in every process. Imported
    here first with TORCHDYNAMO_DISABLE=1 its decorator is a no-op; DeepSpeed's later imports find the
    module loaded. Called before the model's own blocks are compiled, and the variable is restored."""
    with set_for_block("TORCHDYNAMO_DISABLE", "1"), contextlib.suppress(ImportError):
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (a DeepSpeed without Muon: no-op)


class DeepSpeedEngine(Engine):
    """`ds` is DeepSpeed's engine. Gradient accumulation is DeepSpeed's own: `step()` after every
    backward, a no-op until the accumulation boundary. A skipped update is a NaN gradient: DeepSpeed's
    overflow check then drops it on every rank."""

    def __init__(
        self,
        ds: Any,
        device: torch.device,
        layout: Layout,
        plain_optimizer: bool = False,
        kv_replicas: int = 1,
    ) -> None:
        self.ds, self.device, self.wrapper, self.layout = ds, device, ds, layout
        self.optimizer = ds.optimizer
        # Stage 0 in fp32: DeepSpeed steps a bare torch optimizer, with no overflow check of its own.
        self.plain_optimizer = plain_optimizer
        # tp ranks holding each key/value head (planning.partition): consolidation keeps one copy.
        self.kv_replicas = kv_replicas

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def forward(self, batch: Batch) -> Tensor:
        return self.ds(**self.to_device(batch))

    def backward(self, loss: Tensor, *, last: bool, skip: bool) -> None:
        self.ds.backward(loss * float("nan") if skip else loss)
        if not last:
            self.ds.step()  # DeepSpeed counts micro-steps here; no update before the boundary

    def update(self, *, skip: bool, judge_norm: JudgeNorm = never_skip) -> float | None:
        if not self.plain_optimizer:
            self.ds.step()
            return self._engine_grad_norm()
        norm = self._plain_grad_norm()
        with update_suppressed(self.optimizer, not math.isfinite(norm)):
            self.ds.step()
        return norm

    def _plain_grad_norm(self) -> float:
        """Stage 0 fp32: gradients are whole (all-reduced) on every rank, so every rank sees the same norm."""
        grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
        return float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        )

    def _engine_grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def save(self, staging_root: Path, tag: str) -> tuple[list[str], list[Path]]:
        return checkpoint.write_deepspeed_files(self.ds, staging_root, tag)

    def load(self, ckpt_root: Path, tag: str) -> None:
        as_built = _group_hyperparameters(self.optimizer)
        checkpoint.load_deepspeed_files(self.ds, ckpt_root, tag)
        _repair_universal_load(self.optimizer, as_built)

    def checkpoint_facts(self) -> dict[str, Any]:
        axes = {"tp": self.layout.tp, "sp": self.layout.sp, "pp": self.layout.pp}
        return {
            "engine": "deepspeed",
            "zero_stage": int(self.ds.zero_optimization_stage()),
            "layout": axes,
            "kv_replicas": self.kv_replicas,
        }


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer DeepSpeed steps (its ZeRO and bf16 wrappers hold it as `.optimizer`)."""
    return getattr(optimizer, "optimizer", optimizer)


def _group_hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters and its LR (the schedule sets that every step)."""
    groups = _torch_optimizer(optimizer).param_groups
    return [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in groups]


def _repair_universal_load(optimizer: Any, as_built: list[dict[str, Any]]) -> None:
    """Undo two faults of DeepSpeed 0.19's ZeRO-3 universal load (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3), harmless after any other load:
    - every param group gets the first group's settings, so the norms and the embedding would be decayed:
      a resumed run's optimizer settings are frozen, so the groups as built are the right ones;
    - one `step` tensor is shared by every group's state, and AdamW increments it in place once per group:
      each group gets its own copy, so the bias correction counts optimizer steps again."""
    torch_optimizer = _torch_optimizer(optimizer)
    for group, settings in zip(torch_optimizer.param_groups, as_built, strict=True):
        group.update(settings)
    for state in torch_optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def param_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only (model.py's names): not on norms, not on the (possibly tied)
    embedding. A parameter ZeRO 3 partitioned as it was built is an empty tensor; its `ds_shape` is
    the whole one's."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for name, param in named_parameters:
        if id(param) in seen:
            continue
        seen.add(id(param))
        shape = getattr(param, "ds_shape", param.shape)
        is_matrix = len(shape) >= 2 and not name.startswith("embed_tokens")
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
        if getattr(param, "ds_secondary_tensor", None) is not None:  # hpZ's partition within the node
            params.append((name, param.ds_secondary_tensor))
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
        if tensor.device.type == "meta":  # shape records (DeepSpeed keeps one per parameter): no memory
            continue
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
