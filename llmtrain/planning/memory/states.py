"""Model states per rank: parameters, gradients and optimizer states as DeepSpeed's optimizer wrapper for
the ZeRO stage or FSDP2 keeps them, by where they live; and one checkpoint's bytes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.config import ModelConfig
from llmtrain.planning.memory.setup import FP32, Setup, parameter_tensors

ADAM_MOMENTS = 8  # exp_avg + exp_avg_sq, fp32
# A checkpoint's bytes besides the states, with room to spare (measured on the debug preset): per
# parameter tensor, the framing of what is saved for it (DCP's ~9.5 KiB for its weights, two moments,
# Adam's step and their metadata; torch.save's less), and per rank llmtrain's JSON state (~22 KiB).
CHECKPOINT_BYTES_PER_TENSOR = 12 << 10
CHECKPOINT_BYTES_PER_RANK = 64 << 10

_OFFLOAD_WHERE = {"none": "", "cpu": ", on the CPU", "nvme": ", on NVMe"}


def _partitioned_optim(setup: Setup) -> str:
    return f"fp32 master 4 + moments 8 B/param / ZeRO group of {setup.zero_group}"


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds for parameters, gradients and optimizer states, by where they live."""

    params_gpu: int = 0
    grads_gpu: int = 0
    optim_gpu: int = 0
    params_cpu: int = 0
    grads_cpu: int = 0
    optim_cpu: int = 0
    params_nvme: int = 0
    optim_nvme: int = 0
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return (
            self.params_gpu
            + self.grads_gpu
            + self.optim_gpu
            + self.params_cpu
            + self.grads_cpu
            + self.optim_cpu
            + self.params_nvme
            + self.optim_nvme
        )

    @property
    def gpu(self) -> int:
        return self.params_gpu + self.grads_gpu + self.optim_gpu


def persistent_elements(setup: Setup) -> int:
    """ZeRO-3 keeps parameters with at most stage3_param_persistence_threshold elements whole on every rank."""
    if setup.stage != 3 or not setup.shape_known:
        return 0
    threshold = setup.zero["stage3_param_persistence_threshold"]
    return sum(n for n in parameter_tensors(setup.cfg.model, setup.layout.tp) if n <= threshold)


def model_states(setup: Setup) -> ModelStates:
    """Per-rank model-state bytes for this stage, offload, precision and layout, as DeepSpeed 0.19.8
    allocates them (stage 0 never runs with tp or sp: rules.RULES), or FSDP2 under --engine fsdp2."""
    if setup.engine == "fsdp2":
        return fsdp2_states(setup)
    p, n, b, a = setup.rank_params, setup.zero_group, setup.lp_bytes, setup.grad_accum_bytes
    part = p / n
    optim = FP32 + ADAM_MOMENTS  # fp32 master partition + moments (ZeRO clones a master even in fp32)
    if setup.stage == 0:
        if setup.precision == "fp32":  # torch AdamW steps the model's own fp32 weights: no master copy
            return ModelStates(
                params_gpu=4 * p,
                grads_gpu=4 * p,
                optim_gpu=ADAM_MOMENTS * p,
                notes={"optim": "Adam moments 8 B/param, not partitioned; no master copy in fp32"},
            )
        return ModelStates(
            params_gpu=b * p,
            grads_gpu=b * p,
            optim_gpu=optim * p,
            notes={"optim": "fp32 master 4 + moments 8 B/param, not partitioned (FP16 optimizer wrapper)"},
        )
    if setup.stage in (1, 2):
        return _stage12_states(setup, p, part, b, a, optim)
    return _stage3_states(setup, p, part, b, a, optim)


def _stage12_states(setup: Setup, p: int, part: float, b: int, a: int, optim: int) -> ModelStates:
    # No parameter's .grad outlives the backward: each bucket's reduction moves the rank's share into
    # the partition store and frees the rest (measured on the real engine: every .grad is None at the
    # step, under fp32 and bf16, also for the parameter that straddles a partition boundary).
    if setup.offload == "cpu":
        # Gradients reduce into an fp32 pinned CPU partition (the master's .grad); under bf16 DeepSpeed
        # also keeps the fp32 accumulation partition on the GPU.
        return ModelStates(
            params_gpu=b * p,
            grads_gpu=round(FP32 * part) if setup.precision == "bf16" else 0,
            grads_cpu=round(FP32 * part),
            optim_cpu=round(optim * part),
            notes={
                "grads": "fp32 partition on the CPU (master .grad)"
                + (" and an fp32 accumulation partition on the GPU" if setup.precision == "bf16" else ""),
                "optim": _partitioned_optim(setup) + _OFFLOAD_WHERE["cpu"],
            },
        )
    if setup.stage == 1 and setup.precision == "bf16":
        # BF16_Optimizer: bf16 grads plus a full (unpartitioned) fp32 gradient accumulation buffer.
        return ModelStates(
            params_gpu=b * p,
            grads_gpu=(b + FP32) * p,
            optim_gpu=round(optim * part),
            notes={
                "grads": "bf16 grads + full fp32 accumulation buffer (BF16_Optimizer does not partition them)",
                "optim": _partitioned_optim(setup),
            },
        )
    # overlap_comm as DeepSpeed gets it: a pipeline reduces after its last backward, without it.
    partitioned = setup.stage == 2 or bool(setup.zero.get("overlap_comm"))
    return ModelStates(
        params_gpu=b * p,
        grads_gpu=round(a * part) if partitioned else a * p,
        optim_gpu=round(optim * part),
        notes={
            "grads": "partition kept after each bucket's reduction"
            if partitioned
            else "full gradients until the step's reduction (stage 1 without overlap_comm)",
            "optim": _partitioned_optim(setup),
        },
    )


def secondary_partition_elements(setup: Setup) -> int:
    """ZeRO++ hpZ's second copy of the weights, partitioned within a node: DeepSpeed partitions each
    parameter ZeRO 3 does not keep whole, padded to a multiple of the ZeRO group, over the node's ranks
    (partition_parameters._partition_param_sec). It exists from a block's first forward until the step
    (stage3.invalidate_secondary_tensor), so through backward: at the model states' peak."""
    ranks_per_node = setup.hpz_ranks
    if ranks_per_node <= 1:
        return 0
    n = setup.zero_group
    if not setup.shape_known:
        return -(-setup.rank_params // ranks_per_node)
    threshold = setup.zero["stage3_param_persistence_threshold"]
    tensors = parameter_tensors(setup.cfg.model, setup.layout.tp)
    return sum(-(-t // n) * n for t in tensors if t > threshold) // ranks_per_node


def _stage3_states(setup: Setup, p: int, part: float, b: int, a: int, optim: int) -> ModelStates:
    persistent = b * persistent_elements(setup)
    params, grads, states = round(b * part), round(a * part), round(optim * part)
    secondary = b * secondary_partition_elements(setup)
    params += secondary  # where the partition lives (DeepSpeed allocates both on its remote device)
    notes = {
        "params": "partition / ZeRO group"
        + (f" + hpZ's second partition / {setup.hpz_ranks} ranks per node" if secondary else "")
        + " + small persistent params whole",
        "grads": f"{'fp32' if a == FP32 else setup.precision} partition"
        + ("" if setup.offload == "none" else ", on the CPU"),  # NVMe offload keeps them there too
        "optim": _partitioned_optim(setup) + _OFFLOAD_WHERE[setup.offload],
    }
    if setup.offload == "none":
        return ModelStates(params_gpu=params + persistent, grads_gpu=grads, optim_gpu=states, notes=notes)
    cpu = setup.offload == "cpu"  # else NVMe holds parameters and optimizer states; gradients stay on the CPU
    return ModelStates(
        params_gpu=persistent,
        params_cpu=params if cpu else 0,
        params_nvme=0 if cpu else params,
        grads_cpu=grads,
        optim_cpu=states if cpu else 0,
        optim_nvme=0 if cpu else states,
        notes=notes,
    )


# ---------------------------------------------------------------- one checkpoint (all ranks)


def checkpoint_bytes(setup: Setup) -> int:
    """Bytes of one checkpoint, all ranks together, before a run has saved one: the optimizer's fp32
    master weights and Adam's moments (ZeRO's partitions add up to one copy of each) plus DeepSpeed's
    model file, the weights in the model dtype (FSDP2's model state is the fp32 masters themselves),
    plus what every rank adds: file framing for each tensor (FSDP2's ranks each frame a shard of every
    one) and its JSON state. On the high side where less is saved: stage 0 in fp32 keeps no master
    copy, ZeRO-3's model file holds no weights; tensors every tp rank holds whole are counted once."""
    model_file = 0 if setup.engine == "fsdp2" else setup.lp_bytes
    states = setup.params * (model_file + FP32 + ADAM_MOMENTS)
    framing = len(parameter_tensors(setup.cfg.model)) * CHECKPOINT_BYTES_PER_TENSOR
    return states + setup.world_size * (framing + CHECKPOINT_BYTES_PER_RANK)


# ---------------------------------------------------------------- FSDP2 (per rank)
#
# Each term names the mechanism of torch 2.13's torch/distributed/fsdp/_fully_shard/ it stands for.
# Every parameter is sharded on dim 0 and padded to a multiple of N rows (FSDPParam._init_sharded_param):
# at most one row per tensor, left out.


@dataclass(frozen=True)
class ShardUnits:
    """Elements of the units llmtrain.engine.fsdp2 calls fully_shard on: each of `blocks` transformer
    blocks, and the root (the embedding, final norm and output layer: what no block holds)."""

    root: int
    block: int
    blocks: int

    @property
    def largest(self) -> int:
        return max(self.root, self.block)


def shard_units(model: ModelConfig, tp: int = 1) -> ShardUnits:
    """The units one rank gathers: its tensor-parallel slices of them under tp."""
    root = sum(parameter_tensors(replace(model, num_hidden_layers=0), tp))
    blocks = model.num_hidden_layers
    return ShardUnits(root, (sum(parameter_tensors(model, tp)) - root) // blocks, blocks)


def fsdp2_states(setup: Setup) -> ModelStates:
    """FSDP2's model states: every rank keeps a 1/N shard (N: its shard group) of each parameter in
    fp32, which are the masters (MixedPrecisionPolicy only casts the all-gather input to bf16:
    FSDPParam.all_gather_inputs), its gradient in fp32 (foreach_reduce leaves each shard's .grad a view
    of its unit's reduce-scatter output, reduced in the fp32 reduce dtype), and AdamW's exp_avg and
    exp_avg_sq shaped like the shard.
    CPUOffloadPolicy keeps all three in host memory: the shards are created there, each gradient shard is
    copied out of the reduce-scatter output to the CPU, and AdamW steps there."""
    ranks = setup.fsdp_shard_ranks
    shard = setup.rank_params / ranks
    params, grads, moments = round(FP32 * shard), round(FP32 * shard), round(ADAM_MOMENTS * shard)
    where = _OFFLOAD_WHERE[setup.offload]
    replicas = setup.layout.dp // ranks
    # HSDP: the same shards on each of the replicas (all-reduced in place after the reduce-scatter).
    group = f"{ranks} ranks" + (f", replicated {replicas}x (HSDP)" if replicas > 1 else "")
    notes = {
        "params": f"fp32 shards / {group}, the masters{where}",
        "grads": f"fp32 shards, views of each unit's reduce-scatter output{where}",
        "optim": f"AdamW moments 8 B/param / {ranks} ranks, no master copy{where}",
    }
    if setup.offload == "cpu":
        return ModelStates(params_cpu=params, grads_cpu=grads, optim_cpu=moments, notes=notes)
    return ModelStates(params_gpu=params, grads_gpu=grads, optim_gpu=moments, notes=notes)


def gathered_elements(setup: Setup) -> int:
    """Parameters FSDP2 holds unsharded at once, in the model dtype (MixedPrecisionPolicy's param_dtype).

    The root is gathered for its forward, which spans the whole model and the loss, and again from the
    first backward op to the last (the embedding's gradient). A block's all-gather output outlives its
    copy into the parameters: in forward until the next unit's copy-out, or the root's post-forward for
    the last block (comm_ctx.all_gather_state); in backward the next block's is prefetched
    (_backward_prefetch). --zero 3 (reshard_after_forward) frees each block's parameters after its
    forward and after its backward: the root, the running block and one all-gather output. --zero 2
    keeps every unit's from its forward to its backward, and the last block's all-gather output on top.
    """
    units = shard_units(setup.cfg.model, setup.layout.tp)
    if setup.stage == 3:
        return units.root + min(2, units.blocks) * units.block
    return units.root + (units.blocks + 1) * units.block
