"""The mesh: every process group of a run's layout, built once per process from `layout.Layout`.

Named groups, each the ranks that differ only along some axes (rank order as Layout's: tp innermost,
pp outermost): `tensor` (tp), `sequence` (sp), `data` (dp: the ranks that see distinct samples),
`zero` (dp x sp: the ranks ZeRO shards over), `pipeline` (pp) and `model` (pp x tp: the ranks that hold
distinct parts of one replica, over which a gradient norm is summed). DeepSpeed gets the mesh as its
`mpu` (the Megatron interface it reads: data, model and tensor groups, ranks and sizes, and the
sequence and sequence-data groups of its Ulysses support: ZeRO shards and reduces over the `zero` group
and divides by dp only, so the sp ranks' partial gradients add up); the model's tensor-parallel layers
take its tensor group, Ulysses' attention its sequence group. Every rank creates every group, in the
same order, as torch.distributed requires.
"""

from __future__ import annotations

from typing import Any

from llmtrain.planning.layout import Layout

GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tensor": ("tp",),
    "sequence": ("sp",),
    "data": ("dp",),
    "zero": ("dp", "sp"),
    "pipeline": ("pp",),
    "model": ("pp", "tp"),
}


def describe(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of every kind by rank, as a mesh of `layout` builds them (environment.json keeps it)."""
    return {name: layout.groups_along(axes) for name, axes in GROUP_AXES.items()}


class Mesh:
    """This rank's view of the layout's groups; the methods named get_* are DeepSpeed's mpu interface."""

    def __init__(self, layout: Layout, rank: int, groups: dict[str, Any], ranks: dict[str, list[int]]):
        self.layout, self.rank = layout, rank
        self._groups, self._ranks = groups, ranks
        self._tensor_subgroups: dict[int, Any] = {}

    @classmethod
    def build(cls, layout: Layout, rank: int) -> Mesh:
        import torch.distributed as dist

        groups: dict[str, Any] = {}
        ranks: dict[str, list[int]] = {}
        for name, axes in GROUP_AXES.items():
            for members in layout.groups_along(axes):
                group = dist.new_group(members)  # collective: every rank, every group, this order
                if rank in members:
                    groups[name], ranks[name] = group, members
        return cls(layout, rank, groups, ranks)

    def _index(self, name: str) -> int:
        return self._ranks[name].index(self.rank)

    def tensor_subgroup(self, size: int) -> Any:
        """This rank's group of `size` consecutive ranks of its tensor group: the replicas of one key/value
        head when tp exceeds the heads (planning.partition). Built on first use, by every rank alike
        (every rank shards its model, in the same order)."""
        import torch.distributed as dist

        if size not in self._tensor_subgroups:
            for members in self.layout.groups_along(("tp",)):
                for start in range(0, len(members), size):
                    part = members[start : start + size]
                    group = dist.new_group(part)  # collective: every rank, every group, this order
                    if self.rank in part:
                        self._tensor_subgroups[size] = group
        return self._tensor_subgroups[size]

    # ------------------------------------------------------------ DeepSpeed's mpu interface

    def get_data_parallel_group(self) -> Any:
        return self._groups["data"]

    def get_data_parallel_rank(self) -> int:
        return self._index("data")

    def get_data_parallel_world_size(self) -> int:
        return len(self._ranks["data"])

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._ranks["data"]

    def get_model_parallel_group(self) -> Any:
        return self._groups["model"]

    def get_model_parallel_rank(self) -> int:
        return self._index("model")

    def get_model_parallel_world_size(self) -> int:
        return len(self._ranks["model"])

    def get_tensor_model_parallel_group(self) -> Any:
        return self._groups["tensor"]

    def get_tensor_model_parallel_rank(self) -> int:
        return self._index("tensor")

    def get_tensor_model_parallel_world_size(self) -> int:
        return len(self._ranks["tensor"])

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ranks["tensor"][0]

    def get_sequence_parallel_group(self) -> Any:
        return self._groups["sequence"]

    def get_sequence_parallel_rank(self) -> int:
        return self._index("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return len(self._ranks["sequence"])

    def get_sequence_data_parallel_group(self) -> Any:
        return self._groups["zero"]

    def get_sequence_data_parallel_rank(self) -> int:
        return self._index("zero")

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self._ranks["zero"])

    def get_pipeline_model_parallel_group(self) -> Any:
        return self._groups["pipeline"]

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._index("pipeline")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return len(self._ranks["pipeline"])


def process_groups(layout: Layout) -> Mesh | None:
    """The `mpu` object `deepspeed.initialize` takes for this layout: the mesh, or None for data
    parallelism alone."""
    import torch.distributed as dist

    if layout.model_parallel == 1:
        return None
    _adopt_process_group()
    return Mesh.build(layout, dist.get_rank())


def _adopt_process_group() -> None:
    """DeepSpeed's communication layer over torch's process group, when it was made without
    `deepspeed.init_distributed` (DeepSpeed's engine and group builders go through that layer)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed import comm

    if not comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())
