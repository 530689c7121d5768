"""Which layouts fit: every (tp, sp, stage, offload, checkpointing) that composes, with its largest
micro-batch.

The combinations come from llmtrain.parallel.rules, the one table of what composes, and the degrees from
llmtrain.parallel.layout's checks against the model, so the search never proposes a layout that
`llmtrain train` would refuse.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llmtrain.config import check_layout
from llmtrain.errors import ConfigError
from llmtrain.memory.formulas import Setup, estimate
from llmtrain.parallel import rules
from llmtrain.parallel.layout import Layout

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


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}


def _model_parallel_rank(c: Candidate) -> tuple[int, int]:
    """None, then sp, then tp, each lower degree first. Both communicate inside every layer, on the
    critical path of forward and backward (ZeRO's collectives overlap with compute). Ulysses' all-to-alls
    carry 1/sp of a layer's activations per rank and leave the matmuls whole; tp's two all-reduces per
    layer and pass carry whole activations whatever tp is, and make each rank's matmuls tp times thinner."""
    kind = 0 if c.tp == c.sp == 1 else 1 if c.tp == 1 else 2
    return kind, c.tp * c.sp


def speed_key(c: Candidate) -> tuple[int, int, int, int, int, int]:
    """Fastest first: less offload (PCIe/NVMe traffic every step dominates), then less model parallelism
    (see _model_parallel_rank: per-layer communication that does not overlap costs more than the ~1/3
    extra forward of full recomputation on a model that would fit without it), then less recomputation,
    then a lower stage (fewer collectives), then a larger micro-batch (better GPU utilisation)."""
    return (
        rules.offload_rank(c.offload),
        *_model_parallel_rank(c),
        _RECOMPUTE_RANK[c.checkpointing],
        c.stage,
        -c.micro_batch,
    )


def degrees(setup: Setup) -> list[tuple[int, int]]:
    """(tp, sp) pairs to search: degrees whose product divides the GPUs of one node (tp and sp talk in
    every layer, so their ranks stay on a node's links), that config.check_layout accepts for the model and
    sequence length. A bare --params has no shape to split: only its own layout."""
    if not setup.shape_known:
        return [(setup.layout.tp, setup.layout.sp)]
    gpus = setup.cfg.launch.gpus
    divisors = [n for n in range(1, gpus + 1) if gpus % n == 0]
    found = []
    for tp, sp in itertools.product(divisors, divisors):
        try:
            check_layout(setup.cfg, Layout(setup.world_size, tp, sp))
        except ConfigError:
            continue
        if gpus % (tp * sp) == 0:
            found.append((tp, sp))
    return found


def fitting(setup: Setup, gpu_memory: int, cpu_memory: int | None = None) -> list[Candidate]:
    """Every (tp, sp, stage, offload, checkpointing) that fits, each with the largest micro-batch up to
    the one asked for (powers of two), fastest first (see speed_key)."""
    batches = sorted(
        {2**i for i in range(setup.cfg.train.micro_batch.bit_length())} | {setup.cfg.train.micro_batch}
    )
    modes = (
        ("none", "selective", "full") if setup.shape_known else (setup.cfg.train.activation_checkpointing,)
    )
    found: list[Candidate] = []
    for tp, sp in degrees(setup):
        for choice in rules.combinations(setup.precision, ACCELERATOR, tp, sp):
            for mode in modes:
                best = _largest_fitting(setup, choice, mode, batches, gpu_memory, cpu_memory)
                if best is not None:
                    found.append(best)
    return sorted(found, key=speed_key)


def _largest_fitting(
    setup: Setup,
    choice: rules.Choice,
    mode: str,
    batches: list[int],
    gpu_memory: int,
    cpu_memory: int | None,
) -> Candidate | None:
    for micro in reversed(batches):
        est = estimate(setup.with_choice(choice.stage, choice.offload, micro, mode, choice.tp, choice.sp))
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
            )
    return None
