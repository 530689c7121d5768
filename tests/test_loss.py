"""The fused output layer + cross-entropy against plain autograd: values and gradients, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.loss import IGNORE_INDEX, OutputLayer, linear_cross_entropy

N, D, V = 53, 24, 97  # 53 rows in chunks of 16: the last chunk ragged


def inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:7] = IGNORE_INDEX
    labels[-2:] = IGNORE_INDEX
    return h, weight, labels


def plain(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a training script writes: whole logits, upcast, F.cross_entropy."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=IGNORE_INDEX)


def loss_and_grads(loss_fn, h, weight, labels, scale: float = 1.0):  # type: ignore[no-untyped-def]
    h, weight = h.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = loss_fn(h, weight, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, weight.grad


def fused(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(h, weight, labels, chunk_rows=16)


def test_fp32_loss_and_gradients_equal_plain_cross_entropy() -> None:
    h, weight, labels = inputs(torch.float32)
    ours, theirs = loss_and_grads(fused, h, weight, labels), loss_and_grads(plain, h, weight, labels)
    assert ours[0].dtype == torch.float32 and ours[0].ndim == 0
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-5, atol=1e-5)
    assert ours[1][:7].abs().max() == 0 and ours[1][-2:].abs().max() == 0  # ignored rows get nothing


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_loss_is_autograds_and_gradients_are_as_close_to_the_fp32_truth(seed: int) -> None:
    """In bf16 the loss is autograd's (fp32 log-softmax of the bf16 logits) to fp32 rounding; each gradient
    is within bf16 rounding of the fp32 truth, its error no more than 1.25x that of autograd's own bf16
    gradient (one rounding sits elsewhere: the mean's scale is applied to the summed gradients)."""
    h, weight, labels = inputs(torch.bfloat16, seed)
    ours, theirs = loss_and_grads(fused, h, weight, labels), loss_and_grads(plain, h, weight, labels)
    truth = loss_and_grads(plain, h.float(), weight.float(), labels)
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-6, atol=2e-6)
    for index, name in ((1, "hidden states"), (2, "weight")):
        ours_error = (ours[index].float() - truth[index]).norm()
        autograd_error = (theirs[index].float() - truth[index]).norm()
        assert ours_error <= 1.25 * autograd_error, name
        assert ours_error <= 2**-7 * truth[index].norm(), name  # a few of bf16's roundings (2**-8 each)


def test_output_layer_fused_loss_with_tied_weight_equals_plain_loss_through_the_embedding() -> None:
    """Tied embeddings: one Parameter is the embedding and the output weight; its gradient gets both parts."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(V, D)
    head = OutputLayer(D, V)
    head.weight = embedding.weight
    head.chunk_rows = 16
    ids = torch.randint(0, V, (N,))
    labels = ids.roll(-1)
    fused_loss = head(torch.tanh(embedding(ids)), labels)
    fused_loss.backward()
    fused_grad = embedding.weight.grad.clone()
    embedding.weight.grad = None
    plain_loss = plain(torch.tanh(embedding(ids)), embedding.weight, labels)
    plain_loss.backward()
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, embedding.weight.grad, rtol=1e-5, atol=1e-6)


def test_upstream_gradient_scales_both_gradients() -> None:
    """DeepSpeed's gradient accumulation scales the loss (1 / steps) before backward."""
    h, weight, labels = inputs(torch.float32)
    once, thrice = (
        loss_and_grads(fused, h, weight, labels),
        loss_and_grads(fused, h, weight, labels, scale=3.0),
    )
    torch.testing.assert_close(thrice[1], 3 * once[1])
    torch.testing.assert_close(thrice[2], 3 * once[2])


def test_divisor_replaces_the_label_count() -> None:
    """Sequence parallelism divides a slice's summed loss by the whole sequences' label count."""
    h, weight, labels = inputs(torch.float32)
    summed = F.cross_entropy(F.linear(h, weight), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    got = linear_cross_entropy(h, weight, labels, divisor=torch.tensor(100), chunk_rows=16)
    torch.testing.assert_close(got, summed / 100)


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_only_the_gradients_asked_for_are_computed(frozen: str) -> None:
    h, weight, labels = inputs(torch.float32)
    h, weight = (
        h.detach().requires_grad_(frozen != "hidden"),
        weight.detach().requires_grad_(frozen != "weight"),
    )
    fused(h, weight, labels).backward()
    assert (h.grad is None) == (frozen == "hidden") and (weight.grad is None) == (frozen == "weight")


def test_without_grad_the_loss_is_the_same_and_nothing_is_attached() -> None:
    h, weight, labels = inputs(torch.float32)
    with torch.no_grad():
        value = fused(h, weight, labels)
    assert value.grad_fn is None
    torch.testing.assert_close(value, plain(h, weight, labels).detach(), rtol=1e-5, atol=1e-5)


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients() -> None:
    h, weight, _ = inputs(torch.float32)
    loss, grad_h, grad_w = loss_and_grads(fused, h, weight, torch.full((N,), IGNORE_INDEX))
    assert loss.item() == 0.0 and grad_h.abs().max() == 0 and grad_w.abs().max() == 0


# ---------------------------------------------------------------- vocab-parallel (2 gloo processes, ~5 s)


def _vocab_parallel(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's half of the vocabulary (V = 98 rows: 49 each) through the tensor-parallel output
    layer and embedding: the loss, the hidden states' gradient (summed over the ranks by the region's
    entry), this rank's weight rows' gradient, the gathered logits and an embedding lookup."""
    import torch.distributed as dist

    from llmtrain.loss import output_layer
    from llmtrain.parallel import tensor

    group = dist.new_group([0, 1])
    h, weight, labels = inputs(torch.float32)
    weight = torch.cat([weight, weight[:1]]).detach()  # 98 rows: an even split
    mine = weight.chunk(world_size)[rank].clone().requires_grad_()
    h = h.detach().requires_grad_()
    loss = output_layer(h, mine, labels, chunk_rows=16, group=group)
    loss.backward()
    ids = torch.tensor([[0, 48, 49, 97, 5]])
    return {
        "loss": loss.detach(),
        "grad_h": h.grad,
        "grad_rows": mine.grad,
        "logits": output_layer(h.detach()[:3], mine.detach(), group=group),
        "embedded": tensor.embed(ids, mine.detach(), group),
    }


def test_the_vocab_parallel_loss_and_embedding_equal_the_whole_vocabularys() -> None:
    """Targets on both ranks' halves, ignored rows and a ragged last chunk: every rank's loss, the
    summed hidden-state gradient and each rank's weight-row gradients are the one-process ones."""
    from dist import run_distributed

    h, weight, labels = inputs(torch.float32)
    weight = torch.cat([weight, weight[:1]]).detach()
    loss, grad_h, grad_w = loss_and_grads(fused, h, weight, labels)
    assert {int(t) // 49 for t in labels if t != IGNORE_INDEX} == {0, 1}
    ranks = run_distributed(_vocab_parallel, 2)
    for rank, out in enumerate(ranks):
        torch.testing.assert_close(out["loss"], loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(out["grad_h"], grad_h, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["grad_rows"], grad_w.chunk(2)[rank], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["logits"], F.linear(h.detach()[:3], weight))
        torch.testing.assert_close(out["embedded"], F.embedding(torch.tensor([[0, 48, 49, 97, 5]]), weight))
