"""llmtrain's own tensor parallelism: the model's column- and row-parallel projections over the mesh's
tensor group (the split itself is planning.partition's table).

Every rank builds the whole model from the same seed (or loads the same source weights), then keeps its
slice of each split weight, so a tensor-parallel run starts from exactly the one-process weights. In the
forward pass a block's input enters the tp region unchanged (`enter`: the gradient flowing back out of it
is the sum of every rank's part) and the row-parallel output leaves it summed over the ranks (`leave`).
The embedding holds V / tp token rows per rank: each rank looks up the ids it holds and the rows are
summed over the ranks (`embed`); the output layer's vocab-parallel loss is llmtrain.loss's.
Split weights carry DeepSpeed's `tensor_model_parallel` mark: its ZeRO optimizers then count each rank's
slices in the gradient norm and replicated weights once. With more tp ranks than key/value heads, the
ranks holding copies of one head (planning.partition's rule) sum its gradients (`replicated_projection`),
and only the first copy carries the mark, so the norm counts each head once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from llmtrain.planning.partition import is_kv_projection, kv_replicas, tp_split_dim

if TYPE_CHECKING:
    from llmtrain.parallel.mesh import Mesh


class _Enter(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the group: the tp group (Megatron's f),
    or the copies of a key/value head (`replicated_projection`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Leave(torch.autograd.Function):
    """Sum over the tp group forward (the row-parallel partial outputs); identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def local(weight: Tensor) -> Tensor:
    """This rank's part of a DTensor parameter (FSDP2 + tp: parallel.dtensor_tp), differentiably (its
    gradient flows back to the DTensor); any other tensor as it is."""
    to_local = getattr(weight, "to_local", None)
    return weight if to_local is None else to_local()


def enter(x: Tensor, group: Any) -> Tensor:
    """`x` as the input of column-parallel projections (no-op without a tp group)."""
    return x if group is None else _Enter.apply(x, group)


def leave(x: Tensor, group: Any) -> Tensor:
    """A row-parallel projection's partial output summed over the tp ranks (no-op without a tp group)."""
    return x if group is None else _Leave.apply(x, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def replicated_projection(linear: nn.Module, x: Tensor, group: Any) -> Tensor:
    """`linear(x)` where the ranks of `group` hold equal copies of the weight (one key/value head), each
    for its own query heads. The output's gradient is summed over the copies, so every copy's weight
    gradient is the whole head's and the copies stay equal; the input's gradient is divided by the
    copies, so the tp group's sum (`enter`) counts the head once. Without a group, `linear(x)`."""
    if group is None:
        return linear(x)
    copies = dist.get_world_size(group)
    return enter(linear(_ScaleGrad.apply(x, 1.0 / copies)), group)  # enter: the gradient summed over `group`


class _GatherLastDim(torch.autograd.Function):
    """The tp ranks' slices concatenated along the last dim, in rank order; backward keeps this rank's
    slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def gather_last_dim(x: Tensor, group: Any) -> Tensor:
    """Vocabulary-parallel logits [..., V / tp] -> the whole [..., V] (no-op without a tp group)."""
    return x if group is None else _GatherLastDim.apply(x, group)


def shard_over(model: nn.Module, mesh: Mesh, kv_heads: int) -> None:
    """`shard` over the mesh's tensor group, with the groups of key/value head copies when tp exceeds
    `kv_heads`."""
    copies = kv_replicas(kv_heads, mesh.layout.tp)
    kv_group = mesh.tensor_subgroup(copies) if copies > 1 else None
    shard(model, mesh.get_tensor_model_parallel_group(), kv_group)


def shard(model: nn.Module, group: Any, kv_group: Any = None) -> None:
    """Keep this rank's slice of every weight planning.partition splits, and route the blocks' attention
    and MLP, the embedding and the output layer through the tp group. `model` is whole and identical on
    every rank of `group`; a tied output layer is tied again to the embedding's slice. `kv_group`: this
    rank's copies of one key/value head (consecutive tp ranks), when tp exceeds the heads."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    copies = 1 if kv_group is None else dist.get_world_size(kv_group)
    modules = dict(model.named_modules())
    for name in [name for name, _ in model.named_parameters()]:
        dim = tp_split_dim(name)
        if dim is None:
            continue
        owner = modules[name.rsplit(".", 1)[0]]
        assert isinstance(owner, nn.Linear | nn.Embedding)
        if copies > 1 and is_kv_projection(name):
            # One head per rank, the one its query heads read; only its first copy is counted in the norm.
            _keep_slice(owner, dim, size // copies, rank // copies, counted=rank % copies == 0)
        else:
            _keep_slice(owner, dim, size, rank)
    for module in model.modules():
        if hasattr(module, "tp_group"):
            module.tp_group = group
        if hasattr(module, "kv_group"):
            module.kv_group = kv_group
    # model.Llama's tie (a pipeline's tied weight is DeepSpeed's, sliced on both stages alike)
    if getattr(getattr(model, "cfg", None), "tie_word_embeddings", False):
        model.tie_weights()  # type: ignore[operator]


def _keep_slice(
    owner: nn.Linear | nn.Embedding, dim: int, size: int, rank: int, counted: bool = True
) -> None:
    """Keep slice `rank` of `size` along `dim`. `counted`: DeepSpeed's mark, under which every rank's
    slice counts in the gradient norm (unmarked, only the first model-parallel rank's does)."""
    whole = owner.weight.detach()
    if whole.shape[dim] % size:
        raise ValueError(f"a weight of shape {tuple(whole.shape)} does not split into {size} along dim {dim}")
    part = nn.Parameter(whole.chunk(size, dim)[rank].clone(), requires_grad=owner.weight.requires_grad)
    part.tensor_model_parallel = counted  # type: ignore[attr-defined]  # DeepSpeed's mark (runtime.utils)
    part.partition_dim = dim  # type: ignore[attr-defined]
    owner.weight = part
    if isinstance(owner, nn.Linear):
        owner.out_features, owner.in_features = part.shape
    else:
        owner.num_embeddings = part.shape[0]


def embed(ids: Tensor, weight: Tensor, group: Any) -> Tensor:
    """Vocabulary-parallel embedding lookup: this rank's rows `weight` [V / tp, D] (in rank order) give
    the ids it holds, zeros for the rest, summed over the tp ranks. Without a group, a plain lookup."""
    if group is None:
        return F.embedding(ids, weight)
    start = dist.get_rank(group) * weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight)
    return leave(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)
