"""A Llama decoder, numerically interchangeable with Hugging Face's LlamaForCausalLM.

Read top to bottom: RMSNorm -> rotary embeddings -> attention -> MLP -> block -> model -> build.
Parameter names are Hugging Face's without the leading `model.` (`embed_tokens`, `layers.0.self_attn.q_proj`,
..., `norm`, `lm_head`), so export is a rename. Shapes: B batch, T sequence, D hidden, H query heads,
K key/value heads, Hd head dim, V vocabulary, F MLP width.

This file imports no optimizer, data or DeepSpeed code: the trainer wraps the model, not the other way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llmtrain.config import ModelConfig
from llmtrain.loss import OutputLayer, label_count
from llmtrain.parallel import tensor

CheckpointMode = Literal["none", "full", "selective"]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight, exactly as Hugging Face."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.compiled = False  # Llama.compile_elementwise: the expression through torch.compile

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., D]
        weight = tensor.local(self.weight)  # FSDP2 + tp: a DTensor replicated over tp
        if self.compiled:
            return compiled("rms_norm")(x, weight, self.eps)
        out: Tensor = _RMSNormFunction.apply(x, weight, self.eps)
        return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm's expression (what _RMSNormFunction computes), for torch.compile to fuse with its backward."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward: autograd of the forward's expression keeps the fp32 copy of
    the input and the fp32 normalised output for backward and runs about twice the kernels; this keeps
    the input and one fp32 number per row, and recomputes the normalised rows in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.to(_at_least_fp32(x.dtype))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, rstd, weight)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        wide = _at_least_fp32(x.dtype)
        normed = x.to(wide) * rstd  # [..., D] fp32
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            per_row = grad.to(wide) * normed.to(x.dtype)  # as autograd multiplies the cast-back rows
            grad_weight = per_row.reshape(-1, per_row.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).to(wide)
            # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed)) along the row
            grad_x = (rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))).to(
                x.dtype
            )
        return grad_x, grad_weight, None


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------- rotary position embeddings


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """RoPE's inverse frequencies [Hd / 2] in fp32, with the config's frequency scaling.

    As Hugging Face computes them (modeling_rope_utils), so imported weights see the same angles:
    `linear` divides every frequency by the factor (positions / factor); `llama3` (Llama 3.1) divides
    the low frequencies (wavelength above original_max / low_freq_factor) by the factor, keeps the high
    ones (wavelength below original_max / high_freq_factor) and blends the ones between.
    """
    hd = cfg.head_width
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "linear":
        return inv_freq / factor
    if cfg.rope_scaling_type == "llama3":
        low, high = cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
        old_context = cfg.rope_scaling_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(position_ids: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables for `position_ids` [B, T] -> two [B, T, Hd] tensors.

    Computed from scratch each forward in fp32 (a few thousand multiplies): no buffer to go stale on the
    meta device or to be rounded to bf16 when the trainer casts the module.
    """
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, Hd/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, Hd]: Hugging Face's half-split layout
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # Every block reads the same tables: DeepSpeed's activation checkpointing (partitioned or in host
    # memory) must leave them as they are; partitioning empties a block's input in place.
    cos.no_checkpointing = sin.no_checkpointing = True  # type: ignore[attr-defined]
    return cos, sin


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim (Hugging Face's convention, so weights are interchangeable)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, Hd], cos/sin [B, T, Hd] -> x rotated by its position."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    out: Tensor = _Rope.apply(x, cos, sin)
    return out


class _Rope(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin, with the rotation's transpose as backward: autograd of the
    expression saves x and builds the gradient through chunk and cat's backward (zero-filled tensors and
    copies); the rotation is linear in x, so backward needs only cos and sin."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return rotated(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        rotated = grad * sin
        g1, g2 = rotated.chunk(2, dim=-1)
        return grad * cos + torch.cat((g2, -g1), dim=-1), None, None


def rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE's expression: x [..., Hd] rotated by the angles whose cos and sin broadcast against it."""
    return x * cos + rotate_half(x) * sin


def rope_pair(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE on q and k through autograd (what apply_rope computes), for torch.compile to fuse."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return rotated(q, cos, sin), rotated(k, cos, sin)


@functools.cache
def compiled(name: str) -> Callable[..., Any]:
    """The torch.compile'd expression `name` (rms_norm, rope_pair, swiglu), made once per process."""
    expressions: dict[str, Callable[..., Any]] = {
        "rms_norm": rms_norm,
        "rope_pair": rope_pair,
        "swiglu": swiglu,
    }
    return torch.compile(expressions[name])


def document_positions_and_mask(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """doc_ids [B, T] -> RoPE positions [B, T] restarting at 0 per document, and a [B, 1, T, T] mask.

    A document is a run of equal consecutive ids, so ids may repeat later in the row without the two
    runs seeing each other. mask[b, 0, i, j] is True where query i may attend to key j: j <= i and both
    in the same document (block-diagonal causal).
    """
    _, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)  # [B, T]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_of_doc = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # [B, T]
    positions = idx - start_of_doc
    segment = starts.long().cumsum(dim=1)  # [B, T]: 1, 1, 2, 2, 2, 3, ...
    same_doc = segment[:, :, None] == segment[:, None, :]  # [B, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return positions, (same_doc & causal).unsqueeze(1)


# ---------------------------------------------------------------- the transformer block


def sdpa(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, attn_mask: Tensor | None = None) -> Tensor:
    """F.scaled_dot_product_attention (GQA when k, v have fewer heads than q); on CPU in bf16/fp16 with
    gradients, the flash kernel's forward in that precision and its backward in fp32.

    CPU's flash-attention kernel runs its forward fastest in bf16 but its backward about 1.7x slower in
    bf16 than in fp32 (bench/bench_train.py's profile on an AVX-512-bf16 EPYC), while GPU kernels are
    fastest in bf16 both ways.
    """
    if q.device.type == "cpu" and q.dtype != torch.float32 and torch.is_grad_enabled():
        out: Tensor = _CpuFlashAttention.apply(q, k, v, is_causal, attn_mask)
        return out
    grouped = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=grouped
    )


class _CpuFlashAttention(torch.autograd.Function):
    """Low-precision forward, fp32 backward of CPU's flash attention; q [B, h, T, Hd], k, v [B, k, T, Hd].

    Backward upcasts q, k, v, the output and its gradient and reuses the forward's fp32 log-sum-exp,
    so nothing is recomputed; the gradients are cast back to the inputs' dtype.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, mask: Tensor | None) -> Tensor:
        out, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=_additive_mask(mask, q.dtype)
        )
        ctx.save_for_backward(q, k, v, out, log_sum_exp, mask)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, log_sum_exp, mask = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.float(),
            q.float(),
            k.float(),
            v.float(),
            out.float(),
            log_sum_exp,
            0.0,
            ctx.is_causal,
            attn_mask=_additive_mask(mask, torch.float32),
        )
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, None, None


def _additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: attend) as the additive one the flash kernels take: 0 or -inf."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Causal (or document-masked) attention of q [B, T, h, Hd] over k, v [B, T, k, Hd] -> [B, T, h, Hd].

    The head counts are those of the caller's rank: all of them, H / tp under tensor parallelism, or
    H / sp after Ulysses' all-to-all (which hands each rank whole sequences for its heads).
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, Hd]
    grouped = k.shape[1] != q.shape[1]
    if mask is None:
        # Plain causal training: no mask tensor at all, so the flash kernel applies. enable_gqa lets
        # the kernel share each K/V head across its query group without copying K/V H/K times.
        y = sdpa(q, k, v, is_causal=True)
    else:
        # Document masking: an explicit boolean mask. The fused kernels that take a mask do not take
        # enable_gqa, so K/V are repeated here rather than falling back to the unfused math kernel.
        if grouped:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = sdpa(q, k, v, attn_mask=mask)
    return y.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query self-attention through scaled_dot_product_attention (flash / fused kernels).

    `ulysses`: under sequence parallelism, DeepSpeed's DistributedAttention around `attend`. Its
    all-to-all turns this rank's T / sp positions of all heads into all T positions of H / sp heads
    (and back), so `attend` sees whole sequences and the mask needs nothing of sp.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_width
        d, hd = cfg.hidden_size, cfg.head_width
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
        self.ulysses: nn.Module | None = None
        self.tp_group: Any = None  # the tensor-parallel group, once parallel.tensor.shard split the weights
        self.kv_group: Any = None  # this rank's copies of its key/value head, when tp exceeds the heads
        self.compiled = False  # Llama.compile_elementwise: RoPE through torch.compile

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        x = tensor.enter(x, self.tp_group)
        # -1 heads: tensor parallelism gives this rank H / tp query and K / tp key/value heads (one
        # replicated key/value head when tp > K).
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # [B, T, h, Hd]
        k = tensor.replicated_projection(self.k_proj, x, self.kv_group).view(B, T, -1, self.head_dim)
        v = tensor.replicated_projection(self.v_proj, x, self.kv_group).view(B, T, -1, self.head_dim)
        if self.compiled:
            q, k = compiled("rope_pair")(q, k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Ulysses: batch dim 0, RoPE already applied (None).
        y = attend(q, k, v, mask) if self.ulysses is None else self.ulysses(q, k, v, 0, None, mask)
        return tensor.leave(self.o_proj(y.reshape(B, T, -1)), self.tp_group)  # [B, T, D]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.tp_group: Any = None  # as Attention's
        self.compiled = False  # Llama.compile_elementwise

    def forward(self, x: Tensor) -> Tensor:  # [B, T, D] -> [B, T, F / tp] -> [B, T, D]
        x = tensor.enter(x, self.tp_group)
        gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(compiled("swiglu")(gate, up) if self.compiled else swiglu(gate, up))
        return tensor.leave(out, self.tp_group)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def checkpointed_blocks(num_layers: int, mode: str, every_k: int = 2) -> list[int]:
    """Indices of the blocks whose activations are recomputed in backward.

    none: no block; full: every block; selective: blocks 0, k, 2k, ... (ceil(L / k) of them).
    """
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_layers))
    if mode == "selective":
        if every_k < 1:
            raise ValueError(f"selective activation checkpointing needs every_k >= 1, got {every_k}")
        return list(range(0, num_layers, every_k))
    raise ValueError(f"activation checkpointing mode must be none, full or selective, got {mode!r}")


# ---------------------------------------------------------------- the model


Recompute = Callable[..., Tensor]  # (block, *its inputs) -> its output, activations recomputed in backward


def torch_recompute(block: Callable[..., Tensor], *inputs: Any) -> Tensor:
    """A checkpointed block through torch.utils.checkpoint (non-reentrant): it keeps only its inputs."""
    out: Tensor = checkpoint(block, *inputs, use_reentrant=False)
    return out


class TokenEmbedding(nn.Embedding):
    """Token ids -> their rows; under tensor parallelism (`tp_group`, set by parallel.tensor.shard, which
    keeps this rank's V / tp rows, or by FSDP2's parallel.dtensor_tp, a DTensor of them) each rank looks
    up the ids it holds and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.tp_group: Any = None

    def forward(self, input_ids: Tensor) -> Tensor:
        return tensor.embed(input_ids, tensor.local(self.weight), self.tp_group)


class Llama(nn.Module):
    """Token ids -> logits, or -> mean cross-entropy when labels are given.

    Tied embeddings (`cfg.tie_word_embeddings`): `lm_head.weight` IS `embed_tokens.weight` (one Parameter
    in two modules, as in Hugging Face, so ZeRO-3 gathers it through either module's hooks).
    `state_dict()` then holds it once, as `embed_tokens.weight`; `load_state_dict` accepts a dict with or
    without `lm_head.weight` (a present one is ignored: the tie decides).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = TokenEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = OutputLayer(cfg.hidden_size, cfg.vocab_size)
        self.init_seed: int | None = None  # the seed init_weights uses when none is passed
        self._checkpointed: frozenset[int] = frozenset()
        self.recompute: Recompute = torch_recompute  # how a checkpointed block runs
        self.sp_group: Any = None  # the sequence-parallel process group, when set_sequence_parallel ran
        if cfg.tie_word_embeddings:
            self.tie_weights()
            self.register_state_dict_post_hook(_drop_tied_lm_head)
            self.register_load_state_dict_pre_hook(_ignore_tied_lm_head)

    def tie_weights(self) -> None:
        """Point lm_head at the embedding Parameter (again: moving off the meta device unties them)."""
        self.lm_head.weight = self.embed_tokens.weight

    # ------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        doc_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """input_ids [B, T] -> logits [B, T, V]; with labels [B, T] -> mean cross-entropy (fp32 scalar).

        labels[b, t] is the target for position t (already shifted: the next token), IGNORE_INDEX to skip.
        doc_ids [B, T]: packed documents; attention stays inside each one and positions restart at 0.
        position_ids [B, T] or [T]: explicit RoPE positions for plain causal attention (default 0..T-1).
        Under sequence parallelism every rank of the group passes the whole sequences and computes on
        its slice; the loss returned is the whole sequences' mean on every rank.
        """
        h = self.hidden_states(input_ids, doc_ids, position_ids)  # [B, T, D] ([B, T / sp, D] under sp)
        if labels is None:
            if self.sp_group is not None:
                raise ValueError(
                    "logits are not gathered under sequence parallelism; pass labels for the loss"
                )
            return self.lm_head(h)  # [B, T, V]
        if self.sp_group is None:
            return self.lm_head(h, labels)
        return self._sequence_parallel_loss(h, labels)

    def hidden_states(
        self, input_ids: Tensor, doc_ids: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, D] (this rank's [B, T / sp, D] under sp)."""
        B, T = input_ids.shape
        mask = None
        if doc_ids is not None:
            if position_ids is not None:
                raise ValueError("pass doc_ids or position_ids, not both: doc_ids determine the positions")
            position_ids, mask = document_positions_and_mask(doc_ids)  # of the whole sequences
        elif position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)
        position_ids = position_ids.expand(B, T)
        if self.sp_group is not None:
            # This rank's slice, with its global RoPE positions; the mask stays whole, as attention
            # runs over whole sequences after Ulysses' all-to-all.
            input_ids, position_ids = self._local_slice(input_ids), self._local_slice(position_ids)
        x = self.embed_tokens(input_ids)  # [B, T, D]
        inv_freq = rope_inv_freq(self.cfg, x.device)
        cos, sin = rope_cos_sin(position_ids, inv_freq, x.dtype)  # [B, T, Hd]
        for i, block in enumerate(self.layers):
            if i in self._checkpointed and torch.is_grad_enabled():
                x = self.recompute(block, x, cos, sin, mask)
            else:
                x = block(x, cos, sin, mask)
        return self.norm(x)

    # ------------------------------------------------------------ sequence parallelism

    def set_sequence_parallel(self, group: Any) -> None:
        """Split every sequence over the ranks of `group` (DeepSpeed Ulysses): each keeps T / sp tokens
        of the activations; attention swaps sequence for heads by an all-to-all and back."""
        from deepspeed.sequence.layer import DistributedAttention

        self.sp_group = group
        for block in self.layers:
            assert isinstance(block, Block)
            # [B, T/sp, heads, Hd] in and out: scatter the heads (dim 2), gather the sequence (dim 1).
            block.self_attn.ulysses = DistributedAttention(attend, group, scatter_idx=2, gather_idx=1)

    def _local_slice(self, t: Tensor) -> Tensor:  # [B, T] -> this rank's [B, T / sp]
        import torch.distributed as dist

        size, rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
        return t.chunk(size, dim=1)[rank]

    def _sequence_parallel_loss(self, h: Tensor, labels: Tensor) -> Tensor:
        """This rank's tokens' summed loss over the whole sequences' label count: the sp ranks' shares
        add up to the mean, and DeepSpeed sums their gradients (it averages over dp ranks only)."""
        import torch.distributed as dist

        share = self.lm_head(h, self._local_slice(labels), label_count(labels))
        whole = share.detach().clone()
        dist.all_reduce(whole, group=self.sp_group)
        return _ValueWithGradientOf.apply(share, whole)

    # ------------------------------------------------------------ initialisation

    @torch.no_grad()
    def init_weights(self, device: torch.device | str | None = None, seed: int | None = None) -> None:
        """Allocate (if on the meta device) and initialise every parameter, deterministically from a seed.

        Linear and embedding weights ~ N(0, initializer_range); the residual output projections
        (o_proj, down_proj) have their std divided by sqrt(2 * num_hidden_layers) so the residual stream's
        variance does not grow with depth (GPT-2); norms start at 1. `seed` defaults to the one given to
        build_model; None means torch's global RNG. The same seed on the same device type gives the same
        weights. A meta model is moved to `device` (default cpu) first.
        """
        if any(p.is_meta for p in self.parameters()):
            self.to_empty(device=device or "cpu")
        elif device is not None:
            self.to(device)
        if self.cfg.tie_word_embeddings:
            self.tie_weights()
        seed = self.init_seed if seed is None else seed
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():  # a tied weight is listed (and drawn) once
            init_parameter(name, param, self.cfg, generator)

    # ------------------------------------------------------------ memory and speed switches

    def set_activation_checkpointing(self, mode: str, every_k: int = 2) -> None:
        """Recompute block activations in backward: none, full (every block) or selective (every k-th).

        Uses `self.recompute` (torch.utils.checkpoint, non-reentrant, unless an engine sets DeepSpeed's);
        the loss and gradients are unchanged.
        """
        self._checkpointed = frozenset(checkpointed_blocks(len(self.layers), mode, every_k))

    def compile_blocks(self, **compile_kwargs: Any) -> None:
        """torch.compile each transformer block in place (parameter names are unchanged).

        Blocks share one structure, so the first compiled graph is reused by the rest.
        """
        for block in self.layers:
            block.compile(**compile_kwargs)

    def compile_elementwise(self) -> None:
        """torch.compile the elementwise parts only (RMSNorm, RoPE, SwiGLU's product), each fused with
        its backward; matmuls, attention and the loss stay eager. For ZeRO 3: its per-module hooks
        (gathering each Linear's weight) split a compiled block into dozens of graphs, which measured
        slower than compiling the parts between the hooks."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Attention)):
                module.compiled = True


class _ValueWithGradientOf(torch.autograd.Function):
    """Returns `value` and passes the incoming gradient to `x`: the loss every rank reports is the
    whole sequences' one, while backward flows through this rank's own share only."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _drop_tied_lm_head(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict post-hook: a tied lm_head is the embedding; store that tensor once."""
    state_dict.pop(prefix + "lm_head.weight", None)


def _ignore_tied_lm_head(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """load_state_dict pre-hook: take a tied lm_head from the embedding, whatever the dict says."""
    embedding = state_dict.get(prefix + "embed_tokens.weight")
    if embedding is not None:
        state_dict[prefix + "lm_head.weight"] = embedding


# ---------------------------------------------------------------- building


@torch.no_grad()
def init_parameter(name: str, param: Tensor, cfg: ModelConfig, generator: torch.Generator | None) -> None:
    """Initialise the parameter named `name` (model.py's names) as Llama.init_weights does."""
    if name.endswith("layernorm.weight") or name == "norm.weight":
        param.fill_(1.0)
        return
    std = cfg.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    nn.init.normal_(param, mean=0.0, std=std, generator=generator)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int | None = None) -> Llama:
    """Build a Llama on `device`, initialised from `seed` (None: torch's global RNG).

    The modules are always constructed on the meta device (no memory, no throwaway default init). On
    "meta" the model stays there, remembering the seed: `model.init_weights(device)` materialises it
    later, giving the same weights a direct build with that seed would.
    """
    with torch.device("meta"):
        model = Llama(cfg)
    model.init_seed = seed
    if torch.device(device).type != "meta":
        model.init_weights(device=device)
    return model


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once); equals presets.count_parameters for the shape."""
    return sum(p.numel() for p in model.parameters())
