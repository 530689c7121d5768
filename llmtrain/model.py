"""A Llama decoder, numerically interchangeable with Hugging Face's LlamaForCausalLM.

Read top to bottom: RMSNorm -> rotary embeddings -> attention -> MLP -> block -> model -> build.
Parameter names are Hugging Face's without the leading `model.` (`embed_tokens`, `layers.0.self_attn.q_proj`,
..., `norm`, `lm_head`), so export is a rename. Shapes: B batch, T sequence, D hidden, H query heads,
K key/value heads, Hd head dim, V vocabulary, F MLP width.

This file imports no optimizer, data or DeepSpeed code: the trainer wraps the model, not the other way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llmtrain.config import ModelConfig

IGNORE_INDEX = -100  # labels with this value contribute nothing to the loss (F.cross_entropy's default)
LOSS_CHUNK_ROWS = 1024  # token rows per output-projection + cross-entropy chunk

CheckpointMode = Literal["none", "full", "selective"]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight, exactly as Hugging Face."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., D]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim (Hugging Face's convention, so weights are interchangeable)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, Hd], cos/sin [B, T, Hd] -> x rotated by its position."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    return x * cos + rotate_half(x) * sin


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


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """F.scaled_dot_product_attention; on CPU in bf16/fp16, computed in fp32 and cast back.

    CPU's flash-attention kernel is about twice as slow in bf16 as in fp32 (forward + backward, measured
    with bench/bench_train.py's profile on a Xeon with AMX), while GPU kernels are fastest in bf16. The
    fp32 computation sits inside a checkpoint, so backward keeps only the low-precision q, k, v (not fp32
    copies, nor the output) and recomputes the cheap forward kernel.
    """
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if not torch.is_grad_enabled():
        return _sdpa_fp32(q, k, v, **kwargs)
    out: Tensor = checkpoint(_sdpa_fp32, q, k, v, use_reentrant=False, **kwargs)
    return out


def _sdpa_fp32(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)


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
        y = sdpa(q, k, v, is_causal=True, enable_gqa=grouped)
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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        # -1 heads: tensor parallelism gives this rank H / tp query and K / tp key/value heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # [B, T, h, Hd]
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # [B, T, k, Hd]
        v = self.v_proj(x).view(B, T, -1, self.head_dim)  # [B, T, k, Hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Ulysses: batch dim 0, RoPE already applied (None).
        y = attend(q, k, v, mask) if self.ulysses is None else self.ulysses(q, k, v, 0, None, mask)
        return self.o_proj(y.reshape(B, T, -1))  # [B, T, D]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, D] -> [B, T, F] -> [B, T, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loss_chunk_rows = LOSS_CHUNK_ROWS
        self.init_seed: int | None = None  # the seed init_weights uses when none is passed
        self._checkpointed: frozenset[int] = frozenset()
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
            return self.summed_loss(h, labels) / label_count(labels)
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
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        return self.norm(x)

    def summed_loss(self, h: Tensor, labels: Tensor) -> Tensor:
        """Summed cross-entropy of lm_head(h) against labels (chunked_summed_loss through the module, so
        ZeRO-3 gathers its weight)."""
        return chunked_summed_loss(h, labels, self.lm_head, self.loss_chunk_rows)

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

        share = self.summed_loss(h, self._local_slice(labels)) / label_count(labels)
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

        Uses torch.utils.checkpoint with use_reentrant=False; the loss and gradients are unchanged.
        """
        self._checkpointed = frozenset(checkpointed_blocks(len(self.layers), mode, every_k))

    def compile_blocks(self, **compile_kwargs: Any) -> None:
        """torch.compile each transformer block in place (parameter names are unchanged).

        Blocks share one structure, so the first compiled graph is reused by the rest.
        """
        for block in self.layers:
            block.compile(**compile_kwargs)


def chunked_summed_loss(
    h: Tensor, labels: Tensor, project: Callable[[Tensor], Tensor], chunk_rows: int = LOSS_CHUNK_ROWS
) -> Tensor:
    """Summed cross-entropy of project(h) (the output layer) against labels, a chunk of rows at a time.

    The full fp32 logits tensor [B*T, V] is never materialised: each chunk's logits are computed,
    upcast to fp32 and reduced to a summed loss inside torch.utils.checkpoint, so autograd keeps only
    the chunk's hidden states and recomputes its logits in backward. Peak logits memory is
    chunk_rows x V instead of B x T x V (a 128k vocabulary at 8 x 4096 tokens would be 16 GiB).
    """
    rows = h.reshape(-1, h.shape[-1])  # [N, D]
    targets = labels.reshape(-1)  # [N]
    chunk_loss = partial(_chunk_loss, project)
    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_rows):
        chunk = slice(start, start + chunk_rows)
        if torch.is_grad_enabled():
            total = total + checkpoint(chunk_loss, rows[chunk], targets[chunk], use_reentrant=False)
        else:
            total = total + chunk_loss(rows[chunk], targets[chunk])
    return total


def _chunk_loss(project: Callable[[Tensor], Tensor], rows: Tensor, targets: Tensor) -> Tensor:
    logits = project(rows).float()  # [n, D] -> [n, V] fp32
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def label_count(labels: Tensor) -> Tensor:
    # A batch whose labels are all ignored has loss 0 (and zero gradients) rather than NaN.
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


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
