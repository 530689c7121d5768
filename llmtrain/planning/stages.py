"""Which layers each pipeline stage holds: one function for the engine and the memory estimator.

A pipeline runs the model as a sequence of layers: the embedding, the transformer blocks, the final
norm and the output layer (`PIPELINE_LAYERS`). `stage_bounds` cuts that sequence into `pp`
consecutive stages, either balanced by parameters (the embedding and output layer weigh as much as
several blocks when the vocabulary is large) or with the same number of blocks per stage. The engine's
PipelineModule and `estimate-memory --pp` both call it, so the estimate is of the stages that run.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.planning.partition import ModelShape, block_parameters

EMBED, NORM, HEAD = "embed", "norm", "head"


@dataclass(frozen=True)
class PipelineLayer:
    kind: str  # embed, block, norm or head
    parameters: int  # elements this layer holds on its stage (a tied output layer holds the embedding)


def pipeline_layers(model: ModelShape) -> list[PipelineLayer]:
    """The model as the pipeline runs it: embedding, blocks, final norm, output layer.

    With tied embeddings the output layer is a copy of the embedding on the last stage (DeepSpeed's
    TiedLayerSpec: the copies' gradients are summed every step), so it weighs as much as an untied one.
    """
    embedding = model.vocab_size * model.hidden_size
    block = block_parameters(model)
    return (
        [PipelineLayer(EMBED, embedding)]
        + [PipelineLayer("block", block) for _ in range(model.num_hidden_layers)]
        + [PipelineLayer(NORM, model.hidden_size), PipelineLayer(HEAD, embedding)]
    )


def stage_bounds(layers: list[PipelineLayer], pp: int, method: str) -> list[int]:
    """Layer indices [b0 = 0, b1, ..., b_pp = len(layers)]: stage s runs layers b_s .. b_{s+1} - 1.

    `parameters`: the split whose heaviest stage holds the fewest parameters (each stage at least one
    block); `blocks`: the blocks split as evenly as possible (earlier stages take the remainder), the
    embedding with the first stage and the norm and output layer with the last.
    """
    blocks = [i for i, layer in enumerate(layers) if layer.kind == "block"]
    if not 1 <= pp <= len(blocks):
        raise ValueError(f"{pp} stages for {len(blocks)} blocks")
    if pp == 1:
        return [0, len(layers)]
    if method == "blocks":
        per, extra = divmod(len(blocks), pp)
        sizes = [per + (1 if s < extra else 0) for s in range(pp)]
        starts = [blocks[sum(sizes[:s])] for s in range(pp)]
        return [0, *starts[1:], len(layers)]
    if method == "parameters":
        return _balanced(layers, blocks, pp)
    raise ValueError(f"pipeline partition must be parameters or blocks, got {method!r}")


def _balanced(layers: list[PipelineLayer], blocks: list[int], pp: int) -> list[int]:
    """Stage boundaries minimising the heaviest stage: every cut sits before a block, and with a few
    hundred blocks at most an exhaustive dynamic programme over cut positions is instant."""
    weights = [layer.parameters for layer in layers]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts = blocks[1:]  # a stage may start at any block but the first (the embedding leads stage 0)
    n = len(layers)
    # best[k][j]: the lightest heaviest stage when layers [0, start_j) form k stages; start_j = cut j.
    starts = [0, *cuts, n]
    inf = float("inf")
    best = [[inf] * len(starts) for _ in range(pp + 1)]
    back = [[0] * len(starts) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for j in range(1, len(starts)):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                load = max(best[k - 1][i], prefix[starts[j]] - prefix[starts[i]])
                if load < best[k][j]:
                    best[k][j], back[k][j] = load, i
    bounds = [n]
    j = len(starts) - 1
    for k in range(pp, 0, -1):
        j = back[k][j]
        bounds.append(starts[j])
    return bounds[::-1]


def layer_prefix(index: int, num_blocks: int) -> str:
    """What turns a pipeline layer's parameter names into the one-process model's: layer 0 is the
    embedding (`embed_tokens.weight`), layers 1..L the blocks (`layers.{i}.`), then the final norm
    (`norm.weight`) and the output layer (`lm_head.weight`, or a tied copy of `embed_tokens.weight`)."""
    return f"layers.{index - 1}." if 1 <= index <= num_blocks else ""


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The share of a step each stage idles while the pipeline fills and drains: (pp - 1) / (m + pp - 1)
    for both schedules (they differ in memory, not in the bubble)."""
    return (pp - 1) / (micro_batches + pp - 1)
