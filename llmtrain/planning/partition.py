"""llmtrain's Llama tensor by tensor: every parameter's name, shape, tensor-parallel split and block, the
one spec that the parameter counts (presets.count_parameters), the estimator's per-rank tensors, the
pipeline's stage cut, the model's tensor-parallel shards (parallel.tensor) and checkpoint consolidation
read.

Megatron's split of a transformer block: the projections into the heads and into the MLP are
column-parallel (each rank keeps a block of output rows, dim 0 of the weight: whole heads, a slice of the
MLP width), the projections back to the hidden size row-parallel (a block of input columns, dim 1), so a
block needs one all-reduce after attention and one after the MLP. The embedding and the output layer are
split by vocabulary (dim 0: each rank a block of token rows; a lookup sums the ranks' rows, the loss is
computed vocab-parallel: llmtrain.loss). Norms stay whole on every rank. Torch-free, like the estimator
that reads it.

Key/value heads are split whole like the query heads while tp divides their number. With more tp ranks
than key/value heads (grouped-query attention, e.g. 8 KV heads at tp 16) they are replicated by one
rule: tp must be a multiple of the KV heads, and tp rank r holds KV head r // (tp / kv_heads), the one
its query heads read (rank r's query heads are consecutive and share it). The tp / kv_heads ranks that
hold one KV head are its replicas: their gradients are summed, so the copies stay equal
(parallel.tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

COLUMN = 0  # the weight's dim split over the tp ranks: output rows
ROW = 1  # input columns

TP_SPLIT_DIM: dict[str, int] = {
    "q_proj": COLUMN,
    "k_proj": COLUMN,
    "v_proj": COLUMN,
    "gate_proj": COLUMN,
    "up_proj": COLUMN,
    "o_proj": ROW,
    "down_proj": ROW,
    "embed_tokens": COLUMN,  # token rows
    "lm_head": COLUMN,
}


# The weights replicated over groups of tp ranks when tp exceeds the key/value heads.
KV_PROJECTIONS = ("k_proj", "v_proj")

# The parameters every tp rank holds whole (by their module's name): the RMSNorm weights.
WHOLE = ("input_layernorm", "post_attention_layernorm", "norm")


def tp_split_dim(name: str) -> int | None:
    """The dim tensor parallelism splits parameter `name` along (`layers.3.self_attn.q_proj.weight` -> 0),
    or None for one every rank holds whole."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return None
    return TP_SPLIT_DIM.get(parts[-2])


def kv_replicas(kv_heads: int, tp: int) -> int:
    """How many tp ranks hold each key/value head: 1 while tp divides the heads, else tp / kv_heads."""
    return tp // kv_heads if tp > kv_heads else 1


def is_kv_projection(name: str) -> bool:
    """`layers.3.self_attn.k_proj.weight` and its v_proj twin."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in KV_PROJECTIONS


class ModelShape(Protocol):
    """What the spec reads of a model (config.ModelConfig has it; the config imports this package, so
    the shape is named here rather than imported)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None
    tie_word_embeddings: bool


@dataclass(frozen=True)
class TensorSpec:
    name: str  # model.py's (Hugging Face's without the leading `model.`)
    shape: tuple[int, ...]
    block: int | None  # the transformer block it belongs to; None: embedding, final norm, output layer
    heads: int | None = None  # key/value heads stacked along dim 0 (k_proj, v_proj): the unit of a split

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def tp_dim(self) -> int | None:
        return tp_split_dim(self.name)

    def per_rank(self, tp: int) -> int:
        """Elements one rank holds under tensor parallelism of degree `tp` (one whole key/value head when
        tp exceeds the heads: replicated)."""
        if self.tp_dim is None:
            return self.numel
        return self.numel // min(tp, self.heads or tp)


def block_tensors(m: ModelShape, index: int = 0) -> list[TensorSpec]:
    """The parameters of transformer block `index`, in model.py's order."""
    d, f = m.hidden_size, m.intermediate_size
    head = m.head_dim or d // m.num_attention_heads
    q, kv = m.num_attention_heads * head, m.num_key_value_heads * head
    shapes = {
        "input_layernorm": (d,),
        "self_attn.q_proj": (q, d),
        "self_attn.k_proj": (kv, d),
        "self_attn.v_proj": (kv, d),
        "self_attn.o_proj": (d, q),
        "post_attention_layernorm": (d,),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
    }
    kv_heads = m.num_key_value_heads
    return [
        TensorSpec(
            f"layers.{index}.{name}.weight", shape, index, kv_heads if name.endswith(KV_PROJECTIONS) else None
        )
        for name, shape in shapes.items()
    ]


def tensors(m: ModelShape) -> list[TensorSpec]:
    """Every parameter of llmtrain.model.Llama in its order (a tied output layer once, as the embedding)."""
    d = m.hidden_size
    specs = [TensorSpec("embed_tokens.weight", (m.vocab_size, d), None)]
    for i in range(m.num_hidden_layers):
        specs += block_tensors(m, i)
    specs.append(TensorSpec("norm.weight", (d,), None))
    if not m.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (m.vocab_size, d), None))
    return specs


def block_parameters(m: ModelShape, tp: int = 1) -> int:
    """Parameters of one transformer block that one rank holds under tensor parallelism of degree `tp`."""
    return sum(spec.per_rank(tp) for spec in block_tensors(m))
