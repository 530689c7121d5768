"""Activations per rank and micro-batch: what autograd saves for backward in llmtrain.model, per block and
checkpointing mode, under tp and sp, and what a pipeline stage keeps besides."""

from __future__ import annotations

import math

from llmtrain.config import ModelConfig
from llmtrain.planning.memory.pipeline import (
    StageSpan,
)
from llmtrain.planning.memory.setup import FP32, Setup, bytes_of

# llmtrain.loss.LOSS_CHUNK_ROWS (not imported: that would import torch); a test keeps them equal.
LOSS_CHUNK_ROWS = 1024


def checkpointed_layers(layers: int, mode: str, every_k: int) -> int:
    """How many blocks llmtrain.model recomputes: none 0, full all, selective blocks 0, k, 2k, ..."""
    if mode == "full":
        return layers
    if mode == "selective":
        return math.ceil(layers / every_k)
    return 0


def checkpointed_in(blocks: range, mode: str, every_k: int) -> int:
    """How many of the model's blocks `blocks` (a pipeline stage's) are recomputed: the model picks
    blocks 0, k, 2k, ... by their index in the whole model, so a stage counts those it holds."""
    if mode == "selective":
        return sum(1 for i in blocks if i % every_k == 0)
    return checkpointed_layers(len(blocks), mode, every_k)


def layer_activation_bytes(
    model: ModelConfig, batch: int, seq: int, precision: str, doc_mask: bool, tp: int = 1, sp: int = 1
) -> int:
    """Bytes one un-checkpointed block saves for backward on one rank (the tensors autograd keeps,
    deduplicated).

    RMSNorm (x2): its input (b bytes per element; backward recomputes the normalised rows from it) plus
    the fp32 rsqrt per token. Attention: the normed input to q/k/v, the RoPE-rotated q and k,
    v, SDPA's output (which o_proj reads as a view) and its fp32 log-sum-exp per head; RoPE's cos/sin are
    shared by all layers. GQA: k and v have kv_heads x head_dim columns (SDPA's enable_gqa does not copy
    them; one whole head per rank when tp exceeds them); with document masking they are repeated to all
    heads. SwiGLU: the normed input, gate, silu(gate),
    up and their product.

    Tensor parallelism splits what lies between a column-parallel projection and its row-parallel partner
    (q, k, v, SDPA's output and log-sum-exp; gate, silu, up, product) over tp; the norms and their outputs,
    which every tp rank holds whole, are not. Sequence parallelism leaves each rank seq / sp tokens of
    everything: inside attention the all-to-all hands it whole sequences of H / sp heads (the same bytes),
    and o_proj saves the all-to-all's output back, a copy apart from SDPA's output.
    """
    b, d, tokens = bytes_of(precision), model.hidden_size, batch * seq // sp
    # k and v columns on one rank: its key/value heads (one whole head, replicated, when tp exceeds them)
    kv_heads = model.num_key_value_heads
    kv = d // tp if doc_mask else kv_heads * model.head_width // min(tp, kv_heads)
    norms = 2 * (tokens * d * b + FP32 * tokens)
    heads = (b * tokens * 2 * d + FP32 * tokens * model.num_attention_heads) // tp + b * tokens * 2 * kv
    regathered = b * tokens * d // tp if sp > 1 else 0  # this tp rank's heads
    attention = b * tokens * d + heads + regathered
    mlp = b * tokens * d + 4 * b * tokens * model.intermediate_size // tp
    return norms + attention + mlp


def rank_tokens(setup: Setup) -> int:
    """Tokens of one micro-batch in one rank's activations: seq_len / sp of each sequence."""
    t = setup.cfg.train
    return t.micro_batch * t.seq_len // setup.layout.sp


def hidden_state_bytes(setup: Setup) -> int:
    """One micro-batch's residual stream on one rank, in the model dtype: a block's input, the tensor a
    pipeline stage receives and sends."""
    return setup.lp_bytes * rank_tokens(setup) * setup.cfg.model.hidden_size


def _layer_bytes(setup: Setup) -> int:
    t, lay = setup.cfg.train, setup.layout
    return layer_activation_bytes(
        setup.cfg.model,
        t.micro_batch,
        t.seq_len,
        setup.precision,
        setup.cfg.data.document_masking,
        lay.tp,
        lay.sp,
    )


def activation_bytes(setup: Setup, stage: int = 0) -> int:
    """Bytes saved for backward by one forward pass of one micro-batch on one rank, under the
    checkpointing mode and the layout; under pp, on pipeline stage `stage` (its blocks, the embedding's
    on the first, the final norm's on the last, and what the pipeline keeps until the micro-batch's
    backward: pipeline_io_bytes)."""
    m, t = setup.cfg.model, setup.cfg.train
    span = setup.spans[stage]
    b, tokens, doc_mask = setup.lp_bytes, rank_tokens(setup), setup.cfg.data.document_masking
    residual = hidden_state_bytes(setup)
    on_gpu = 0 if t.cpu_checkpointing else checkpointed_input_bytes(setup, stage)
    blocks = on_gpu + (span.blocks - recomputed_blocks(setup, stage)) * _layer_bytes(setup)
    # RoPE's cos and sin ([B, T / sp, head_dim] each) and the boolean block-diagonal mask: the model
    # computes them once for all its blocks; a pipeline's blocks each compute their own from the
    # positions (and document ids) passed between stages.
    computed = 1 if setup.layout.pp == 1 else span.blocks
    whole = t.micro_batch * t.seq_len  # every sp rank receives whole sequences and slices views of them
    rope = computed * 2 * b * tokens * m.head_width
    mask = computed * whole * t.seq_len if doc_mask else 0
    ids = 8 * whole if span.embedding else 0  # the embedding's int64 indices
    head = 0
    if span.head:
        final_norm = tokens * m.hidden_size * b + FP32 * tokens
        # The fused loss keeps its gradients from forward to backward: for the final hidden states (a
        # residual stream's size) and for this rank's V / tp rows of the output weight; + the token count.
        head = final_norm + residual + b * _rank_vocab(setup) * m.hidden_size + 8
    return blocks + rope + mask + ids + head + pipeline_io_bytes(setup, span)


def checkpointed_input_bytes(setup: Setup, stage: int = 0) -> int:
    """What the recomputed blocks of one micro-batch keep on one rank (of pipeline stage `stage`): each
    its input, the residual stream; 1/tp of it with partitioned activations (DeepSpeed splits it over
    the tp ranks and all-gathers it for the recompute). In host memory with --cpu-checkpointing."""
    per_block = hidden_state_bytes(setup)
    if setup.cfg.train.partition_activations:
        per_block //= setup.layout.tp
    return recomputed_blocks(setup, stage) * per_block


def recomputed_blocks(setup: Setup, stage: int) -> int:
    """Blocks of pipeline stage `stage` (the only one without --pp) that activation checkpointing
    recomputes."""
    t = setup.cfg.train
    return checkpointed_in(setup.spans[stage].block_range, t.activation_checkpointing, t.checkpoint_every_k)


def _rank_vocab(setup: Setup) -> int:
    """Vocabulary rows of the output layer one rank holds: V / tp (vocab-parallel)."""
    return setup.cfg.model.vocab_size // setup.layout.tp


def pipeline_io_bytes(setup: Setup, span: StageSpan) -> int:
    """What DeepSpeed's pipeline keeps per micro-batch until its backward, besides saved activations: the
    received input hidden states (their gradient goes back) and the stage's output (backward starts from
    it), in the model dtype, and the int64 tensors passed along with them (positions, document ids) and
    the last stage's labels. Nothing without a pipeline (the one stage has the embedding and the head)."""
    if setup.layout.pp == 1:
        return 0
    t = setup.cfg.train
    residual = hidden_state_bytes(setup)
    hidden = residual * ((not span.embedding) + (not span.head))
    int64_tensors = 1 + setup.cfg.data.document_masking + span.head  # positions, doc ids, labels
    return hidden + 8 * t.micro_batch * t.seq_len * int64_tensors


def stage_activations(setup: Setup, stage: int) -> int:
    """Activations pipeline stage `stage` holds at its peak: one micro-batch's times those in flight."""
    return setup.in_flight(stage) * activation_bytes(setup, stage)


def activation_peak_stage(setup: Setup) -> int:
    """The stage holding the most activations (the first under 1F1B, unless its blocks are lighter)."""
    return max(range(setup.layout.pp), key=lambda s: stage_activations(setup, s))


def backward_working_bytes(setup: Setup) -> int:
    """Transient bytes while one block runs backward: its recomputed activations when checkpointed, plus
    the activation gradients in flight (about two hidden-sized and two MLP-sized tensors)."""
    m, t = setup.cfg.model, setup.cfg.train
    recompute = 0
    if checkpointed_layers(m.num_hidden_layers, t.activation_checkpointing, t.checkpoint_every_k):
        recompute = _layer_bytes(setup)
    mlp_width = m.intermediate_size // setup.layout.tp
    return recompute + 2 * setup.lp_bytes * rank_tokens(setup) * (m.hidden_size + mlp_width)


def loss_chunk_bytes(setup: Setup) -> int:
    """The fused output layer + cross-entropy (llmtrain.loss) while it runs, besides the gradients it
    keeps (counted with the activations): one chunk's fp32 logits (overwritten by their gradient) and
    that gradient's low-precision copy, and the output weight's gradient summed over the chunks in fp32
    next to one chunk's low-precision product (or, at the end, the cast). Under tp each rank computes
    the logits of its V / tp vocabulary rows (the vocab-parallel loss)."""
    m, tokens, lp = setup.cfg.model, rank_tokens(setup), setup.lp_bytes
    rows = min(LOSS_CHUNK_ROWS, tokens)
    vocab = _rank_vocab(setup)
    low_precision_copy = lp if lp < FP32 else 0  # in fp32 the logits are their own gradient buffer
    chunk = (FP32 + low_precision_copy) * rows * vocab
    return chunk + (FP32 + low_precision_copy) * vocab * m.hidden_size


def ulysses_buffer_bytes(setup: Setup) -> int:
    """Sequence parallelism's all-to-all buffers of one attention layer: q, k and v exchanged in and the
    output exchanged back, each this rank's seq / sp tokens of all its heads (H / tp under tp). They
    bound the contiguous send copy and receive buffer DeepSpeed allocates per exchange; 0 without sp."""
    if setup.layout.sp == 1:
        return 0
    m = setup.cfg.model
    kv = m.num_key_value_heads * m.head_width  # exchanged before document masking repeats them
    return 2 * setup.lp_bytes * rank_tokens(setup) * (m.hidden_size + kv) // setup.layout.tp
