"""Tensor parallelism with DTensor, for the FSDP2 engine: planning.partition's split, applied as torch's
parallel styles over the device mesh's "tp" dimension, so that FSDP2 shards the tp shards again over
the data-parallel dimensions and DCP saves every weight as one global tensor (a resume on another tp
degree is DCP's resharding, no conversion).

- Column-split projections (q, k, v, gate, up) are `ColwiseParallel`, row-split ones (o, down)
  `RowwiseParallel`: a block's input enters replicated, its attention and MLP outputs leave summed over
  the tp ranks, as llmtrain's own layers do on DeepSpeed (parallel.tensor).
- The embedding and the output layer hold V / tp token rows each, as DTensors sharded on dim 0
  (`VocabParallel`); their forward hands the local rows and the tp group to llmtrain's vocabulary-parallel
  lookup and fused loss (parallel.tensor.embed, loss.output_layer), so no rank holds whole logits.
- The norms are DTensors replicated over tp (their modules read the local tensor: parallel.tensor.local):
  every rank computes them on the same replicated activations, so their gradients agree without a
  reduction, and with every parameter on one mesh the gradient norm counts each once.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from llmtrain.planning.partition import COLUMN, tp_split_dim


class VocabParallel(ParallelStyle):
    """An embedding or output layer split by vocabulary: its weight a DTensor of V / tp token rows per
    rank (Shard(0)), its `tp_group` the mesh's group, which llmtrain's vocabulary-parallel lookup and
    loss reduce over."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def rows(name: str, owner: nn.Module, mesh: Any) -> None:
            weight: Tensor = owner.get_parameter("weight")
            owner.register_parameter(
                "weight", nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]))
            )

        distribute_module(module, device_mesh, rows)
        module.tp_group = device_mesh.get_group()
        return module


def parallelize(model: nn.Module, tp_mesh: Any) -> None:
    """Split `model` (a whole llmtrain.model.Llama, identical on every tp rank) over `tp_mesh`."""
    styles: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        dim = tp_split_dim(f"{name}.weight")
        if dim is None:
            continue
        if isinstance(module, nn.Embedding) or name == "lm_head":
            styles[name] = VocabParallel()
        else:
            styles[name] = ColwiseParallel() if dim == COLUMN else RowwiseParallel()
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    if tied:
        del styles["lm_head"]  # the embedding's Parameter: split once, tied again below
    parallelize_module(model, tp_mesh, styles)
    for module in model.modules():
        for key, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                module.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
    if tied:
        model.tie_weights()  # type: ignore[operator]
