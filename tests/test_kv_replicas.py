"""Key/value heads replicated when tp exceeds them (planning.partition's rule): tp 4 over the debug
preset's 2 key/value heads, 4 gloo processes, against the same model whole in each process.

Each rank keeps the head its query heads read (rank r: head r // 2); the loss, every norm's gradient
(which sums the q, k and v projections' input gradients over the tp group) and each copy's key/value
weight gradient equal the whole model's, the copies of one head hold equal gradients, and only the
first copy carries DeepSpeed's mark, so the gradient norm counts each head once. About 10 s on 2 cores;
training at tp 4 against one process is in test_parallel.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist import run_distributed

from llmtrain.config import resolve
from llmtrain.planning import partition
from llmtrain.planning.memory.activations import layer_activation_bytes

TP, KV_HEADS = 4, 2


def _replicated(rank: int, world_size: int) -> dict[str, Any]:
    from llmtrain.model import Llama
    from llmtrain.parallel import tensor
    from llmtrain.parallel.mesh import Mesh
    from llmtrain.planning.layout import Layout

    cfg = resolve(flags={"preset": "debug"}).model
    assert cfg.num_key_value_heads == KV_HEADS
    torch.manual_seed(0)
    whole = Llama(cfg)
    split = copy.deepcopy(whole)
    tensor.shard_over(split, Mesh.build(Layout(world_size, tp=world_size), rank), cfg.num_key_value_heads)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (whole, split):
        loss = model(input_ids=ids, labels=ids)
        loss.backward()
        losses.append(loss.item())
    attention, whole_attention = split.layers[0].self_attn, whole.layers[0].self_attn
    return {
        "losses": losses,
        "norm_grads": [(w.grad, s.grad) for w, s in zip(_norms(whole), _norms(split), strict=True)],
        "k": attention.k_proj.weight.detach().clone(),
        "k_grad": attention.k_proj.weight.grad,
        "v_grad": attention.v_proj.weight.grad,
        "whole_k": whole_attention.k_proj.weight.detach().clone(),
        "whole_k_grad": whole_attention.k_proj.weight.grad,
        "whole_v_grad": whole_attention.v_proj.weight.grad,
        "marked": attention.k_proj.weight.tensor_model_parallel,
    }


def _norms(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if name.endswith("layernorm.weight")]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_replicated, TP)


def test_each_rank_holds_the_head_its_query_heads_read(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(ranks):
        assert torch.equal(got["k"], got["whole_k"].chunk(KV_HEADS)[rank // (TP // KV_HEADS)])
    assert [got["marked"] for got in ranks] == [True, False, True, False]


def test_loss_and_gradients_equal_the_whole_models(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(ranks):
        whole_loss, split_loss = got["losses"]
        assert split_loss == pytest.approx(whole_loss, rel=1e-6)
        for whole_grad, split_grad in got["norm_grads"]:
            torch.testing.assert_close(split_grad, whole_grad, rtol=1e-5, atol=1e-7)
        head = rank // (TP // KV_HEADS)
        for key in ("k_grad", "v_grad"):
            torch.testing.assert_close(
                got[key], got[f"whole_{key}"].chunk(KV_HEADS)[head], rtol=1e-5, atol=1e-7
            )
    for first, second in zip(ranks[::2], ranks[1::2], strict=True):  # the copies of one head
        assert torch.equal(first["k_grad"], second["k_grad"]) and torch.equal(
            first["v_grad"], second["v_grad"]
        )


def test_the_estimator_counts_one_head_per_rank() -> None:
    cfg = resolve(flags={"preset": "debug"}).model
    k_proj = next(s for s in partition.block_tensors(cfg) if s.name.endswith("k_proj.weight"))
    assert k_proj.per_rank(2) == k_proj.numel // 2  # split while tp divides the heads
    assert k_proj.per_rank(TP) == k_proj.per_rank(8) == k_proj.numel // KV_HEADS  # then one whole head
    # Activations: from tp 2 to tp 4 what is split (q, SDPA's output and log-sum-exp, the MLP's four
    # tensors) halves again, while k and v stay one head's columns per rank.
    fp32, tokens, d = 4, 2 * 64, cfg.hidden_size
    at = {tp: layer_activation_bytes(cfg, 2, 64, "fp32", False, tp=tp) for tp in (2, 4)}
    split = (
        fp32 * tokens * 2 * d
        + fp32 * tokens * cfg.num_attention_heads
        + 4 * fp32 * tokens * cfg.intermediate_size
    )
    assert at[2] - at[4] == split // 2 - split // 4
