"""The output layer and cross-entropy, fused: the loss and both of its gradients in one pass of chunks.

A plain `cross_entropy(lm_head(h).float(), labels)` holds the whole logits [N, V] and their fp32 copy (a
128k vocabulary at 8 x 4096 tokens: 16 GiB in fp32) until backward. Checkpointing the loss a chunk of rows
at a time avoids that, but recomputes every chunk's logits in backward: one more output-layer matmul and
softmax per step. Here each chunk's logits are computed once, in the forward pass, and turned at once into
the chunk's loss and its gradients with respect to the hidden states and the output weight (as
Liger-Kernel's fused linear cross-entropy does on GPUs); backward only hands those gradients on. Peak
memory is one chunk's logits (chunk_rows x V) plus the two gradients, and nothing is recomputed.

Precision follows what autograd does for `lm_head(h).float()` + cross-entropy in bf16: bf16 matmuls,
softmax and loss in fp32, the logits' gradient cast back to bf16 for the two gradient matmuls. The weight's
gradient is summed over the chunks in fp32 (autograd would sum the chunks' bf16 parts in bf16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # labels with this value contribute nothing to the loss (F.cross_entropy's default)
LOSS_CHUNK_ROWS = (
    1024  # token rows per chunk of logits (at most): one chunk's fp32 logits are 4 x 1024 x V bytes
)
# On CPU, chunks of at most 4M logits (16 MiB in fp32), measured 20-25% faster than 1024 rows at V = 8192:
# glibc maps blocks of 32 MiB and more afresh on every allocation (page-faulting them in), while smaller
# freed blocks are reused from the heap.
CPU_CHUNK_LOGITS = 1 << 22


def chunk_rows_for(vocab_size: int, device: torch.device) -> int:
    """Token rows per chunk of the fused loss for this vocabulary on this device."""
    if device.type == "cpu":
        return max(1, min(LOSS_CHUNK_ROWS, CPU_CHUNK_LOGITS // vocab_size))
    return LOSS_CHUNK_ROWS


class OutputLayer(nn.Linear):
    """The vocabulary projection (`lm_head`): hidden states -> logits, or with labels -> the loss, fused.

    Going through the module (not its weight) keeps ZeRO-3's and FSDP2's hooks in charge of gathering
    the weight and reducing its gradient.
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.chunk_rows: int | None = None  # None: chunk_rows_for the vocabulary and device

    def forward(self, h: Tensor, labels: Tensor | None = None, divisor: Tensor | None = None) -> Tensor:
        """h [..., D] -> logits [..., V]; with labels [...] -> the summed loss / divisor (fp32 scalar)."""
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy(h, self.weight, labels, divisor, self.chunk_rows)


def label_count(labels: Tensor) -> Tensor:
    # A batch whose labels are all ignored has loss 0 (and zero gradients) rather than NaN.
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    divisor: Tensor | None = None,
    chunk_rows: int | None = None,
) -> Tensor:
    """Summed cross-entropy of h @ weight.T against labels, divided by `divisor` (default: the number of
    labels not ignored, so the mean). h [..., D], weight [V, D], labels [...] -> fp32 scalar.

    Sequence parallelism passes the whole sequences' label count as divisor for its slice's share.
    """
    rows, targets = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    chunk_rows = chunk_rows or chunk_rows_for(weight.shape[0], weight.device)
    scale = 1.0 / (label_count(labels) if divisor is None else divisor).float()
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        loss: Tensor = _FusedLinearCrossEntropy.apply(rows, weight, targets, scale, chunk_rows)
        return loss
    return _chunked(rows, weight, targets, scale, chunk_rows, want_grad_h=False, want_grad_w=False)[0]


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk; backward scales and returns them."""

    @staticmethod
    def forward(
        ctx: Any, rows: Tensor, weight: Tensor, targets: Tensor, scale: Tensor, chunk_rows: int
    ) -> Tensor:
        want_grad_h, want_grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_rows, grad_weight = _chunked(
            rows, weight, targets, scale, chunk_rows, want_grad_h, want_grad_w
        )
        ctx.save_for_backward(grad_rows, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        grad_rows, grad_weight = ctx.saved_tensors
        # grad_loss is 1 for a lone loss, 1 / accumulation steps under DeepSpeed's gradient accumulation.
        if grad_rows is not None:
            grad_rows = grad_rows * grad_loss.to(grad_rows.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_loss.to(grad_weight.dtype)
        return grad_rows, grad_weight, None, None, None


def _chunked(
    rows: Tensor,
    weight: Tensor,
    targets: Tensor,
    scale: Tensor,
    chunk_rows: int,
    want_grad_h: bool,
    want_grad_w: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """rows [N, D], weight [V, D], targets [N] -> (summed loss x scale, its gradient for rows [N, D] in
    their dtype, for weight [V, D] in its dtype); a gradient not wanted is None.

    The logits' gradient is (softmax - one_hot(target)) x scale on rows whose target counts, 0 on ignored
    rows. The [n, V] part, softmax - one_hot, is formed in the rows' dtype; ignored rows are zeroed on
    the [n, D] side of each matmul (a V-th of the work of masking the logits' gradient) and `scale` is
    applied once, in fp32, to the summed gradients.
    """
    total = rows.new_zeros((), dtype=torch.float32)
    grad_rows = torch.empty_like(rows) if want_grad_h else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grad_w else None
    )
    for start in range(0, rows.shape[0], chunk_rows):
        chunk = slice(start, start + chunk_rows)
        x, t = rows[chunk], targets[chunk]
        valid = t != IGNORE_INDEX
        safe_t = torch.where(valid, t, 0).unsqueeze(1)  # [n, 1]
        # fp32 log-probabilities of the low-precision logits (one fused kernel on CUDA, a cast and a
        # kernel on CPU), as F.cross_entropy(logits.float()) computes them.
        log_probs = torch.log_softmax(F.linear(x, weight), dim=1, dtype=torch.float32)  # [n, V]
        target_log_prob = log_probs.gather(1, safe_t)  # [n, 1]
        total = total - torch.where(valid, target_log_prob.squeeze(1), 0.0).sum()
        if grad_rows is None and grad_weight is None:
            continue
        g = _softmax_minus_one_hot(log_probs, safe_t, target_log_prob, rows.dtype)  # [n, V]
        keep = valid.unsqueeze(1).to(rows.dtype)  # [n, 1]: 1, or 0 on ignored rows
        if grad_rows is not None:
            torch.mm(g, weight, out=grad_rows[chunk])  # [n, V] @ [V, D]
            grad_rows[chunk] *= keep
        if grad_weight is not None and g.dtype == torch.float32:
            grad_weight.addmm_(g.t(), x * keep)  # [V, n] @ [n, D]
        elif grad_weight is not None:
            grad_weight += torch.mm(g.t(), x * keep)  # in the rows' dtype, summed over chunks in fp32
    return (
        total * scale,
        None if grad_rows is None else _scaled(grad_rows, scale, rows.dtype),
        None if grad_weight is None else _scaled(grad_weight, scale, weight.dtype),
    )


def _scaled(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """t x scale computed in fp32, rounded once to dtype."""
    return (t.float() * scale).to(dtype)


def _softmax_minus_one_hot(
    log_probs: Tensor, targets: Tensor, target_log_prob: Tensor, dtype: torch.dtype
) -> Tensor:
    """fp32 log-probabilities [n, V] (overwritten) -> softmax - one_hot(targets) [n, V], cast to `dtype`
    once, as autograd casts the fp32 gradient of `logits.float()`. targets [n, 1]."""
    probs = log_probs.exp_()
    rows = torch.arange(probs.shape[0], device=probs.device)
    # index_put_ touches the n target entries only (scatter_ copies the whole tensor twice on CPU).
    probs.index_put_((rows, targets.squeeze(1)), target_log_prob.squeeze(1).exp() - 1)
    return probs.to(dtype)
