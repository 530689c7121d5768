"""TrainConfig -> the DeepSpeed config dict. The only place that writes DeepSpeed keys.

Batch triple, clipping, precision, optimizer and ZeRO settings are all derived here from one
TrainConfig and the world size, so no key is ever set in two places (gpt-neox's mixed YAML is the
cautionary tale). Bucket sizes scale with the model like Hugging Face's "auto" values: DeepSpeed's
defaults allocate a 1 GB reduce bucket under ZeRO-3 even for a 7M-parameter model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmtrain import precision
from llmtrain.config import ModelConfig, TrainConfig
from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for
from llmtrain.planning import rules

# Buckets below this many elements only add per-collective latency: a whole small model fits in one.
MIN_BUCKET_ELEMENTS = 1 << 20
# DeepSpeed reads the LR from the param groups; llmtrain sets it every step from schedule.lr_at.
_NEVER_PRINT = 1 << 30


def bucket_sizes(model: ModelConfig) -> dict[str, int]:
    """Communication bucket sizes (elements) derived from the hidden size, as HF's "auto" does."""
    h2 = model.hidden_size * model.hidden_size
    return {
        "reduce_bucket_size": max(h2, MIN_BUCKET_ELEMENTS),
        "allgather_bucket_size": max(h2, MIN_BUCKET_ELEMENTS),
        "stage3_prefetch_bucket_size": max(int(0.9 * h2), MIN_BUCKET_ELEMENTS),
        "stage3_param_persistence_threshold": 10 * model.hidden_size,
        "stage3_max_live_parameters": max(1_000_000_000, h2),
        "stage3_max_reuse_distance": max(1_000_000_000, h2),
    }


def build(
    cfg: TrainConfig,
    world_size: int,
    accelerator: str = "cpu",
    load_universal: bool = False,
    ranks_per_node: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for `deepspeed.initialize(config=...)`.

    `load_universal`: the run resumes from a checkpoint converted to DeepSpeed's universal format
    (saved at another world size). `ranks_per_node`: the processes of each node (default --gpus), as a
    running job finds them: --shard-within-node partitions within them.
    """
    per_node = ranks_per_node or cfg.launch.gpus
    nodes = world_size // per_node if world_size % per_node == 0 else None
    rules.check(replace(cfg.choice(accelerator), nodes=nodes))
    layout = cfg.layout(world_size)
    # DeepSpeed counts the batch over its data-parallel ranks (the mpu's), as batch_triple does.
    train_batch, micro, accum = rules.batch_triple(cfg.train.micro_batch, cfg.train.global_batch, layout.dp)
    ds: dict[str, Any] = {
        "train_batch_size": train_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "optimizer": _optimizer(cfg, accelerator),
        "zero_optimization": {**_zero(cfg), **_zero_plus(cfg, world_size, per_node)},
        "steps_per_print": _NEVER_PRINT,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    ds.update(_precision(cfg, accelerator))
    if cfg.train.partition_activations or cfg.train.cpu_checkpointing:
        ds["activation_checkpointing"] = activation_checkpointing(cfg)
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return ds


def activation_checkpointing(cfg: TrainConfig) -> dict[str, Any]:
    """DeepSpeed's activation checkpointing: where a checkpointed block keeps its inputs until the
    recompute. The model's checkpointed blocks run through deepspeed.checkpointing, configured from
    this block (engine.ds_engine)."""
    return {
        "partition_activations": cfg.train.partition_activations,  # 1/tp of each input per tp rank
        "cpu_checkpointing": cfg.train.cpu_checkpointing,  # in host memory
        "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


def _optimizer(cfg: TrainConfig, accelerator: str) -> dict[str, Any]:
    o = cfg.optim
    params: dict[str, Any] = {
        "lr": o.lr,
        "betas": [o.beta1, o.beta2],
        "eps": o.eps,
        "weight_decay": o.weight_decay,
    }
    # Offload: DeepSpeed picks its CPU Adam. On GPU: FusedAdam. On a CPU machine without offload,
    # torch's AdamW (FusedAdam would JIT-build a kernel that is no faster there).
    if cfg.zero.offload == "none" and accelerator == "cpu":
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def _precision(cfg: TrainConfig, accelerator: str) -> dict[str, Any]:
    # A run's config holds the precision decided when it was prepared; auto is left only where no run is
    # (`llmtrain config`, a library caller), and is then decided as a run on `accelerator` would.
    chosen = precision.concrete(cfg.train.precision, accelerator)
    if chosen == "bf16":
        out: dict[str, Any] = {"bf16": {"enabled": True, "check_grad_overflow": True}}
        if cfg.zero.stage > 0:
            # Accumulate gradients across micro-batches in fp32, not bf16.
            out["data_types"] = {"grad_accum_dtype": "fp32"}
        return out
    if chosen == "fp16":
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,  # dynamic
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    return {}


def largest_parameter(m: ModelConfig) -> int:
    """Elements of the model's largest weight: the embedding (or output layer), an MLP or a q/o matrix."""
    return max(m.vocab_size, m.intermediate_size, m.num_attention_heads * m.head_width) * m.hidden_size


def _zero(cfg: TrainConfig) -> dict[str, Any]:
    z = cfg.zero
    if z.stage == 0:
        return {"stage": 0}
    sizes = bucket_sizes(cfg.model)
    out: dict[str, Any] = {
        "stage": z.stage,
        # The pipeline engine reduces gradients itself at the end of its schedule (and turns overlap
        # off with a warning): the JSON says what runs.
        "overlap_comm": z.overlap_comm and cfg.parallel.pp == 1,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": z.reduce_bucket_size or sizes["reduce_bucket_size"],
    }
    if z.stage == 3 and cfg.parallel.sp > 1:
        # DeepSpeed 0.19.8's ZeRO-3 reduce-scatter averages gradients over all dp x sp ranks, yet the sp
        # ranks' gradients are partial sums that must add up (measured: grad norms halved at sp 2). Its
        # all-reduce path divides by dp only, as stages 1-2 do; it takes every bucket no larger than
        # reduce_bucket_size, so the buckets are made to hold the largest parameter.
        out["reduce_scatter"] = False
        out["reduce_bucket_size"] = max(out["reduce_bucket_size"], largest_parameter(cfg.model))
    if z.stage in (1, 2):
        out["allgather_bucket_size"] = z.allgather_bucket_size or sizes["allgather_bucket_size"]
    if z.stage == 3:
        out.update(
            stage3_prefetch_bucket_size=z.prefetch_bucket_size or sizes["stage3_prefetch_bucket_size"],
            stage3_param_persistence_threshold=(
                z.param_persistence_threshold
                if z.param_persistence_threshold is not None
                else sizes["stage3_param_persistence_threshold"]
            ),
            stage3_max_live_parameters=z.max_live_parameters or sizes["stage3_max_live_parameters"],
            stage3_max_reuse_distance=sizes["stage3_max_reuse_distance"],
            stage3_gather_16bit_weights_on_model_save=False,
        )
    if z.offload != "none":
        out["offload_optimizer"] = _offload_target(cfg)
        if z.stage == 3:
            out["offload_param"] = _offload_target(cfg)
    return out


def _zero_plus(cfg: TrainConfig, world_size: int, ranks_per_node: int) -> dict[str, Any]:
    """ZeRO++'s keys (rules.RULES has checked they apply: ZeRO 3, several nodes, qwZ/qgZ on CUDA).
    hpZ's secondary partition spans a node: DeepSpeed groups consecutive ranks, which the launchers
    number node by node."""
    z = cfg.zero
    out: dict[str, Any] = {}
    if z.shard_within_node:
        if ranks_per_node < 2 or world_size % ranks_per_node:
            raise ConfigError(
                f"{flag_for('zero.shard_within_node')}: {world_size} ranks in nodes of {ranks_per_node}: "
                "hpZ partitions within nodes of 2 or more ranks each; launch 2 or more per node"
            )
        out["zero_hpz_partition_size"] = ranks_per_node
    if z.quantize_weights:
        out["zero_quantized_weights"] = True
    if z.quantize_grads:
        out["zero_quantized_gradients"] = True
    return out


def _offload_target(cfg: TrainConfig) -> dict[str, Any]:
    if cfg.zero.offload == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": cfg.zero.nvme_path, "pin_memory": True, "buffer_count": 5}


# The reference set in ds_configs/: what `llmtrain config --precision bf16` prints for a 7B model on one
# GPU with 8 accumulation steps (bf16 named: auto would depend on the machine that regenerates them). A
# test keeps the files in sync with this code and feeds each to DeepSpeed.
REFERENCE_FLAGS: dict[str, dict[str, Any]] = {
    "zero1": {"zero.stage": 1},
    "zero2": {"zero.stage": 2},
    "zero3": {"zero.stage": 3},
    "zero2_offload_cpu": {"zero.stage": 2, "zero.offload": "cpu"},
    "zero3_offload_cpu": {"zero.stage": 3, "zero.offload": "cpu"},
    "zero3_offload_nvme": {"zero.stage": 3, "zero.offload": "nvme", "zero.nvme_path": "/local_nvme"},
}
REFERENCE_COMMON: dict[str, Any] = {
    "preset": "7b",
    "train.micro_batch": 4,
    "train.global_batch": 32,
    "train.precision": "bf16",
}


def reference_configs() -> dict[str, dict[str, Any]]:
    from llmtrain.config import resolve

    return {
        name: build(resolve(flags={**REFERENCE_COMMON, **flags}), world_size=1, accelerator="cuda")
        for name, flags in REFERENCE_FLAGS.items()
    }
