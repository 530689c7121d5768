"""Which layouts fit: every (stage, offload, checkpointing) that composes, with its largest micro-batch.

The combinations come from llmtrain.parallel.rules, the one table of what composes, so the search never
proposes a layout that `llmtrain train` would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.memory.formulas import Setup, estimate
from llmtrain.parallel import rules

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


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}


def speed_key(c: Candidate) -> tuple[int, int, int, int]:
    """Fastest first: less offload (PCIe/NVMe traffic every step dominates), then less recomputation
    (full costs about one extra forward), then a lower stage (fewer collectives), then a larger
    micro-batch (better GPU utilisation)."""
    return (rules.offload_rank(c.offload), _RECOMPUTE_RANK[c.checkpointing], c.stage, -c.micro_batch)


def fitting(setup: Setup, gpu_memory: int, cpu_memory: int | None = None) -> list[Candidate]:
    """Every (stage, offload, checkpointing) that fits, each with the largest micro-batch up to the one
    asked for (powers of two), fastest first (see speed_key)."""
    batches = sorted(
        {2**i for i in range(setup.cfg.train.micro_batch.bit_length())} | {setup.cfg.train.micro_batch}
    )
    modes = (
        ("none", "selective", "full") if setup.shape_known else (setup.cfg.train.activation_checkpointing,)
    )
    found: list[Candidate] = []
    for choice in rules.combinations(setup.precision, ACCELERATOR):
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
        est = estimate(setup.with_choice(choice.stage, choice.offload, micro, mode))
        if est.gpu_peak <= gpu_memory and (cpu_memory is None or est.cpu_per_node <= cpu_memory):
            return Candidate(choice.stage, choice.offload, micro, mode, est.gpu_peak, est.cpu_per_node)
    return None
