"""The bytes of the collectives a rank takes part in, split by whether their group stays inside one node
or spans nodes: what a step costs the slow link (`comm_bytes` in metrics.jsonl).

`install` wraps torch.distributed's collectives once per process, before the process group exists:
DeepSpeed's backend keeps its own references to the all-gather and reduce-scatter functions from its
start, and FSDP2 and llmtrain call them through the module. A collective counts the bytes of its whole
tensor, as the planning layer's formulas do (an all-reduce's tensor, an all-gather's output, a
reduce-scatter's input, an all-to-all's or a send's input, a broadcast's tensor); the wire bytes of a
ring follow from it and the group's size. Nodes are numbered as the launchers number ranks, node by
node: rank // ranks per node.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

INSIDE, ACROSS = "inside_node", "across_nodes"

# name -> (position, keyword) of the argument whose tensor's bytes count, and the group's position.
_COUNTED: dict[str, tuple[int, str, int]] = {
    "all_reduce": (0, "tensor", 2),
    "broadcast": (0, "tensor", 2),
    "all_gather_into_tensor": (0, "output_tensor", 2),
    "all_gather_single": (0, "output_tensor", 2),  # torch 2.13's name, which FSDP2 calls
    "_all_gather_base": (0, "output_tensor", 2),
    "reduce_scatter_tensor": (1, "input", 3),
    "reduce_scatter_single": (1, "input", 3),
    "_reduce_scatter_base": (1, "input", 3),
    "all_to_all_single": (1, "input", 4),
    "all_gather": (1, "tensor", 2),  # each rank's input; the output is world x that
    "send": (0, "tensor", 2),
    "isend": (0, "tensor", 2),
}


class Traffic:
    """Bytes per span since the last `take`, for this process."""

    def __init__(self, ranks_per_node: int) -> None:
        self.ranks_per_node = max(1, ranks_per_node)
        self.bytes = {INSIDE: 0, ACROSS: 0}
        self.depth = 0  # collectives in progress (one calling another is counted once)
        self._span_of_group: dict[Any, str] = {}

    def count(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        position, keyword, group_position = _COUNTED[name]
        tensor = kwargs.get(keyword, args[position] if len(args) > position else None)
        if not isinstance(tensor, torch.Tensor):
            return
        group = kwargs.get("group", args[group_position] if len(args) > group_position else None)
        nbytes = tensor.numel() * tensor.element_size()
        if name == "all_gather":
            nbytes *= dist.get_world_size(group)
        self.bytes[self._span(group)] += nbytes

    def _span(self, group: Any) -> str:
        key = group if group is not None else "world"
        if key not in self._span_of_group:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            nodes = {rank // self.ranks_per_node for rank in ranks}
            self._span_of_group[key] = INSIDE if len(nodes) <= 1 else ACROSS
        return self._span_of_group[key]

    def take(self) -> dict[str, int]:
        """The bytes since the last call, by span; the counts start again from zero."""
        taken, self.bytes = self.bytes, {INSIDE: 0, ACROSS: 0}
        return taken


_installed: Traffic | None = None


def install(ranks_per_node: int) -> Traffic:
    """Count this process's collectives from now on (once per process; later calls return the same)."""
    global _installed
    if _installed is None:
        _installed = Traffic(ranks_per_node)
        for name in _COUNTED:
            for module in (dist, dist.distributed_c10d):
                original = getattr(module, name, None)
                if original is not None and not hasattr(original, "__llmtrain_counted__"):
                    setattr(module, name, _counting(original, name, _installed))
    return _installed


def installed() -> Traffic | None:
    return _installed


def _counting(original: Callable[..., Any], name: str, traffic: Traffic) -> Callable[..., Any]:
    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        # Outermost call only: torch's older names (_all_gather_base, ...) call the newer ones.
        if traffic.depth == 0:
            traffic.count(name, args, kwargs)
        traffic.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            traffic.depth -= 1

    counted.__llmtrain_counted__ = True  # type: ignore[attr-defined]
    return counted
