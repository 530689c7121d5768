"""ZeRO 3's and FSDP2's collectives in one step as volumes: what each moves (its whole tensor), how
often, over which group. The time model prices them (planning.timing); a run's measured `comm_bytes`
(parallel.traffic) is held against them. Torch-free, like the rest of the planning layer.

DeepSpeed's ZeRO 3 (0.19, once the first step has recorded the order its modules run in) gathers
every weight for each micro-batch's forward and reduce-scatters each micro-batch's gradients over the
ZeRO group. After a module's forward it frees the weights only when the weights used until their
reuse in backward (the rest of the forward, then the backward back to them) reach
stage3_max_reuse_distance elements (PartitionedParameterCoordinator.__params_to_release); those are
gathered again for backward, the rest stay gathered. After backward every weight is freed: the next
micro-batch gathers again. So a model smaller than the distance (llmtrain's default is 1e9 elements)
gathers once per micro-batch, and a 7B model re-gathers all but its last blocks.

Under ZeRO++ hpZ, freeing a weight leaves a copy partitioned within the node (until the step:
stage3.invalidate_secondary_tensor), which every later gather of the step reads inside the node: only
the first micro-batch's forward gathers over the ZeRO group.

FSDP2 as llmtrain runs it (engine.fsdp2: a unit per block and the root, gradients synchronised on a
step's last micro-batch) gathers every unit for each micro-batch's forward and, at --zero 3 (reshard
after forward), again for its backward, and reduce-scatters the gradients once a step in fp32 (its
reduce dtype). Under HSDP (a replicate x shard mesh) all of that runs over the shard group, a node's
ranks by default, and only an all-reduce of each rank's fp32 gradient shard crosses the replica group.
Measured on the loopback cluster (bench/results/traffic.json).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.planning.memory.setup import Setup, parameter_tensors

# The groups a collective runs over: ZeRO's (the dp x sp ranks), hpZ's partition group (a node's ranks),
# FSDP2's shard group (consecutive data-parallel ranks) and its replica group (one of each shard group).
ZERO_GROUP, NODE_GROUP, SHARD_GROUP, REPLICA_GROUP = "zero", "node", "shard", "replica"
FP32 = 4


@dataclass(frozen=True)
class Collective:
    kind: str  # all-gather, reduce-scatter, all-reduce
    nbytes: int  # the whole tensor: an all-gather's output, a reduce-scatter's input, an all-reduce's
    count: int  # per step
    group: str  # one of the groups above


def group_ranks(setup: Setup, group: str) -> list[int]:
    """The first group of its kind, by rank (the others are alike, shifted)."""
    if group == ZERO_GROUP:
        return setup.layout.groups_along(("dp", "sp"))[0]
    if group == NODE_GROUP:
        return list(range(setup.hpz_ranks))
    # FSDP2's data-parallel index d is rank d * tp (tp innermost; no sp or pp).
    shard, tp = setup.fsdp_shard_ranks, setup.layout.tp
    data_ranks = range(shard) if group == SHARD_GROUP else range(0, setup.layout.dp, shard)
    return [d * tp for d in data_ranks]


def backward_gathered_elements(setup: Setup) -> int:
    """Elements ZeRO 3 gathers again for each backward: the weights it freed after their forward, those
    whose reuse distance (twice the weights used after them in forward) reaches the configured maximum;
    all of them for a bare --params (no shape to walk). Small weights it keeps whole are never freed."""
    if not setup.shape_known:
        return setup.rank_params
    limit = setup.zero["stage3_max_reuse_distance"]
    persistent = setup.zero["stage3_param_persistence_threshold"]
    regathered = used_after = 0
    for numel in reversed(parameter_tensors(setup.cfg.model, setup.layout.tp)):  # the forward's order
        if numel > persistent and 2 * used_after >= limit:
            regathered += numel
        used_after += numel
    return regathered


def zero3_collectives(setup: Setup) -> list[Collective]:
    """One step's weight gathers and gradient reduce-scatters under ZeRO 3 (flat or hpZ)."""
    m, lp = setup.accumulation_steps, setup.lp_bytes
    weights = setup.rank_params * lp
    again = backward_gathered_elements(setup) * lp
    # Gradients are reduced in the model dtype (DeepSpeed's communication_data_type).
    reduce_scatter = Collective("reduce-scatter", weights, m, ZERO_GROUP)
    if setup.hpz_ranks <= 1:
        gathers = [
            Collective("all-gather", weights, m, ZERO_GROUP),
            Collective("all-gather", again, m, ZERO_GROUP),
        ]
        return [*gathers, reduce_scatter]
    return [
        Collective("all-gather", weights, 1, ZERO_GROUP),
        Collective("all-gather", weights, m - 1, NODE_GROUP),
        Collective("all-gather", again, m, NODE_GROUP),
        reduce_scatter,
    ]


def fsdp2_collectives(setup: Setup) -> list[Collective]:
    """One step's unit gathers and its gradient reduce-scatter under FSDP2 (--zero 2 or 3), over the
    shard group; under HSDP the reduced shards are then all-reduced over the replica group."""
    m = setup.accumulation_steps
    gathers = m * (2 if setup.stage == 3 else 1)
    found = [
        Collective("all-gather", setup.rank_params * setup.lp_bytes, gathers, SHARD_GROUP),
        Collective("reduce-scatter", setup.rank_params * FP32, 1, SHARD_GROUP),
    ]
    if setup.fsdp_shard_ranks < setup.layout.dp:
        shard_bytes = -(-setup.rank_params // setup.fsdp_shard_ranks) * FP32
        found.append(Collective("all-reduce", shard_bytes, 1, REPLICA_GROUP))
    return found


def sharding_collectives(setup: Setup) -> list[Collective] | None:
    """The collectives that shard the weights (FSDP2, ZeRO 3); None for the other stages."""
    if setup.engine == "fsdp2":
        return fsdp2_collectives(setup)
    return zero3_collectives(setup) if setup.stage == 3 else None


def bytes_by_span(setup: Setup, ranks_per_node: int) -> dict[str, int]:
    """One step's sharding volumes by where their group lies, in parallel.traffic's keys (its nodes:
    rank // ranks_per_node)."""
    found = sharding_collectives(setup)
    if found is None:
        raise ValueError(f"no sharding collectives modelled for ZeRO {setup.stage} on {setup.engine}")
    out = {"inside_node": 0, "across_nodes": 0}
    for c in found:
        across = len({rank // ranks_per_node for rank in group_ranks(setup, c.group)}) > 1
        out["across_nodes" if across else "inside_node"] += c.nbytes * c.count
    return out
