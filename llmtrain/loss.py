"""The output layer and cross-entropy, fused: the loss and both of its gradients in one pass of chunks.

A plain `cross_entropy(lm_head(h).float(), labels)` holds the whole logits [N, V] and their fp32 copy (a
128k vocabulary at 8 x 4096 tokens: 16 GiB in fp32) until backward. Checkpointing the loss a chunk of rows
at a time avoids that, but recomputes every chunk's logits in backward: one more output-layer matmul and
softmax per step. Here each chunk's logits are computed once, in the forward pass, and turned at once into
the chunk's loss and its gradients with respect to the hidden states and the output weight (as
Liger-Kernel's fused linear cross-entropy does on GPUs); backward only hands those gradients on. Peak
memory is one chunk's logits (chunk_rows x V) plus the two gradients, and nothing is recomputed.

Under tensor parallelism the output layer is split by vocabulary (Megatron's vocab-parallel
cross-entropy): each rank holds V / tp rows of the weight and computes its chunk's V / tp logits; two
small all-reduces per chunk (the rows' maximum, then their sums of exponentials with the target's logit
from the rank that holds it) give every rank the whole softmax's normaliser, so no rank materialises the
full logits. The hidden states' gradient is then a partial sum per rank, which the tensor-parallel region
(`parallel.tensor.enter`) sums in backward.

Precision follows what autograd does for `lm_head(h).float()` + cross-entropy in bf16: bf16 matmuls,
softmax and loss in fp32, the logits' gradient cast back to bf16 for the two gradient matmuls. The weight's
gradient is summed over the chunks in fp32 (autograd would sum the chunks' bf16 parts in bf16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from llmtrain.parallel import tensor

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
    the weight and reducing its gradient. `tp_group`: set by parallel.tensor.shard, which keeps this
    rank's V / tp rows of the weight.
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.chunk_rows: int | None = None  # None: chunk_rows_for the vocabulary and device
        self.tp_group: Any = None

    def forward(self, h: Tensor, labels: Tensor | None = None, divisor: Tensor | None = None) -> Tensor:
        """h [..., D] -> logits [..., V]; with labels [...] -> the summed loss / divisor (fp32 scalar)."""
        weight = tensor.local(self.weight)  # FSDP2 + tp: a DTensor of this rank's rows (parallel.dtensor_tp)
        return output_layer(h, weight, labels, divisor, self.chunk_rows, self.tp_group)


def output_layer(
    h: Tensor,
    weight: Tensor,
    labels: Tensor | None = None,
    divisor: Tensor | None = None,
    chunk_rows: int | None = None,
    group: Any = None,
) -> Tensor:
    """`OutputLayer.forward` for a given weight (a pipeline's tied output layer passes the embedding's):
    logits [..., V] (gathered from the tp ranks' vocabulary slices under tp), or the fused loss."""
    h = tensor.enter(h, group)
    if labels is not None:
        return linear_cross_entropy(h, weight, labels, divisor, chunk_rows, group)
    return tensor.gather_last_dim(F.linear(h, weight), group)


def label_count(labels: Tensor) -> Tensor:
    # A batch whose labels are all ignored has loss 0 (and zero gradients) rather than NaN.
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    divisor: Tensor | None = None,
    chunk_rows: int | None = None,
    group: Any = None,
) -> Tensor:
    """Summed cross-entropy of h @ weight.T against labels, divided by `divisor` (default: the number of
    labels not ignored, so the mean). h [..., D], weight [V, D], labels [...] -> fp32 scalar.

    Sequence parallelism passes the whole sequences' label count as divisor for its slice's share.
    `group`: the tensor-parallel group over whose ranks the vocabulary is split (`weight` is this rank's
    V / tp rows, in rank order); the loss is then the whole vocabulary's on every rank.
    """
    rows, targets = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    chunk_rows = chunk_rows or chunk_rows_for(weight.shape[0], weight.device)
    scale = 1.0 / (label_count(labels) if divisor is None else divisor).float()
    vocab = _VocabSlice.of(weight, group)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        loss: Tensor = _FusedLinearCrossEntropy.apply(rows, weight, targets, scale, chunk_rows, vocab)
        return loss
    return _chunked(rows, weight, targets, scale, chunk_rows, vocab, want_grad_h=False, want_grad_w=False)[0]


class _VocabSlice:
    """The vocabulary rows one rank's output weight holds: [start, start + size) of the whole, and the
    tensor-parallel group holding the rest (None: the whole vocabulary, on one rank)."""

    def __init__(self, start: int, size: int, group: Any) -> None:
        self.start, self.size, self.group = start, size, group

    @classmethod
    def of(cls, weight: Tensor, group: Any) -> _VocabSlice:
        size = weight.shape[0]
        return cls(0 if group is None else dist.get_rank(group) * size, size, group)

    def log_softmax(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """logits [n, V / tp] (this rank's columns), targets [n, 1] (whole-vocabulary ids) -> fp32
        log-probabilities of this rank's columns [n, V / tp], every row's target log-probability [n, 1],
        the targets as this rank's column indices [n, 1] and which rows' targets this rank holds [n]
        (None: all)."""
        if self.group is None:
            log_probs = torch.log_softmax(logits, dim=1, dtype=torch.float32)
            return log_probs, log_probs.gather(1, targets), targets, None
        z = logits.float()
        row_max = z.amax(dim=1, keepdim=True)  # the shift cancels in the softmax: no gradient flows here
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)
        z -= row_max
        local = targets - self.start
        owned = (local >= 0) & (local < self.size)  # [n, 1]
        local = torch.where(owned, local, 0)
        # One all-reduce for both sums: each row's sum of exponentials, and its target's shifted logit
        # (0 on the ranks that do not hold the target).
        sums = torch.stack([z.exp().sum(dim=1), torch.where(owned, z.gather(1, local), 0.0).squeeze(1)])
        dist.all_reduce(sums, group=self.group)
        log_normaliser = sums[0].log().unsqueeze(1)  # [n, 1]
        return z.sub_(log_normaliser), sums[1].unsqueeze(1) - log_normaliser, local, owned.squeeze(1)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk; backward scales and returns them."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: Tensor,
        weight: Tensor,
        targets: Tensor,
        scale: Tensor,
        chunk_rows: int,
        vocab: _VocabSlice,
    ) -> Tensor:
        want_grad_h, want_grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_rows, grad_weight = _chunked(
            rows, weight, targets, scale, chunk_rows, vocab, want_grad_h, want_grad_w
        )
        ctx.save_for_backward(grad_rows, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        grad_rows, grad_weight = ctx.saved_tensors
        # grad_loss is 1 for a lone loss, 1 / accumulation steps under DeepSpeed's gradient accumulation.
        if grad_rows is not None:
            grad_rows = grad_rows * grad_loss.to(grad_rows.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_loss.to(grad_weight.dtype)
        return grad_rows, grad_weight, None, None, None, None


def _chunked(
    rows: Tensor,
    weight: Tensor,
    targets: Tensor,
    scale: Tensor,
    chunk_rows: int,
    vocab: _VocabSlice,
    want_grad_h: bool,
    want_grad_w: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """rows [N, D], weight [V, D], targets [N] -> (summed loss x scale, its gradient for rows [N, D] in
    their dtype, for weight [V, D] in its dtype); a gradient not wanted is None. Under a vocabulary split
    `weight` is [V / tp, D] and the rows' gradient this rank's part of the sum.

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
        log_probs, target_log_prob, local_t, owned = vocab.log_softmax(F.linear(x, weight), safe_t)
        total = total - torch.where(valid, target_log_prob.squeeze(1), 0.0).sum()
        if grad_rows is None and grad_weight is None:
            continue
        g = _softmax_minus_one_hot(log_probs, local_t, target_log_prob, rows.dtype, owned)  # [n, V]
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
    log_probs: Tensor,
    targets: Tensor,
    target_log_prob: Tensor,
    dtype: torch.dtype,
    owned: Tensor | None = None,
) -> Tensor:
    """fp32 log-probabilities [n, V] (overwritten) -> softmax - one_hot(targets) [n, V], cast to `dtype`
    once, as autograd casts the fp32 gradient of `logits.float()`. targets [n, 1]; `owned` [n]: the rows
    whose target is among these columns (None: all)."""
    probs = log_probs.exp_()
    rows = torch.arange(probs.shape[0], device=probs.device)
    if owned is not None:
        rows, targets, target_log_prob = rows[owned], targets[owned], target_log_prob[owned]
    # index_put_ touches the n target entries only (scatter_ copies the whole tensor twice on CPU).
    probs.index_put_((rows, targets.view(-1)), target_log_prob.view(-1).exp() - 1)
    return probs.to(dtype)
