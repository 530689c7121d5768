"""parallel.traffic counts each collective once, by its whole tensor, on the side of the node boundary
its group lies: two gloo processes taken as two nodes of one rank (the world group spans nodes) and as
one node of two (it stays inside). About 10 s."""

from __future__ import annotations

from typing import Any

from dist import run_distributed

ELEMENTS = 1024  # fp32: 4 KiB per tensor


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from llmtrain.parallel import traffic

    out: dict[str, Any] = {}
    # The process group exists already (dist.py), so each case counts with its own Traffic, installed
    # as install() does; an installed process keeps the first (what a run does).
    for ranks_per_node in (1, 2):
        counter = traffic.install(ranks_per_node)
        counter.ranks_per_node, counter._span_of_group = ranks_per_node, {}
        counter.take()
        x = torch.ones(ELEMENTS)
        dist.all_reduce(x)
        gathered = torch.empty(ELEMENTS * world_size)
        dist.all_gather_into_tensor(gathered, x)
        dist.distributed_c10d._all_gather_base(gathered, x)  # an older name that calls the newer one
        dist.reduce_scatter_tensor(x, gathered)
        dist.broadcast(x, src=0)
        out[str(ranks_per_node)] = counter.take()
    return out


def test_each_collective_counts_its_whole_tensor_once_by_where_its_group_lies() -> None:
    ranks = run_distributed(_collectives, 2)
    tensor = ELEMENTS * 4
    # all-reduce and broadcast: the tensor; two all-gathers: their output; the reduce-scatter: its input.
    expected = tensor + 2 * 2 * tensor + 2 * tensor + tensor
    for counted in ranks:
        assert counted["1"] == {"inside_node": 0, "across_nodes": expected}
        assert counted["2"] == {"inside_node": expected, "across_nodes": 0}
