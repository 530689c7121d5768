"""What composes with what, and how a batch divides: the one home of these rules.

`RULES` is the table of refused combinations of the layout's columns (ZeRO stage, offload target,
precision, accelerator). Config validation, DeepSpeed's config and the estimator's fit search all ask
it, so a combination is refused, or proposed, in exactly one place. A new axis (tensor, sequence or
pipeline degree; the engine) is one more field of `Choice` and a few more rows, not a branch in each
caller. `layout.Layout` holds the rules that also need the model's shape and the world size.
`batch_triple` is the one division of the global batch into micro-batches and accumulation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for

ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")  # fastest first: each moves states over a slower link every step


@dataclass(frozen=True)
class ZeroPlus:
    """DeepSpeed's ZeRO++ on top of ZeRO 3: hpZ (a second weight partition within each node), qwZ (int8
    weight all-gathers), qgZ (int4 gradient reduction across nodes)."""

    shard_within_node: bool = False
    quantize_weights: bool = False
    quantize_grads: bool = False

    @property
    def any(self) -> bool:
        return self.shard_within_node or self.quantize_weights or self.quantize_grads

    @property
    def flags(self) -> str:
        """The flags that turn on what is on, for an error: `--shard-within-node --quantize-grads`."""
        return " ".join(flag_for(f"zero.{f.name}") for f in fields(self) if getattr(self, f.name))


@dataclass(frozen=True)
class Choice:
    """One point of the layout space. `accelerator` is None where it is not known yet (config
    validation on the machine that launches), and `nodes` where the launcher decides them; rules about
    them are then left for later."""

    stage: int
    offload: str = "none"
    precision: str = "bf16"
    accelerator: str | None = None
    tp: int = 1
    sp: int = 1
    pp: int = 1
    engine: str = "deepspeed"
    zero_plus: ZeroPlus = ZeroPlus()
    nodes: int | None = None
    dp_shard: int | None = None  # FSDP2's shard group (HSDP); None: as layout.fsdp_mesh decides


@dataclass(frozen=True)
class Rule:
    key: str  # the config key an error names (its flag when it has one)
    refuses: Callable[[Choice], bool]
    why: str  # formatted with the choice's fields


def _quantizing_off_cuda(field: str) -> Callable[[Choice], bool]:
    """Whether a choice turns on ZeRO++'s quantizer `field` (of ZeroPlus) on a known non-CUDA machine."""
    return lambda c: bool(getattr(c.zero_plus, field)) and c.accelerator not in (None, "cuda")


RULES: tuple[Rule, ...] = (
    Rule(
        "zero.stage",
        # FSDP2 always shards parameters, gradients and optimizer states together; it differs from
        # ZeRO 3 only in whether a block's parameters are resharded after its forward.
        lambda c: c.engine == "fsdp2" and c.stage < 2,
        "ZeRO {stage} with --engine fsdp2: FSDP2 shards parameters, gradients and optimizer states "
        "together; use --zero 3 (reshard after forward) or --zero 2 (keep parameters gathered until "
        "backward), or --engine deepspeed for ZeRO 0 and 1",
    ),
    Rule(
        "zero.offload",
        lambda c: c.engine == "fsdp2" and c.offload == "nvme",
        "NVMe offload with --engine fsdp2: FSDP2 offloads to CPU memory only; use --offload cpu, or "
        "--engine deepspeed",
    ),
    Rule(
        "train.precision",
        # FSDP2's fp16 would need a sharded gradient scaler; bf16 needs none.
        lambda c: c.engine == "fsdp2" and c.precision == "fp16",
        "fp16 with --engine fsdp2: llmtrain runs FSDP2 in bf16 or fp32; use --precision bf16",
    ),
    Rule(
        "train.engine",
        lambda c: c.engine == "fsdp2" and (c.sp > 1 or c.pp > 1),
        "--engine fsdp2 with --sp/--pp: llmtrain's sequence and pipeline parallelism run on DeepSpeed; "
        "use --engine deepspeed, or FSDP2 with data and tensor parallelism (--tp)",
    ),
    Rule(
        "parallel.dp_shard",
        # DeepSpeed's own replicate-across / shard-inside (MiCS) is gone from 0.19 ("MiCS ZeRO-3 sharding
        # has been removed"); hpZ keeps ZeRO 3's full sharding and adds a node-local copy instead.
        lambda c: c.dp_shard is not None and c.engine != "fsdp2",
        "with --engine {engine}: replicating across shard groups (HSDP) is FSDP2's; use --engine fsdp2, "
        "or --shard-within-node (ZeRO++ hpZ) to keep ZeRO 3's gathers inside each node",
    ),
    Rule(
        "zero.offload",
        lambda c: c.stage == 0 and c.offload != "none",
        "offload {offload} needs ZeRO stage 1, 2 or 3; add --zero 2 or --zero 3",
    ),
    Rule(
        "zero.offload",
        lambda c: c.offload == "nvme" and c.stage != 3,
        "NVMe offload needs ZeRO stage 3; add --zero 3",
    ),
    Rule(
        "train.precision",
        lambda c: c.precision == "fp16" and c.accelerator not in (None, "cuda"),
        "fp16 needs a CUDA GPU (DeepSpeed's CPU accelerator has no fp16 kernels); use --precision bf16 or fp32",
    ),
    Rule(
        "parallel.pp",
        # PipelineEngine reduces gradients over its grid's data axis (engine.py: the pipeline branch of
        # _reduce_non_expert_gradients), and its topology has no sequence axis to give it.
        lambda c: c.pp > 1 and c.sp > 1,
        "--pp {pp} with --sp {sp}: DeepSpeed's pipeline engine reduces gradients over its grid's data "
        "axis only (its topology has no sequence axis), so the sp ranks' partial gradients would never "
        "be summed; use --pp with --tp and data parallelism, or --sp without --pp",
    ),
    Rule(
        "zero.stage",
        lambda c: c.stage == 0 and (c.tp > 1 or c.sp > 1),
        "ZeRO 0 with --tp/--sp: the update needs ZeRO's model-parallel-aware gradient norm and overflow "
        "check; use --zero 1 (it shards only optimizer states)",
    ),
    Rule(
        "zero.stage",
        # PipelineEngine asserts stage < 2: ZeRO 2 and 3 shard gradients, which the pipeline schedule
        # accumulates over its micro-batches itself.
        lambda c: c.pp > 1 and c.stage >= 2,
        "ZeRO {stage} with --pp: DeepSpeed's pipeline engine runs ZeRO 0 and 1 only; use --zero 1",
    ),
    Rule(
        "train.engine",
        lambda c: c.zero_plus.any and c.engine != "deepspeed",
        "{zero_plus.flags} with --engine {engine}: ZeRO++ is DeepSpeed's; use --engine deepspeed --zero 3",
    ),
    Rule(
        "zero.stage",
        lambda c: c.zero_plus.any and c.stage != 3,
        "{zero_plus.flags} with --zero {stage}: ZeRO++ partitions, gathers and reduces ZeRO 3's weights; "
        "add --zero 3",
    ),
    Rule(
        "zero.shard_within_node",
        # DeepSpeed builds hpZ's groups from consecutive global ranks (groups._create_zero_param_parallel_
        # group), which under tp or sp are model-parallel peers (rank order, layout.py), not ZeRO's.
        lambda c: c.zero_plus.shard_within_node and (c.tp > 1 or c.sp > 1),
        "with --tp {tp} --sp {sp}: DeepSpeed groups hpZ's ranks by consecutive rank, which under "
        "--tp/--sp are model-parallel peers rather than ZeRO's; drop one of them",
    ),
    Rule(
        "zero.shard_within_node",
        # partition_parameters._partition_param_sec: torch.empty(device="nvme") (measured, 0.19.8).
        lambda c: c.zero_plus.shard_within_node and c.offload == "nvme",
        "with --offload nvme: DeepSpeed 0.19 allocates hpZ's second partition on the offload device, "
        "which fails for NVMe; use --offload cpu, or none",
    ),
    *(
        Rule(
            key,
            # Measured, DeepSpeed 0.19.8 on its CPU accelerator: qwZ's and qgZ's quantizer op is GPU-only
            # ("This op had not been implemented on CPU backend", QuantizerBuilder.load).
            _quantizing_off_cuda(key.removeprefix("zero.")),
            "needs a CUDA GPU (this machine runs {accelerator}): DeepSpeed's ZeRO++ quantizer kernels have "
            "no CPU implementation; drop the flag",
        )
        for key in ("zero.quantize_weights", "zero.quantize_grads")
    ),
    Rule(
        "zero.shard_within_node",
        lambda c: c.zero_plus.shard_within_node and c.nodes == 1,
        "with one node ZeRO 3 already gathers inside it, and the second partition would only cost "
        "memory; it applies with --nodes 2 or more",
    ),
    Rule(
        "zero.quantize_grads",
        # DeepSpeed quantizes only when the world spans nodes (stage3.__avg_scatter_grads: num_nodes > 1),
        # else it reduce-scatters as usual: the flag would do nothing.
        lambda c: c.zero_plus.quantize_grads and c.nodes == 1,
        "with one node it would do nothing: DeepSpeed's qgZ quantizes the reduction across nodes only; "
        "it applies with --nodes 2 or more",
    ),
    Rule(
        "zero.stage",
        # Stage 0 steps a bare optimizer without an overflow check (no skipped update for a bad step),
        # and DeepSpeed 0.19.8 saves a bf16 stage-0 pipeline checkpoint that it then cannot load.
        lambda c: c.pp > 1 and c.stage == 0,
        "ZeRO 0 with --pp: the pipeline's stage-0 update has no overflow check and its bf16 checkpoints "
        "do not load in DeepSpeed 0.19; use --zero 1 (it shards only optimizer states)",
    ),
)


def refusal(choice: Choice) -> str | None:
    """The first rule `choice` breaks, as a one-line error naming the flag; None when it composes."""
    for rule in RULES:
        if rule.refuses(choice):
            return f"{flag_for(rule.key)}: {rule.why.format(**vars(choice))}"
    return None


def check(choice: Choice) -> None:
    message = refusal(choice)
    if message is not None:
        raise ConfigError(message)


def combinations(
    precision: str,
    accelerator: str | None = None,
    tp: int = 1,
    sp: int = 1,
    pp: int = 1,
    engine: str = "deepspeed",
) -> Iterator[Choice]:
    """Every (stage, offload) that composes with `precision`, the tp/sp/pp degrees and the engine on
    `accelerator`."""
    for stage, offload in itertools.product(ZERO_STAGES, OFFLOADS):
        choice = Choice(stage, offload, precision, accelerator, tp, sp, pp, engine)
        if refusal(choice) is None:
            yield choice


def composes_with_hpz(choice: Choice, nodes: int) -> bool:
    """Whether `choice` on `nodes` nodes may add ZeRO++ hpZ (--shard-within-node)."""
    with_hpz = replace(choice, zero_plus=ZeroPlus(shard_within_node=True), nodes=nodes)
    return refusal(with_hpz) is None


def offload_rank(offload: str) -> int:
    """0 for no offload, higher for slower targets: the estimator's speed order."""
    return OFFLOADS.index(offload)


def batch_triple(micro_batch: int, global_batch: int | None, data_parallel: int) -> tuple[int, int, int]:
    """(global batch, micro-batch per rank, gradient accumulation steps); the global batch defaults to one
    micro-batch per data-parallel rank and must be a whole number of them (tp and sp ranks of one group
    share their samples, so they do not multiply the batch; under pipeline parallelism the accumulation
    steps are the micro-batches one pipeline runs per step)."""
    per_step = micro_batch * data_parallel
    total = global_batch or per_step
    if total % per_step:
        raise ConfigError(
            f"{flag_for('train.global_batch')}: {total} is not divisible by micro-batch {micro_batch} x "
            f"data-parallel size {data_parallel} = {per_step}; use a multiple of {per_step}"
        )
    return total, micro_batch, total // per_step
