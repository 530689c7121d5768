"""The setup being estimated: a resolved config, its parameter count and the DeepSpeed dict it generates,
with the layout's views of them (ZeRO group, the rank's parameters, pipeline stages, accumulation)."""

from __future__ import annotations

import copy
import functools
from dataclasses import astuple, dataclass, replace
from functools import cached_property
from typing import Any

from llmtrain import precision
from llmtrain.config import ModelConfig, TrainConfig
from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for
from llmtrain.planning import dsconfig, partition
from llmtrain.planning.layout import Layout, fsdp_mesh
from llmtrain.planning.memory.pipeline import (
    StageSpan,
    heaviest,
    in_flight,
    stage_spans,
)
from llmtrain.planning.stages import bubble_fraction
from llmtrain.presets import count_parameters

FP32 = 4


def bytes_of(dtype: str) -> int:
    """Bytes per element of "fp32", "bf16" or "fp16" (a precision or a DeepSpeed dtype name)."""
    return FP32 if dtype == "fp32" else 2


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

    @property
    def fsdp_mesh(self) -> dict[str, int]:
        """FSDP2's device mesh, as fsdp2_plan records it: {"replicate": R, "shard": S, "tp": T}; S is all
        data-parallel ranks, or under HSDP (by default one node's on several nodes) a group of them."""
        return fsdp_mesh(self.layout, self.cfg.parallel.dp_shard, self.cfg.launch.gpus)

    @property
    def fsdp_shard_ranks(self) -> int:
        return self.fsdp_mesh["shard"]

    @property
    def state_shards(self) -> int:
        """Ranks a rank's optimizer states are partitioned over: FSDP2's shard group, or ZeRO's."""
        return self.fsdp_shard_ranks if self.engine == "fsdp2" else self.zero_group

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
        return bytes_of(self.precision)

    @property
    def grad_accum_bytes(self) -> int:
        """Bytes per element of accumulated gradients: DeepSpeed's data_types.grad_accum_dtype, else the
        model dtype."""
        return bytes_of(self.ds.get("data_types", {}).get("grad_accum_dtype", self.precision))

    @property
    def hpz_ranks(self) -> int:
        """Ranks of ZeRO++ hpZ's partition group (a node's), as DeepSpeed's dict has it; 1 without hpZ."""
        return int(self.zero.get("zero_hpz_partition_size", 1))

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
        shard_within_node: bool = False,
        dp_shard: int | None = None,
    ) -> Setup:
        """This setup under another layout (and `engine`, when given). A pipeline keeps this setup's
        global batch: its micro-batches per step (m) set both the activations it holds and its bubble,
        and comparing layouts means training the same batch (the caller checks it divides). Without one,
        accumulation costs no memory, so the global batch is left to its default, unless `keep_batch`
        (comparing step times, which accumulation sets). ZeRO++ hpZ is on only when `shard_within_node`
        says so (it composes with ZeRO 3 alone); FSDP2 shards over `dp_shard` ranks (None: its default,
        layout.fsdp_mesh)."""
        cfg = copy.deepcopy(self.cfg)
        cfg.train.engine = engine or cfg.train.engine  # type: ignore[assignment]
        cfg.zero.stage, cfg.zero.offload = stage, offload  # type: ignore[assignment]
        cfg.zero.shard_within_node = shard_within_node
        cfg.parallel.dp_shard = dp_shard
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
    one rank holds under tensor parallelism of degree `tp`, as planning.partition splits them: each
    layer's q, k, v, o, gate, up and down matrices, the embedding and lm_head into tp slices; norms
    whole."""
    return list(_parameter_tensors(astuple(model), tp))


@functools.lru_cache(maxsize=256)
def _parameter_tensors(shape: tuple[Any, ...], tp: int) -> tuple[int, ...]:
    """parameter_tensors of the model with these ModelConfig fields (a plan asks for the same few
    shapes thousands of times)."""
    return tuple(spec.per_rank(tp) for spec in partition.tensors(ModelConfig(*shape)))
