"""`llmtrain plan`: every layout that composes and fits, ranked by predicted tokens/s.

The layouts are the fit search's (planning.memory.fit.degrees: tp and sp inside a node, pipelines of every
divisor, planning.rules' stage/offload combinations), on both engines, each with every checkpointing
mode and every micro-batch that divides the global batch; the memory model keeps those that fit the
cluster's devices and the time model ranks them. The global batch and sequence length stay the
request's, so every row trains the same tokens per step. Flags the user gave pin their part of the
layout (`--zero 3` searches ZeRO 3 only). On several nodes ZeRO 3 is also tried with hpZ
(--shard-within-node), whose gathers after the first of a step stay inside each node, and FSDP2 both as
HSDP (sharded within each node, its default there) and sharded over all data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from llmtrain.errors import ConfigError
from llmtrain.planning import rules
from llmtrain.planning.hardware import Cluster
from llmtrain.planning.layout import Layout, fsdp_mesh
from llmtrain.planning.memory.fit import degrees
from llmtrain.planning.memory.formulas import Estimate, estimate
from llmtrain.planning.memory.setup import Setup
from llmtrain.planning.timing import StepTime, step_time

ENGINES = ("deepspeed", "fsdp2")
CHECKPOINTING = ("none", "selective", "full")
# The config keys a plan chooses, unless the user pinned them.
LAYOUT_KEYS = (
    "train.engine",
    "zero.stage",
    "zero.offload",
    "parallel.tp",
    "parallel.sp",
    "parallel.pp",
    "train.micro_batch",
    "train.activation_checkpointing",
    "zero.shard_within_node",
    "parallel.dp_shard",
)


@dataclass(frozen=True)
class PlanRow:
    estimate: Estimate
    time: StepTime

    @property
    def setup(self) -> Setup:
        return self.estimate.setup


def plan(setup: Setup, cluster: Cluster, pinned: dict[str, object]) -> list[PlanRow]:
    """Every layout of `setup`'s model, global batch and sequence length on `cluster` that fits its
    devices' memory, fastest first, each at its fastest micro-batch. `pinned` maps LAYOUT_KEYS the user
    set to their values."""
    rows = [row for layout in _layouts(setup, pinned) if (row := _fastest(layout, cluster)) is not None]
    return sorted(rows, key=_rank)


def _rank(row: PlanRow) -> tuple[float, int, int, int, int]:
    """Fastest first; at equal speed the default engine, less offload, the lower stage, less memory."""
    c = row.setup.cfg
    return (
        round(row.time.seconds, 9),
        ENGINES.index(c.train.engine),
        rules.offload_rank(c.zero.offload),
        c.zero.stage,
        row.estimate.gpu_peak,
    )


def _fastest(layouts: list[Setup], cluster: Cluster) -> PlanRow | None:
    """The fastest of one layout's micro-batch sizes (largest first) that fits. Without a pipeline the
    largest that fits is the fastest (fewer, larger micro-batches: fuller matmuls, fewer ZeRO-3
    gathers); a pipeline trades it against the bubble, which more micro-batches shrink. Memory grows
    with the micro-batch, so a layout whose smallest does not fit is passed over at once."""
    if not layouts:
        return None
    smallest = estimate(layouts[-1])
    if smallest.gpu_peak > cluster.device.memory_bytes:
        return None
    best: PlanRow | None = None
    for candidate in layouts:
        est = smallest if candidate is layouts[-1] else estimate(candidate)
        if est.gpu_peak > cluster.device.memory_bytes:
            continue
        row = PlanRow(est, step_time(candidate, cluster))
        if best is None or row.time.seconds < best.time.seconds:
            best = row
        if candidate.layout.pp == 1:
            break
    return best


def _layouts(setup: Setup, pinned: dict[str, object]) -> Iterator[list[Setup]]:
    """Each layout the rules allow and the pins admit, as its micro-batch sizes, largest first."""
    for engine in _pinned(pinned, "train.engine", ENGINES):
        base = setup.with_choice(setup.stage, setup.offload, setup.cfg.train.micro_batch,
                                 setup.cfg.train.activation_checkpointing, 1, 1, 1, engine=engine,
                                 keep_batch=True)  # fmt: skip
        for tp, sp, pp in degrees(base):
            if not _allowed(pinned, {"parallel.tp": tp, "parallel.sp": sp, "parallel.pp": pp}):
                continue
            for choice in _choices(setup, tp, sp, pp, engine, pinned):
                for mode in _pinned(pinned, "train.activation_checkpointing", CHECKPOINTING):
                    yield [
                        setup.with_choice(
                            choice.stage,
                            choice.offload,
                            micro,
                            mode,
                            tp,
                            sp,
                            pp,
                            engine=engine,
                            keep_batch=True,
                            shard_within_node=choice.zero_plus.shard_within_node,
                            dp_shard=choice.dp_shard,
                        )
                        for micro in reversed(_micro_batches(setup, tp, sp, pp, pinned))
                    ]


def _choices(
    setup: Setup, tp: int, sp: int, pp: int, engine: str, pinned: dict[str, object]
) -> Iterator[rules.Choice]:
    """The stage and offload combinations the rules allow and the pins admit, each also with ZeRO++ hpZ
    where it composes (ZeRO 3 on several nodes), and on FSDP2 with each shard group (_shard_groups)."""
    for choice in rules.combinations(setup.precision, "cuda", tp, sp, pp, engine):
        if not _allowed(pinned, {"zero.stage": choice.stage, "zero.offload": choice.offload}):
            continue
        hpz_options = (False, True) if rules.composes_with_hpz(choice, setup.cfg.launch.nodes) else (False,)
        for hpz in hpz_options:
            if _allowed(pinned, {"zero.shard_within_node": hpz}):
                for dp_shard in _shard_groups(setup, Layout(setup.world_size, tp, sp, pp), engine, pinned):
                    yield replace(choice, zero_plus=rules.ZeroPlus(shard_within_node=hpz), dp_shard=dp_shard)


def _shard_groups(
    setup: Setup, layout: Layout, engine: str, pinned: dict[str, object]
) -> tuple[int | None, ...]:
    """FSDP2's shard groups to try: the pinned one; its default (on several nodes a node's ranks: HSDP)
    and, where that is not all of them, all data-parallel ranks (their gathers cross nodes, but each
    rank holds 1/dp of the states)."""
    if engine != "fsdp2":
        return (None,)
    if "parallel.dp_shard" in pinned:
        return (int(str(pinned["parallel.dp_shard"])),)
    default = fsdp_mesh(layout, None, setup.cfg.launch.gpus)["shard"]
    return (None,) if default == layout.dp else (None, layout.dp)


def _pinned(pinned: dict[str, object], key: str, values: tuple[str, ...]) -> tuple[str, ...]:
    return (str(pinned[key]),) if key in pinned else values


def _allowed(pinned: dict[str, object], values: dict[str, object]) -> bool:
    return all(key not in pinned or pinned[key] == value for key, value in values.items())


def _micro_batches(setup: Setup, tp: int, sp: int, pp: int, pinned: dict[str, object]) -> list[int]:
    """Micro-batches that run the global batch as a whole number of them per data-parallel rank."""
    dp = setup.world_size // (tp * sp * pp)
    total = setup.cfg.global_batch
    if "train.micro_batch" in pinned:
        sizes = [int(str(pinned["train.micro_batch"]))]
    else:
        sizes = [2**i for i in range(total.bit_length())]
    return [micro for micro in sizes if total % (micro * dp) == 0]


def smallest_change(setup: Setup, cluster: Cluster, pinned: dict[str, object]) -> str:
    """What would make something fit when nothing does, as the flags to change: more nodes, then a
    shorter sequence, tried in that order, each as small a step as fits."""
    for factor in (2, 4, 8, 16, 32, 64):
        nodes = setup.cfg.launch.nodes * factor
        if setup.cfg.global_batch % nodes == 0 and plan(
            _resized(setup, nodes=nodes), cluster.with_size(nodes=nodes), pinned
        ):
            return f"--nodes {nodes} ({nodes * cluster.devices_per_node} GPUs)"
    seq = setup.cfg.train.seq_len
    while seq > 128:
        seq //= 2
        if plan(_resized(setup, seq_len=seq), cluster, pinned):
            return f"--seq-len {seq}"
    return "a larger device (--gpu) or a smaller model"


def _resized(setup: Setup, nodes: int | None = None, seq_len: int | None = None) -> Setup:
    import copy

    cfg = copy.deepcopy(setup.cfg)
    cfg.launch.nodes = nodes or cfg.launch.nodes
    cfg.train.seq_len = seq_len or cfg.train.seq_len
    cfg.train.global_batch = setup.cfg.global_batch
    return Setup(cfg, setup.params, setup.shape_known)


def check_request(setup: Setup, cluster: Cluster) -> None:
    """The cluster must hold the run's processes: --gpus per node at most the node's devices."""
    if setup.cfg.launch.gpus > cluster.devices_per_node:
        raise ConfigError(
            f"--gpus: {setup.cfg.launch.gpus} per node, but a {cluster.device.name} node has "
            f"{cluster.devices_per_node}; use --gpus {cluster.devices_per_node} or fewer"
        )
