"""Pipeline parallelism's arithmetic for the estimator: which blocks each stage runs, how many
micro-batches' activations it holds at once, and the bubble.

The stages are llmtrain.planning.stages' (the partition the engine builds), so the estimate is of the
stages that run. Bytes are formulas' business; this module only counts.

Import-light on purpose, as the rest of llmtrain.planning.memory: no torch, no DeepSpeed.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from llmtrain.config import ModelConfig, PipeSchedule
from llmtrain.planning import partition
from llmtrain.planning.stages import EMBED, HEAD, PipelineLayer, pipeline_layers, stage_bounds

SCHEDULES = typing.get_args(PipeSchedule)


@dataclass(frozen=True)
class StageSpan:
    """What one pipeline stage runs: blocks first_block .. first_block + blocks - 1 of the model, the
    embedding on the first stage, the final norm and output layer on the last."""

    index: int
    first_block: int
    blocks: int
    embedding: bool
    head: bool
    parameters: int  # elements it holds (a tied embedding on both ends, as the engine's TiedLayerSpec)
    largest_tensor: int  # elements of its largest parameter tensor

    @property
    def block_range(self) -> range:
        return range(self.first_block, self.first_block + self.blocks)


def stage_spans(model: ModelConfig, pp: int, method: str, tp: int = 1) -> list[StageSpan]:
    """The `pp` stages of `model` under partition `method` ("parameters" or "blocks"); pp 1 is one
    stage holding everything. The cut is the engine's (by whole layers, the same on every tp rank);
    `parameters` is what one rank of the stage holds under tensor parallelism of degree `tp`."""
    layers = pipeline_layers(model)
    bounds = stage_bounds(layers, pp, method)
    block_per_rank = partition.block_parameters(model, tp)
    largest = {kind: _largest_tensor(model, kind, tp) for kind in {layer.kind for layer in layers}}
    spans = []
    blocks_before = 0
    for s in range(pp):
        held = layers[bounds[s] : bounds[s + 1]]
        blocks = sum(1 for layer in held if layer.kind == "block")
        spans.append(
            StageSpan(
                index=s,
                first_block=blocks_before,
                blocks=blocks,
                embedding=any(layer.kind == EMBED for layer in held),
                head=any(layer.kind == HEAD for layer in held),
                parameters=sum(_per_rank(layer, block_per_rank, tp) for layer in held),
                largest_tensor=max(largest[layer.kind] for layer in held),
            )
        )
        blocks_before += blocks
    return spans


def describe_span(span: StageSpan) -> str:
    """`embedding, blocks 0-3` or `blocks 4-7, final norm, output layer`."""
    last = span.first_block + span.blocks - 1
    parts = ["embedding"] if span.embedding else []
    parts.append(f"block {last}" if span.blocks == 1 else f"blocks {span.first_block}-{last}")
    if span.head:
        parts.append("final norm, output layer")
    return ", ".join(parts)


def _per_rank(layer: PipelineLayer, block_per_rank: int, tp: int) -> int:
    """Elements one tp rank holds of a pipeline layer: a block's split share, the embedding's or the
    output layer's V / tp rows (vocab-parallel), the whole final norm."""
    if layer.kind == "block":
        return block_per_rank
    return layer.parameters // tp if layer.kind in (EMBED, HEAD) else layer.parameters


def _largest_tensor(model: ModelConfig, kind: str, tp: int) -> int:
    """Elements of the largest parameter tensor one rank holds of a layer of this kind."""
    d = model.hidden_size
    if kind in (EMBED, HEAD):
        return model.vocab_size // tp * d
    if kind == "block":
        return max(spec.per_rank(tp) for spec in partition.block_tensors(model))
    return d  # the final norm


def heaviest(spans: list[StageSpan]) -> StageSpan:
    """The stage holding the most parameters (the first of equals): its model states bound every stage's."""
    return max(spans, key=lambda span: span.parameters)


def in_flight(schedule: str, pp: int, micro_batches: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak.

    1F1B (DeepSpeed's TrainSchedule) runs a micro-batch's backward as soon as the last stage can, so
    stage s has at most pp - s forwards outstanding (its num_pipe_buffers); GPipe runs every forward of
    the step before the first backward, so every stage holds all m. Without a pipeline, gradient
    accumulation finishes each micro-batch's backward before the next forward: one.
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(pp - stage, micro_batches)
    raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
