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
from dataclasses import dataclass

from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for

ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")  # fastest first: each moves states over a slower link every step


@dataclass(frozen=True)
class Choice:
    """One point of the layout space. `accelerator` is None where it is not known yet (config
    validation on the machine that launches); rules about it are then left for later."""

    stage: int
    offload: str = "none"
    precision: str = "bf16"
    accelerator: str | None = None
    tp: int = 1
    sp: int = 1
    pp: int = 1
    engine: str = "deepspeed"


@dataclass(frozen=True)
class Rule:
    key: str  # the config key an error names (its flag when it has one)
    refuses: Callable[[Choice], bool]
    why: str  # formatted with the choice's fields


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
        lambda c: c.engine == "fsdp2" and (c.tp > 1 or c.sp > 1 or c.pp > 1),
        "--engine fsdp2 with --tp/--sp/--pp: llmtrain's tensor, sequence and pipeline parallelism run on "
        "DeepSpeed; use --engine deepspeed, or FSDP2 with data parallelism only",
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
