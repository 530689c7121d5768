"""The estimator's arithmetic: a Setup -> per-GPU and per-node bytes, term by term (an Estimate).

Every number is derived from the model shape and the DeepSpeed config dsconfig generates, following what
DeepSpeed 0.19.8 and llmtrain.model actually allocate (checked against the real engine and against
saved-tensor hooks in tests/test_memory_calibration.py):

* Model states follow the optimizer wrapper DeepSpeed picks: stage 0 bf16/fp16 keeps an unpartitioned
  fp32 master copy; stage 1 in bf16 (fp32 gradient accumulation) runs BF16_Optimizer, which partitions
  master weights and moments but keeps a full fp32 gradient buffer; stages 1-2 otherwise partition
  gradients once overlap_comm's hooks reduce them; stage 3 partitions everything. ZeRO-1/2/3 clone an fp32
  master partition even in fp32 training (only stage 0 steps the model's own fp32 weights).
* Activations are the bytes autograd saves for backward in llmtrain.model, per layer, per checkpointing
  mode; logits are computed in chunks of LOSS_CHUNK_ROWS rows, so only one chunk's fp32 logits exist, and
  the fused loss holds the output weight's gradient (fp32 sum) from the end of forward.
* Tensor parallelism (tp, parallel.partition's split) leaves each rank 1/tp of every layer's q, k, v, o,
  gate, up and down matrices (the embedding, lm_head and norms stay whole), and ZeRO partitions what a
  rank holds over the data-parallel ranks only. Sequence parallelism (sp, Ulysses) replicates the parameters over sp ranks and
  ZeRO partitions over dp x sp; each rank's activations hold seq_len / sp tokens.
* Pipeline parallelism (pp, ZeRO 1 only) gives each rank one stage of llmtrain.parallel.stages' partition:
  the model-state terms are the heaviest stage's (ZeRO 1 shards its optimizer states over the dp ranks of
  that stage), the activations the peak over stages of one micro-batch's bytes on the stage times the
  micro-batches it holds at once (memory.pipeline.in_flight), the embedding's on the first stage and the
  final norm's and the loss's on the last. Taking each term's worst stage bounds every stage's peak.
* FSDP2 (--engine fsdp2, torch 2.13's fully_shard as llmtrain.engine.fsdp2 applies it: one unit per
  block, then the root with the embedding, final norm and output layer) replaces DeepSpeed's model states
  and buffers with its own: fp32 shards of the parameters (the masters), of the gradients and of AdamW's
  moments, the units' parameters gathered in the model dtype (--zero 2 keeps them all from forward to
  backward, --zero 3 one block and its prefetched neighbour besides the root), fp32 gradients
  accumulated unsharded between reductions, and one unit's reduce-scatter buffers; the model states are
  checked against the real FSDP2 engine in tests/test_memory_fsdp2.py. Activations are the model's, as
  under DeepSpeed.

Import-light on purpose: no torch, no DeepSpeed, no model; estimating a 70B model allocates nothing.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import astuple, dataclass, field, replace
from functools import cached_property
from typing import Any

from llmtrain import precision
from llmtrain.config import ModelConfig, TrainConfig
from llmtrain.engine import dsconfig
from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for
from llmtrain.memory.pipeline import (
    StageSpan,
    describe_span,
    heaviest,
    in_flight,
    stage_spans,
)
from llmtrain.parallel import partition
from llmtrain.parallel.layout import Layout
from llmtrain.parallel.stages import bubble_fraction
from llmtrain.presets import count_parameters

# llmtrain.loss.LOSS_CHUNK_ROWS (not imported: that would import torch); a test keeps them equal.
LOSS_CHUNK_ROWS = 1024
# Per GPU, whatever the model: the CUDA context with PyTorch's kernels loaded (~0.5 GiB) plus cuBLAS and
# NCCL workspaces. An assumption, not derived; `make gpu-check` measures the rest against it.
RUNTIME_OVERHEAD_BYTES = 1 << 30
# DeepSpeed's defaults for what dsconfig does not set (read from its dict first where it could).
STAGE0_ALLREDUCE_BUCKET = 500_000_000  # engine allreduce_bucket_size (elements)
NVME_PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (elements)
SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size (elements)

ADAM_MOMENTS = 8  # exp_avg + exp_avg_sq, fp32
FP32 = 4
# A checkpoint's bytes besides the states, with room to spare (measured on the debug preset): per
# parameter tensor, the framing of what is saved for it (DCP's ~9.5 KiB for its weights, two moments,
# Adam's step and their metadata; torch.save's less), and per rank llmtrain's JSON state (~22 KiB).
CHECKPOINT_BYTES_PER_TENSOR = 12 << 10
CHECKPOINT_BYTES_PER_RANK = 64 << 10

_OFFLOAD_WHERE = {"none": "", "cpu": ", on the CPU", "nvme": ", on NVMe"}


def _partitioned_optim(setup: Setup) -> str:
    return f"fp32 master 4 + moments 8 B/param / ZeRO group of {setup.zero_group}"


def _bytes_of(dtype: str) -> int:
    """Bytes per element of "fp32", "bf16" or "fp16" (a precision or a DeepSpeed dtype name)."""
    return FP32 if dtype == "fp32" else 2


# ---------------------------------------------------------------- the setup being estimated


@dataclass(frozen=True)
class Setup:
    """A resolved config plus the parameter count; `shape_known` is False for a bare `--params N`.

    `ds` is the DeepSpeed config dsconfig writes for it: bucket sizes, swap buffers and the gradient
    accumulation dtype are read from there, never restated. `cfg` must not change once a Setup holds it
    (with_choice copies it). `pipeline_stage` picks the pipeline stage whose model states to estimate;
    None is the heaviest one (for_stage gives the others).
    """

    cfg: TrainConfig
    params: int
    shape_known: bool = True
    pipeline_stage: int | None = None

    @cached_property
    def ds(self) -> dict[str, Any]:
        """The DeepSpeed config dict, built once."""
        return dsconfig.build(self.cfg, self.world_size, accelerator="cuda")

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @cached_property
    def layout(self) -> Layout:
        return self.cfg.layout()

    @property
    def zero_group(self) -> int:
        """Ranks ZeRO partitions a rank's parameters over: the data-parallel ones under tp (each tp rank
        partitions its own slices) and pp (each stage's dp replicas), dp x sp under sp (sp ranks hold the
        same parameters)."""
        return self.world_size // (self.layout.tp * self.layout.pp)

    @cached_property
    def rank_params(self) -> int:
        """Parameters one rank holds before ZeRO partitions them: all, less (tp - 1) / tp of the split
        matrices, or its pipeline stage's (counted from the shape, so an explicit --params keeps its
        remainder: replicated under tp, on the estimated stage under pp, the worst place for it)."""
        m = self.cfg.model
        if self.layout.pp > 1:
            return self.params - sum(parameter_tensors(m)) + self.state_span.parameters
        if self.layout.tp == 1:
            return self.params
        return self.params - sum(parameter_tensors(m)) + sum(parameter_tensors(m, self.layout.tp))

    @cached_property
    def spans(self) -> list[StageSpan]:
        """The pipeline's stages (one without --pp): blocks, embedding/head and parameters of each."""
        return stage_spans(self.cfg.model, self.layout.pp, self.cfg.parallel.pp_partition, self.layout.tp)

    @property
    def state_span(self) -> StageSpan:
        """The stage whose model states this Setup estimates: pipeline_stage, else the heaviest."""
        if self.pipeline_stage is None:
            return heaviest(self.spans)
        return self.spans[self.pipeline_stage]

    def for_stage(self, index: int) -> Setup:
        """This setup with pipeline stage `index`'s model states."""
        return replace(self, pipeline_stage=index)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each rank (m): under pp, what one pipeline runs per step."""
        return int(self.ds["gradient_accumulation_steps"])

    @property
    def bubble(self) -> float:
        """The pipeline's idle share of each step; 0 without one."""
        return bubble_fraction(self.layout.pp, self.accumulation_steps)

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations pipeline stage `stage` holds at once (1 without a pipeline)."""
        return in_flight(self.cfg.parallel.pp_schedule, self.layout.pp, self.accumulation_steps, stage)

    @property
    def engine(self) -> str:
        return self.cfg.train.engine

    @property
    def stage(self) -> int:
        return self.cfg.zero.stage

    @property
    def offload(self) -> str:
        return self.cfg.zero.offload

    @property
    def precision(self) -> str:
        return self.cfg.train.precision

    @property
    def lp_bytes(self) -> int:
        """Bytes per element of the model's parameters and activations."""
        return _bytes_of(self.precision)

    @property
    def grad_accum_bytes(self) -> int:
        """Bytes per element of accumulated gradients: DeepSpeed's data_types.grad_accum_dtype, else the
        model dtype."""
        return _bytes_of(self.ds.get("data_types", {}).get("grad_accum_dtype", self.precision))

    @cached_property
    def zero(self) -> dict[str, Any]:
        """The zero_optimization section, with buckets at their floor for a bare --params."""
        section: dict[str, Any] = dict(self.ds["zero_optimization"])
        if not self.shape_known:  # buckets scale with hidden_size, which a bare --params does not give
            floor = dsconfig.bucket_sizes(ModelConfig(hidden_size=1))
            z = self.cfg.zero
            user = {
                "reduce_bucket_size": z.reduce_bucket_size,
                "allgather_bucket_size": z.allgather_bucket_size,
                "stage3_prefetch_bucket_size": z.prefetch_bucket_size,
                "stage3_param_persistence_threshold": z.param_persistence_threshold,
            }
            for key in section:
                if key in floor and user.get(key) is None:
                    section[key] = 0 if key == "stage3_param_persistence_threshold" else floor[key]
        return section

    def with_choice(
        self,
        stage: int,
        offload: str,
        micro_batch: int,
        checkpointing: str,
        tp: int,
        sp: int,
        pp: int = 1,
        engine: str | None = None,
        keep_batch: bool = False,
    ) -> Setup:
        """This setup under another layout (and `engine`, when given). A pipeline keeps this setup's
        global batch: its micro-batches per step (m) set both the activations it holds and its bubble,
        and comparing layouts means training the same batch (the caller checks it divides). Without one,
        accumulation costs no memory, so the global batch is left to its default, unless `keep_batch`
        (comparing step times, which accumulation sets)."""
        cfg = copy.deepcopy(self.cfg)
        cfg.train.engine = engine or cfg.train.engine  # type: ignore[assignment]
        cfg.zero.stage, cfg.zero.offload = stage, offload  # type: ignore[assignment]
        cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.pp = tp, sp, pp
        if offload == "nvme" and not cfg.zero.nvme_path:
            cfg.zero.nvme_path = "/local_nvme"
        cfg.train.micro_batch = micro_batch
        cfg.train.global_batch = self.cfg.global_batch if pp > 1 or keep_batch else None
        cfg.train.activation_checkpointing = checkpointing  # type: ignore[assignment]
        return Setup(cfg, self.params, self.shape_known)


def setup_from_config(cfg: TrainConfig, params: int | None = None, shape_known: bool = True) -> Setup:
    """A Setup for `cfg`; `params` overrides the count derived from the shape."""
    count = params if params is not None else count_parameters(**vars(cfg.model))
    if count <= 0:
        raise ConfigError(f"--params: must be positive, got {count}")
    split = (
        ("parallel.tp", cfg.parallel.tp, "tensor parallelism splits"),
        ("parallel.pp", cfg.parallel.pp, "each pipeline stage holds"),
    )
    for key, degree, what in split:
        if degree > 1 and not shape_known:
            raise ConfigError(
                f"{flag_for(key)}: what {what} depends on the model's shape; "
                "give --preset, --config or the shape flags (--hidden-size ...) instead of --params alone"
            )
    return Setup(_planned_precision(cfg), int(count), shape_known)


def _planned_precision(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with auto as a GPU run resolves it (bf16: the estimator plans GPU runs, and every GPU since
    Ampere runs bf16), so every term and DeepSpeed's dict read one concrete precision. A copy: the
    caller's config keeps its auto."""
    planned = precision.for_gpu_plan(cfg.train.precision)
    if planned == cfg.train.precision:
        return cfg
    return replace(cfg, train=replace(cfg.train, precision=planned))


def parameter_tensors(model: ModelConfig, tp: int = 1) -> list[int]:
    """Element counts of every parameter tensor of llmtrain.model.Llama (a tied lm_head counted once) that
    one rank holds under tensor parallelism of degree `tp`, as parallel.partition splits them: each
    layer's q, k, v, o, gate, up and down matrices, the embedding and lm_head into tp slices; norms
    whole."""
    return list(_parameter_tensors(astuple(model), tp))


@functools.lru_cache(maxsize=256)
def _parameter_tensors(shape: tuple[Any, ...], tp: int) -> tuple[int, ...]:
    """parameter_tensors of the model with these ModelConfig fields (a plan asks for the same few
    shapes thousands of times)."""
    return tuple(spec.per_rank(tp) for spec in partition.tensors(ModelConfig(*shape)))


# ---------------------------------------------------------------- model states (per rank)


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


def _stage3_states(setup: Setup, p: int, part: float, b: int, a: int, optim: int) -> ModelStates:
    persistent = b * persistent_elements(setup)
    params, grads, states = round(b * part), round(a * part), round(optim * part)
    notes = {
        "params": "partition / ZeRO group + small persistent params whole",
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


def shard_units(model: ModelConfig) -> ShardUnits:
    root = sum(parameter_tensors(replace(model, num_hidden_layers=0)))
    blocks = model.num_hidden_layers
    return ShardUnits(root, (sum(parameter_tensors(model)) - root) // blocks, blocks)


def fsdp2_states(setup: Setup) -> ModelStates:
    """FSDP2's model states: every rank keeps a 1/N shard of each parameter in fp32, which are the
    masters (MixedPrecisionPolicy only casts the all-gather input to bf16: FSDPParam.all_gather_inputs),
    its gradient in fp32 (foreach_reduce leaves each shard's .grad a view of its unit's reduce-scatter
    output, reduced in the fp32 reduce dtype), and AdamW's exp_avg and exp_avg_sq shaped like the shard.
    CPUOffloadPolicy keeps all three in host memory: the shards are created there, each gradient shard is
    copied out of the reduce-scatter output to the CPU, and AdamW steps there."""
    shard = setup.rank_params / setup.zero_group
    params, grads, moments = round(FP32 * shard), round(FP32 * shard), round(ADAM_MOMENTS * shard)
    where = _OFFLOAD_WHERE[setup.offload]
    notes = {
        "params": f"fp32 shards / {setup.zero_group} ranks, the masters{where}",
        "grads": f"fp32 shards, views of each unit's reduce-scatter output{where}",
        "optim": f"AdamW moments 8 B/param / {setup.zero_group} ranks, no master copy{where}",
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
    units = shard_units(setup.cfg.model)
    if setup.stage == 3:
        return units.root + min(2, units.blocks) * units.block
    return units.root + (units.blocks + 1) * units.block


def _fsdp2_terms(setup: Setup) -> list[Term]:
    """FSDP2's buffers on the GPU, in place of DeepSpeed's buckets (offloaded or not: FSDP2 gathers and
    reduces on the GPU)."""
    terms = [_gathered_term(setup), _reduce_scatter_term(setup)]
    if setup.accumulation_steps > 1:
        terms.append(_accumulated_gradients_term(setup))
    return terms


def _gathered_term(setup: Setup) -> Term:
    if not setup.shape_known:
        return Term("gathered parameters", 0, "activations", "unknown: give the model's shape")
    held = (
        "the root unit (embedding, final norm, output layer), the running block and one all-gather output"
        if setup.stage == 3
        else "every unit from its forward to its backward, and the last block's all-gather output"
    )
    return Term("gathered parameters", setup.lp_bytes * gathered_elements(setup), "activations", held)


def _reduce_scatter_term(setup: Setup) -> Term:
    """A unit's post-backward (foreach_reduce) copies its unsharded gradients, in the model dtype, into
    a reduce-scatter input in the fp32 reduce dtype and frees them only then; the input is kept until
    the next unit's reduce (reduce_scatter_max_input_buffers 1), which frees it first: one unit's at a
    time, after the activations of the blocks behind it are freed."""
    if not setup.shape_known:
        return Term("reduce-scatter buffers", 0, "transient", "unknown: give the model's shape")
    largest = shard_units(setup.cfg.model).largest
    note = "the largest unit's gradients, unsharded, and the fp32 reduce-scatter input they are copied into"
    return Term("reduce-scatter buffers", (setup.lp_bytes + FP32) * largest, "transient", note)


def _accumulated_gradients_term(setup: Setup) -> Term:
    """Gradient accumulation without communication (set_requires_gradient_sync(False) on all but the
    last micro-batch): every unit keeps its unsharded gradients, cast to the fp32 reduce dtype
    (FSDPParam.to_accumulated_grad_if_needed), until the last backward reduces them."""
    m = setup.accumulation_steps
    note = f"fp32, unsharded, summed over {m} micro-batches before one reduce-scatter"
    return Term("accumulated gradients", FP32 * setup.rank_params, "activations", note)


# ---------------------------------------------------------------- activations (per GPU, one micro-batch)


def checkpointed_layers(layers: int, mode: str, every_k: int) -> int:
    """How many blocks llmtrain.model recomputes: none 0, full all, selective blocks 0, k, 2k, ..."""
    if mode == "full":
        return layers
    if mode == "selective":
        return math.ceil(layers / every_k)
    return 0


def checkpointed_in(blocks: range, mode: str, every_k: int) -> int:
    """How many of the model's blocks `blocks` (a pipeline stage's) are recomputed: the model picks
    blocks 0, k, 2k, ... by their index in the whole model, so a stage counts those it holds."""
    if mode == "selective":
        return sum(1 for i in blocks if i % every_k == 0)
    return checkpointed_layers(len(blocks), mode, every_k)


def layer_activation_bytes(
    model: ModelConfig, batch: int, seq: int, precision: str, doc_mask: bool, tp: int = 1, sp: int = 1
) -> int:
    """Bytes one un-checkpointed block saves for backward on one rank (the tensors autograd keeps,
    deduplicated).

    RMSNorm (x2): its input (b bytes per element; backward recomputes the normalised rows from it) plus
    the fp32 rsqrt per token. Attention: the normed input to q/k/v, the RoPE-rotated q and k,
    v, SDPA's output (which o_proj reads as a view) and its fp32 log-sum-exp per head; RoPE's cos/sin are
    shared by all layers. GQA: k and v have kv_heads x head_dim columns (SDPA's enable_gqa does not copy
    them; one whole head per rank when tp exceeds them); with document masking they are repeated to all
    heads. SwiGLU: the normed input, gate, silu(gate),
    up and their product.

    Tensor parallelism splits what lies between a column-parallel projection and its row-parallel partner
    (q, k, v, SDPA's output and log-sum-exp; gate, silu, up, product) over tp; the norms and their outputs,
    which every tp rank holds whole, are not. Sequence parallelism leaves each rank seq / sp tokens of
    everything: inside attention the all-to-all hands it whole sequences of H / sp heads (the same bytes),
    and o_proj saves the all-to-all's output back, a copy apart from SDPA's output.
    """
    b, d, tokens = _bytes_of(precision), model.hidden_size, batch * seq // sp
    # k and v columns on one rank: its key/value heads (one whole head, replicated, when tp exceeds them)
    kv_heads = model.num_key_value_heads
    kv = d // tp if doc_mask else kv_heads * model.head_width // min(tp, kv_heads)
    norms = 2 * (tokens * d * b + FP32 * tokens)
    heads = (b * tokens * 2 * d + FP32 * tokens * model.num_attention_heads) // tp + b * tokens * 2 * kv
    regathered = b * tokens * d // tp if sp > 1 else 0  # this tp rank's heads
    attention = b * tokens * d + heads + regathered
    mlp = b * tokens * d + 4 * b * tokens * model.intermediate_size // tp
    return norms + attention + mlp


def rank_tokens(setup: Setup) -> int:
    """Tokens of one micro-batch in one rank's activations: seq_len / sp of each sequence."""
    t = setup.cfg.train
    return t.micro_batch * t.seq_len // setup.layout.sp


def hidden_state_bytes(setup: Setup) -> int:
    """One micro-batch's residual stream on one rank, in the model dtype: a block's input, the tensor a
    pipeline stage receives and sends."""
    return setup.lp_bytes * rank_tokens(setup) * setup.cfg.model.hidden_size


def _layer_bytes(setup: Setup) -> int:
    t, lay = setup.cfg.train, setup.layout
    return layer_activation_bytes(
        setup.cfg.model,
        t.micro_batch,
        t.seq_len,
        setup.precision,
        setup.cfg.data.document_masking,
        lay.tp,
        lay.sp,
    )


def activation_bytes(setup: Setup, stage: int = 0) -> int:
    """Bytes saved for backward by one forward pass of one micro-batch on one rank, under the
    checkpointing mode and the layout; under pp, on pipeline stage `stage` (its blocks, the embedding's
    on the first, the final norm's on the last, and what the pipeline keeps until the micro-batch's
    backward: pipeline_io_bytes)."""
    m, t = setup.cfg.model, setup.cfg.train
    span = setup.spans[stage]
    b, tokens, doc_mask = setup.lp_bytes, rank_tokens(setup), setup.cfg.data.document_masking
    residual = hidden_state_bytes(setup)
    on_gpu = 0 if t.cpu_checkpointing else checkpointed_input_bytes(setup, stage)
    blocks = on_gpu + (span.blocks - _recomputed_blocks(setup, stage)) * _layer_bytes(setup)
    # RoPE's cos and sin ([B, T / sp, head_dim] each) and the boolean block-diagonal mask: the model
    # computes them once for all its blocks; a pipeline's blocks each compute their own from the
    # positions (and document ids) passed between stages.
    computed = 1 if setup.layout.pp == 1 else span.blocks
    whole = t.micro_batch * t.seq_len  # every sp rank receives whole sequences and slices views of them
    rope = computed * 2 * b * tokens * m.head_width
    mask = computed * whole * t.seq_len if doc_mask else 0
    ids = 8 * whole if span.embedding else 0  # the embedding's int64 indices
    head = 0
    if span.head:
        final_norm = tokens * m.hidden_size * b + FP32 * tokens
        # The fused loss keeps its gradients from forward to backward: for the final hidden states (a
        # residual stream's size) and for this rank's V / tp rows of the output weight; + the token count.
        head = final_norm + residual + b * _rank_vocab(setup) * m.hidden_size + 8
    return blocks + rope + mask + ids + head + pipeline_io_bytes(setup, span)


def checkpointed_input_bytes(setup: Setup, stage: int = 0) -> int:
    """What the recomputed blocks of one micro-batch keep on one rank (of pipeline stage `stage`): each
    its input, the residual stream; 1/tp of it with partitioned activations (DeepSpeed splits it over
    the tp ranks and all-gathers it for the recompute). In host memory with --cpu-checkpointing."""
    per_block = hidden_state_bytes(setup)
    if setup.cfg.train.partition_activations:
        per_block //= setup.layout.tp
    return _recomputed_blocks(setup, stage) * per_block


def _recomputed_blocks(setup: Setup, stage: int) -> int:
    """Blocks of pipeline stage `stage` (the only one without --pp) that activation checkpointing
    recomputes."""
    t = setup.cfg.train
    return checkpointed_in(setup.spans[stage].block_range, t.activation_checkpointing, t.checkpoint_every_k)


def _rank_vocab(setup: Setup) -> int:
    """Vocabulary rows of the output layer one rank holds: V / tp (vocab-parallel)."""
    return setup.cfg.model.vocab_size // setup.layout.tp


def pipeline_io_bytes(setup: Setup, span: StageSpan) -> int:
    """What DeepSpeed's pipeline keeps per micro-batch until its backward, besides saved activations: the
    received input hidden states (their gradient goes back) and the stage's output (backward starts from
    it), in the model dtype, and the int64 tensors passed along with them (positions, document ids) and
    the last stage's labels. Nothing without a pipeline (the one stage has the embedding and the head)."""
    if setup.layout.pp == 1:
        return 0
    t = setup.cfg.train
    residual = hidden_state_bytes(setup)
    hidden = residual * ((not span.embedding) + (not span.head))
    int64_tensors = 1 + setup.cfg.data.document_masking + span.head  # positions, doc ids, labels
    return hidden + 8 * t.micro_batch * t.seq_len * int64_tensors


def stage_activations(setup: Setup, stage: int) -> int:
    """Activations pipeline stage `stage` holds at its peak: one micro-batch's times those in flight."""
    return setup.in_flight(stage) * activation_bytes(setup, stage)


def activation_peak_stage(setup: Setup) -> int:
    """The stage holding the most activations (the first under 1F1B, unless its blocks are lighter)."""
    return max(range(setup.layout.pp), key=lambda s: stage_activations(setup, s))


def backward_working_bytes(setup: Setup) -> int:
    """Transient bytes while one block runs backward: its recomputed activations when checkpointed, plus
    the activation gradients in flight (about two hidden-sized and two MLP-sized tensors)."""
    m, t = setup.cfg.model, setup.cfg.train
    recompute = 0
    if checkpointed_layers(m.num_hidden_layers, t.activation_checkpointing, t.checkpoint_every_k):
        recompute = _layer_bytes(setup)
    mlp_width = m.intermediate_size // setup.layout.tp
    return recompute + 2 * setup.lp_bytes * rank_tokens(setup) * (m.hidden_size + mlp_width)


def loss_chunk_bytes(setup: Setup) -> int:
    """The fused output layer + cross-entropy (llmtrain.loss) while it runs, besides the gradients it
    keeps (counted with the activations): one chunk's fp32 logits (overwritten by their gradient) and
    that gradient's low-precision copy, and the output weight's gradient summed over the chunks in fp32
    next to one chunk's low-precision product (or, at the end, the cast). Under tp each rank computes
    the logits of its V / tp vocabulary rows (the vocab-parallel loss)."""
    m, tokens, lp = setup.cfg.model, rank_tokens(setup), setup.lp_bytes
    rows = min(LOSS_CHUNK_ROWS, tokens)
    vocab = _rank_vocab(setup)
    low_precision_copy = lp if lp < FP32 else 0  # in fp32 the logits are their own gradient buffer
    chunk = (FP32 + low_precision_copy) * rows * vocab
    return chunk + (FP32 + low_precision_copy) * vocab * m.hidden_size


def ulysses_buffer_bytes(setup: Setup) -> int:
    """Sequence parallelism's all-to-all buffers of one attention layer: q, k and v exchanged in and the
    output exchanged back, each this rank's seq / sp tokens of all its heads (H / tp under tp). They
    bound the contiguous send copy and receive buffer DeepSpeed allocates per exchange; 0 without sp."""
    if setup.layout.sp == 1:
        return 0
    m = setup.cfg.model
    kv = m.num_key_value_heads * m.head_width  # exchanged before document masking repeats them
    return 2 * setup.lp_bytes * rank_tokens(setup) * (m.hidden_size + kv) // setup.layout.tp


# ---------------------------------------------------------------- the breakdown


@dataclass(frozen=True)
class Term:
    """One line of the breakdown. phase: 'always' is held throughout; 'activations' during forward and
    backward; 'transient' the largest of these rides on top of the activations; 'step' during the
    optimizer step (activations are gone by then)."""

    name: str
    bytes: int
    phase: str
    note: str


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    gpu: list[Term]
    cpu: list[Term]  # per node
    nvme: list[Term]  # per node
    states: ModelStates

    @property
    def gpu_peak(self) -> int:
        """always + max(activations + largest transient, step buffers)."""

        def total(phase: str) -> int:
            return sum(t.bytes for t in self.gpu if t.phase == phase)

        transient = max((t.bytes for t in self.gpu if t.phase == "transient"), default=0)
        return total("always") + max(total("activations") + transient, total("step"))

    @property
    def cpu_per_node(self) -> int:
        return sum(t.bytes for t in self.cpu)

    @property
    def nvme_per_node(self) -> int:
        return sum(t.bytes for t in self.nvme)

    def to_dict(self) -> dict[str, Any]:
        s, c = self.setup, self.setup.cfg

        def rows(terms: list[Term]) -> list[dict[str, Any]]:
            return [{"term": t.name, "bytes": t.bytes, "phase": t.phase, "note": t.note} for t in terms]

        return {
            "setup": {
                "params": s.params,
                "preset": c.preset if s.shape_known else None,
                "engine": s.engine,
                "zero_stage": s.stage,
                "offload": s.offload,
                "precision": s.precision,
                "gpus_per_node": c.launch.gpus,
                "nodes": c.launch.nodes,
                "world_size": s.world_size,
                "tp": s.layout.tp,
                "sp": s.layout.sp,
                "pp": s.layout.pp,
                "pp_schedule": c.parallel.pp_schedule,
                "pp_partition": c.parallel.pp_partition,
                "data_parallel": s.layout.dp,
                "layout": s.layout.describe(),
                "zero_group": s.zero_group,
                "micro_batch": c.train.micro_batch,
                "global_batch": s.ds["train_batch_size"],
                "gradient_accumulation_steps": s.accumulation_steps,
                "seq_len": c.train.seq_len,
                "activation_checkpointing": c.train.activation_checkpointing,
                "checkpoint_every_k": c.train.checkpoint_every_k,
            },
            "per_gpu": rows(self.gpu),
            "per_gpu_peak_bytes": self.gpu_peak,
            "model_states_per_rank_bytes": self.states.total,
            "per_node_cpu": rows(self.cpu),
            "per_node_cpu_bytes": self.cpu_per_node,
            "per_node_nvme": rows(self.nvme),
            "per_node_nvme_bytes": self.nvme_per_node,
            "pipeline": pipeline_report(s) if s.layout.pp > 1 else None,
        }


def pipeline_report(setup: Setup) -> dict[str, Any]:
    """The pipeline's schedule, bubble and every stage's parameters, model states and activations (the
    per-GPU terms hold the heaviest stage's states and the peak stage's activations)."""
    p = setup.cfg.parallel
    stages = []
    for span in setup.spans:
        states = model_states(setup.for_stage(span.index))
        stages.append(
            {
                "stage": span.index,
                "layers": describe_span(span),
                "blocks": span.blocks,
                "params": span.parameters,
                "model_states_bytes": states.total,
                "model_states_gpu_bytes": states.gpu,
                "in_flight_micro_batches": setup.in_flight(span.index),
                "activations_per_micro_batch_bytes": activation_bytes(setup, span.index),
                "activations_bytes": stage_activations(setup, span.index),
            }
        )
    return {
        "stages": setup.layout.pp,
        "schedule": p.pp_schedule,
        "partition": p.pp_partition,
        "micro_batches": setup.accumulation_steps,
        "bubble_fraction": setup.bubble,
        "heaviest_stage": setup.state_span.index,
        "activation_peak_stage": activation_peak_stage(setup),
        "per_stage": stages,
    }


def estimate(setup: Setup) -> Estimate:
    states = model_states(setup)
    buffers = _fsdp2_terms(setup) if setup.engine == "fsdp2" else _buffer_terms(setup)
    gpu = _state_terms(setup, states) + _activation_terms(setup) + buffers
    gpu += _pipeline_terms(setup)
    gpu.append(
        Term(
            "runtime overhead",
            RUNTIME_OVERHEAD_BYTES,
            "always",
            "CUDA context + cuBLAS/NCCL workspaces (assumed)",
        )
    )
    cpu, nvme = _host_terms(setup, states)
    return Estimate(setup, gpu, cpu, nvme, states)


def _state_terms(setup: Setup, s: ModelStates) -> list[Term]:
    params_note = s.notes.get("params", "model dtype") + _split_note(setup)
    return [
        Term("parameters", s.params_gpu, "always", params_note),
        Term("gradients", s.grads_gpu, "always", s.notes.get("grads", "model dtype")),
        Term("optimizer states", s.optim_gpu, "always", s.notes.get("optim", "")),
    ]


def _split_note(setup: Setup) -> str:
    """What tp, sp or pp does to a rank's parameters, for the parameters' note."""
    lay = setup.layout
    if lay.pp > 1:
        span = setup.state_span
        return (
            f"; pipeline stage {span.index} of {lay.pp}, the heaviest: {setup.rank_params:,} params "
            f"({describe_span(span)})"
        )
    if lay.tp > 1:
        return (
            f"; q,k,v,o,gate,up,down, embedding and lm_head / tp {lay.tp} ({setup.rank_params:,} "
            "params per rank), norms whole"
        )
    return f"; replicated over sp {lay.sp}" if lay.sp > 1 else ""


def _activation_terms(setup: Setup) -> list[Term]:
    if not setup.shape_known:
        return [Term("activations", 0, "activations", "unknown: give --hidden-size --layers --heads ...")]
    t, lay = setup.cfg.train, setup.layout
    mode = t.activation_checkpointing
    mode_note = f"selective, every {t.checkpoint_every_k}" if mode == "selective" else mode
    tokens = f"{t.seq_len} tokens" if lay.sp == 1 else f"{t.seq_len} / sp {lay.sp} tokens"
    split = f"; attention and MLP inner activations / tp {lay.tp}" if lay.tp > 1 else ""
    if t.cpu_checkpointing:
        split += "; checkpointed blocks' inputs in host memory"
    elif t.partition_activations:
        split += f"; checkpointed blocks' inputs partitioned / tp {lay.tp}"
    peak = activation_peak_stage(setup) if lay.pp > 1 else 0
    terms = [
        Term(
            "activations",
            stage_activations(setup, peak),
            "activations",
            f"saved for backward, micro-batch {t.micro_batch} x {tokens}, checkpointing {mode_note}{split}"
            + _in_flight_note(setup, peak),
        ),
        Term(
            "backward working set", backward_working_bytes(setup), "transient", "recompute + activation grads"
        ),
        Term(
            "logits and loss",
            loss_chunk_bytes(setup),
            "transient",
            f"fused with lm_head, chunks of {LOSS_CHUNK_ROWS} rows: fp32 logits never whole"
            + ("; last stage only" if lay.pp > 1 else ""),
        ),
    ]
    if lay.sp > 1:
        note = f"q, k, v in and output back, one attention layer at a time, sp {lay.sp}"
        terms.append(Term("Ulysses all-to-all buffers", ulysses_buffer_bytes(setup), "transient", note))
    return terms


def _in_flight_note(setup: Setup, stage: int) -> str:
    """Which stage the activations are of and how many micro-batches it holds, for their note."""
    lay = setup.layout
    if lay.pp == 1:
        return ""
    span, held = setup.spans[stage], setup.in_flight(stage)
    return (
        f"; stage {stage} of {lay.pp}, the peak: {span.blocks} blocks x {held} micro-batch"
        f"{'es' if held > 1 else ''} in flight ({setup.cfg.parallel.pp_schedule}, "
        f"{setup.accumulation_steps} per step)"
    )


def _pipeline_terms(setup: Setup) -> list[Term]:
    """DeepSpeed's pipeline receive buffers, allocated at the first exchange and kept: one activation
    from the previous stage and one gradient from the next (a middle stage has both, an end stage one)."""
    lay = setup.layout
    if lay.pp == 1 or not setup.shape_known:
        return []
    buffers = 1 if lay.pp == 2 else 2
    size = hidden_state_bytes(setup)
    note = (
        "one micro-batch's received activation and gradient"
        if buffers == 2
        else "one micro-batch's received activation (last stage) or gradient (first stage)"
    )
    return [Term("pipeline receive buffers", buffers * size, "always", note)]


def _largest_param(setup: Setup) -> int:
    """The largest parameter tensor a rank holds: under pp, its stage's."""
    if not setup.shape_known:
        return 0
    if setup.layout.pp > 1:
        return setup.state_span.largest_tensor
    return max(parameter_tensors(setup.cfg.model, setup.layout.tp))


def _buffer_terms(setup: Setup) -> list[Term]:
    z, b, p = setup.zero, setup.lp_bytes, setup.rank_params
    if setup.stage == 0:
        bucket = min(p, STAGE0_ALLREDUCE_BUCKET)
        return [Term("allreduce bucket", b * bucket, "step", "engine's flattened allreduce (5e8 elements)")]
    terms: list[Term] = []
    if setup.stage in (1, 2):
        copies = 2 if z.get("overlap_comm") else 1
        terms.append(
            Term(
                "reduce buckets",
                copies * b * min(p, z["reduce_bucket_size"]),
                "always",
                f"{copies} x reduce_bucket_size {z['reduce_bucket_size']:,} elements",
            )
        )
        terms.append(
            Term(
                "allgather bucket",
                b * min(p, z["allgather_bucket_size"]),
                "step",
                f"allgather_bucket_size {z['allgather_bucket_size']:,} elements",
            )
        )
        if setup.offload == "cpu":
            terms.append(
                Term("offload grad staging", b * _largest_param(setup), "always", "largest parameter")
            )
        elif setup.grad_accum_bytes != FP32:  # fp16: the step builds an fp32 copy of the grad partition
            terms.append(Term("fp32 grad partition", round(FP32 * p / setup.zero_group), "step", "at step"))
        return terms
    live = z["stage3_max_live_parameters"] + z["stage3_prefetch_bucket_size"]
    return [
        Term(
            "reduce bucket",
            b * min(p, z["reduce_bucket_size"]),
            "always",
            f"reduce_bucket_size {z['reduce_bucket_size']:,} elements",
        ),
        Term(
            "gathered parameters",
            b * min(p - persistent_elements(setup), live),
            "activations",
            f"up to stage3_max_live_parameters {z['stage3_max_live_parameters']:,} "
            f"+ prefetch {z['stage3_prefetch_bucket_size']:,} elements",
        ),
    ]


# The offloaded states' notes per engine: FSDP2 offloads its fp32 shards, which are the masters.
_HOST_NOTES = {
    "deepspeed": ("pinned, per node", "fp32 partitions, pinned", "fp32 master + moments"),
    "fsdp2": ("fp32 shards (the masters), pinned", "fp32 shards, pinned", "AdamW moments"),
}


def _host_terms(setup: Setup, s: ModelStates) -> tuple[list[Term], list[Term]]:
    g, b = setup.cfg.launch.gpus, setup.lp_bytes
    params_note, grads_note, optim_note = _HOST_NOTES[setup.engine]
    cpu = [
        Term("offloaded parameters", g * s.params_cpu, "always", params_note),
        Term("offloaded gradients", g * s.grads_cpu, "always", grads_note),
        Term("offloaded optimizer states", g * s.optim_cpu, "always", optim_note),
    ]
    if setup.cfg.train.cpu_checkpointing and setup.shape_known:
        peak = activation_peak_stage(setup) if setup.layout.pp > 1 else 0
        held = setup.in_flight(peak) * checkpointed_input_bytes(setup, peak)
        split = f" / tp {setup.layout.tp}" if setup.cfg.train.partition_activations else ""
        note = f"checkpointed blocks' inputs{split} (--cpu-checkpointing), per GPU x {g}"
        cpu.append(Term("checkpointed activations", g * held, "always", note))
    if setup.engine == "deepspeed" and setup.stage in (1, 2) and setup.offload == "cpu":
        staging = round(b * setup.rank_params / setup.zero_group) + b * _largest_param(setup)
        cpu.append(Term("pinned staging buffers", g * staging, "always", "bit16 partition + largest grad"))
    nvme: list[Term] = []
    if setup.offload == "nvme":
        cpu.append(_swap_buffers(setup))
        nvme = [
            Term("parameters on NVMe", g * s.params_nvme, "always", "bit16 partitions"),
            Term("optimizer states on NVMe", g * s.optim_nvme, "always", "fp32 master + moments"),
        ]
    return [t for t in cpu if t.bytes], nvme


def _swap_buffers(setup: Setup) -> Term:
    """NVMe offload's pinned aio buffers, per node: per GPU, offload_param.buffer_count buffers of
    buffer_size elements in the model dtype and offload_optimizer.buffer_count fp32 sub-groups."""
    z = setup.zero
    params, optim = z["offload_param"], z["offload_optimizer"]
    param_buffer = params.get("buffer_size", NVME_PARAM_BUFFER_SIZE) * setup.lp_bytes
    sub_group = min(z.get("sub_group_size", SUB_GROUP_SIZE), round(setup.rank_params / setup.zero_group))
    swap = params["buffer_count"] * param_buffer + optim["buffer_count"] * FP32 * sub_group
    note = f"{params['buffer_count']} param + {optim['buffer_count']} optimizer aio buffers per GPU"
    return Term("pinned swap buffers", setup.cfg.launch.gpus * swap, "always", note)
