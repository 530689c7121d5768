"""Named model sizes. Shapes follow Llama-2 / Llama-3 where a published model exists.

Each preset's parameter count is computed by `count_parameters` from the shape alone and is
tested against the built model (on the meta device for the large ones).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from llmtrain.planning import partition

# Hugging Face LlamaConfig field names, so a preset reads like a config.json.
PRESETS: dict[str, dict[str, Any]] = {
    # For tests: a few hundred thousand parameters, a forward pass in milliseconds.
    "debug": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # The `make train` default: about 10M parameters, learns English on a 2-core CPU in minutes.
    "tiny": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "125m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
    ),
    "350m": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
    ),
    # Llama-3.2-1B.
    "1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Llama-2-7B.
    "7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    # Llama-2-13B.
    "13b": dict(
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        max_position_embeddings=4096,
    ),
    # Llama-2-70B (grouped-query attention, 8 KV heads).
    "70b": dict(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    ),
}

DEFAULT_PRESET = "tiny"


def count_parameters(
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    **_: Any,
) -> int:
    """Parameters of the Llama model with this shape (no biases, RMSNorm weights only)."""
    shape = SimpleNamespace(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
    )
    return sum(spec.numel for spec in partition.tensors(shape))
