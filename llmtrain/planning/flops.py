"""The model's arithmetic: FLOPs per token for MFU, and per rank for the time model.

2 FLOPs per multiply-add; backward costs twice forward (the input's and the weight's gradients), so a
trained weight matmul is 6 FLOPs per parameter per token, and a recomputed block adds its forward again.
"""

from __future__ import annotations

from dataclasses import asdict

from llmtrain.config import ModelConfig
from llmtrain.planning.partition import WHOLE, block_tensors
from llmtrain.presets import count_parameters


def matmul_parameters(model_cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul: all of them except the input embedding table.

    The input embedding is a lookup, not a matmul; the output projection is a matmul. With tied
    embeddings the shared matrix is counted once, as the output projection. (This is torchtitan's
    convention. RMSNorm weights, under 0.01% of the total, are included.)
    """
    total = count_parameters(**asdict(model_cfg))
    input_embedding = 0 if model_cfg.tie_word_embeddings else model_cfg.vocab_size * model_cfg.hidden_size
    return total - input_embedding


def attention_width(model_cfg: ModelConfig) -> int:
    """Query heads x head width: the width attention scores and values are computed over."""
    return model_cfg.num_attention_heads * model_cfg.head_width


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward: 6·N + 12·L·h·s (PaLM, appendix B).

    N = `matmul_parameters` (every parameter except the input embedding table), so 6·N counts the
    weight matmuls (2 FLOPs per multiply-add, forward 1x + backward 2x); 12·L·h·s counts attention
    scores and the weighted sum of values (L layers, h = heads x head_dim, s = sequence length), without
    halving for the causal mask. Activation recomputation is not counted: MFU measures useful work.
    """
    n = matmul_parameters(model_cfg)
    return float(6 * n + 12 * model_cfg.num_hidden_layers * attention_width(model_cfg) * seq_len)


def block_matmul_parameters(model_cfg: ModelConfig, tp: int = 1) -> int:
    """Weights of one transformer block that one tp rank multiplies by (its norms are not matmuls)."""
    return sum(
        spec.per_rank(tp) for spec in block_tensors(model_cfg) if spec.name.split(".")[-2] not in WHOLE
    )


def block_elementwise_elements(model_cfg: ModelConfig, tp: int = 1) -> int:
    """Elements one tp rank's elementwise kernels read and write per token in one block's forward:
    two RMSNorms (read + write the hidden state, 4·d), two residual adds (6·d), rotary embedding of q and k
    (read + write, split by tp) and SwiGLU's silu(gate) * up (read two, write one, split by tp)."""
    d = model_cfg.hidden_size
    q = attention_width(model_cfg)
    kv = model_cfg.num_key_value_heads * model_cfg.head_width
    return 10 * d + (2 * (q + kv) + 3 * model_cfg.intermediate_size) // tp
