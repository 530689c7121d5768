"""Which layouts fit: every (tp, sp, pp, stage, offload, checkpointing) that composes, with its largest
micro-batch.

The combinations come from llmtrain.planning.rules, the one table of what composes, and the degrees from
llmtrain.planning.layout's checks against the model, so the search never proposes a layout that
`llmtrain train` would refuse. It searches the setup's engine only (FSDP2: ZeRO 2 or 3, offload none or
cpu, data parallelism alone).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llmtrain.config import check_layout
from llmtrain.errors import ConfigError
from llmtrain.planning import rules
from llmtrain.planning.layout import Layout
from llmtrain.planning.memory.formulas import estimate
from llmtrain.planning.memory.setup import Setup

# The fit search estimates layouts for GPUs: rules about other accelerators do not apply.
ACCELERATOR = "cuda"


@dataclass(frozen=True)
class Candidate:
    stage: int
    offload: str
    micro_batch: int
    checkpointing: str
    gpu_bytes: int
    cpu_bytes: int  # per node
    tp: int
    sp: int
    layout: str  # Layout.describe(): "dp 4 x tp 2"
    pp: int = 1
    bubble: float = 0.0  # the pipeline's idle share of each step at the setup's global batch
    engine: str = "deepspeed"


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}


def _model_parallel_rank(c: Candidate) -> tuple[int, int]:
    """None, then sp, then tp, each lower degree first. Both communicate inside every layer, on the
    critical path of forward and backward (ZeRO's collectives overlap with compute). Ulysses' all-to-alls
    carry 1/sp of a layer's activations per rank and leave the matmuls whole; tp's two all-reduces per
    layer and pass carry whole activations whatever tp is, and make each rank's matmuls tp times thinner.
    A pipeline ranks as none here: its stages exchange one activation per micro-batch, not per layer."""
    kind = 0 if c.tp == c.sp == 1 else 1 if c.tp == 1 else 2
    return kind, c.tp * c.sp


def speed_key(c: Candidate) -> tuple[int, int, int, int, float, int, int]:
    """Fastest first: less offload (PCIe/NVMe traffic every step dominates), then less model parallelism
    (see _model_parallel_rank: per-layer communication that does not overlap costs more than the ~1/3
    extra forward of full recomputation on a model that would fit without it), then less recomputation,
    then no pipeline before a pipeline, smaller bubble first (its stages idle (pp - 1) / (m + pp - 1) of
    every step, more than any ZeRO stage's collectives cost), then a lower stage (fewer collectives),
    then a larger micro-batch (better GPU utilisation)."""
    return (
        rules.offload_rank(c.offload),
        *_model_parallel_rank(c),
        _RECOMPUTE_RANK[c.checkpointing],
        c.bubble,
        c.stage,
        -c.micro_batch,
    )


def degrees(setup: Setup) -> list[tuple[int, int, int]]:
    """(tp, sp, pp) degrees to search: tp and sp whose product divides the GPUs of one node (they talk in
    every layer, so their ranks stay on a node's links: the rank order puts tp innermost), and
    pipelines of every divisor of the world size (a stage boundary carries little, so stages may span
    nodes), alone or with tp inside a node (rules refuse pp with sp), all that config.check_layout
    accepts for the model and sequence length (a pipeline has at least one block per stage). A bare
    --params has no shape to split: only its own layout."""
    if not setup.shape_known:
        return [(setup.layout.tp, setup.layout.sp, setup.layout.pp)]
    gpus, world = setup.cfg.launch.gpus, setup.world_size
    on_node = [n for n in range(1, gpus + 1) if gpus % n == 0]
    found = [(tp, sp, 1) for tp, sp in itertools.product(on_node, on_node) if gpus % (tp * sp) == 0]
    pipelines = [pp for pp in range(2, world + 1) if world % pp == 0]
    found += [(tp, 1, pp) for pp in pipelines for tp in on_node if world % (tp * pp) == 0]
    return [d for d in found if _splits(setup, *d)]


def _splits(setup: Setup, tp: int, sp: int, pp: int) -> bool:
    try:
        check_layout(setup.cfg, Layout(setup.world_size, tp, sp, pp))
    except ConfigError:
        return False
    return True


def fitting(setup: Setup, gpu_memory: int, cpu_memory: int | None = None) -> list[Candidate]:
    """Every (tp, sp, pp, stage, offload, checkpointing) that fits, each with the largest micro-batch up
    to the one asked for (powers of two), fastest first (see speed_key)."""
    batches = sorted(
        {2**i for i in range(setup.cfg.train.micro_batch.bit_length())} | {setup.cfg.train.micro_batch}
    )
    modes = (
        ("none", "selective", "full") if setup.shape_known else (setup.cfg.train.activation_checkpointing,)
    )
    found: list[Candidate] = []
    for tp, sp, pp in degrees(setup):
        sizes = _pipeline_batches(setup, pp, batches)
        for choice in rules.combinations(setup.precision, ACCELERATOR, tp, sp, pp, setup.engine):
            for mode in modes:
                best = _largest_fitting(setup, choice, mode, sizes, gpu_memory, cpu_memory)
                if best is not None:
                    found.append(best)
    return sorted(found, key=speed_key)


def _pipeline_batches(setup: Setup, pp: int, batches: list[int]) -> list[int]:
    """The micro-batches a pipeline of `pp` stages can run the setup's global batch with: a whole number
    of them per data-parallel rank (with_choice keeps the global batch for a pipeline)."""
    if pp == 1:
        return batches
    dp = setup.world_size // pp
    return [micro for micro in batches if setup.cfg.global_batch % (micro * dp) == 0]


def _largest_fitting(
    setup: Setup,
    choice: rules.Choice,
    mode: str,
    batches: list[int],
    gpu_memory: int,
    cpu_memory: int | None,
) -> Candidate | None:
    # The user's hpZ stays on wherever it composes (ZeRO 3 without NVMe, tp or sp): it costs memory.
    hpz = setup.cfg.zero.shard_within_node and rules.composes_with_hpz(choice, setup.cfg.launch.nodes)
    for micro in reversed(batches):
        layout = (choice.tp, choice.sp, choice.pp)
        est = estimate(
            setup.with_choice(choice.stage, choice.offload, micro, mode, *layout, shard_within_node=hpz)
        )
        if est.gpu_peak <= gpu_memory and (cpu_memory is None or est.cpu_per_node <= cpu_memory):
            lay = est.setup.layout
            return Candidate(
                choice.stage,
                choice.offload,
                micro,
                mode,
                est.gpu_peak,
                est.cpu_per_node,
                lay.tp,
                lay.sp,
                lay.describe(),
                lay.pp,
                est.setup.bubble,
                setup.engine,
            )
    return None
