"""The fast paths exist and leave results unchanged (issue 7).

Covered elsewhere, not repeated here:
- chunked cross-entropy equals plain cross-entropy, loss and gradients:
  tests/test_model.py::test_chunked_loss_equals_plain_cross_entropy_and_gradients_match;
- compiled blocks (--compile) equal eager, loss and gradients:
  tests/test_model.py::test_compiled_blocks_trace_without_graph_breaks_and_match_eager (and the slow
  Inductor variant test_inductor_compiled_blocks_match_eager);
- the document mask equals plain causal attention when there is one document:
  tests/test_model.py::test_single_document_mask_equals_plain_causal_attention_in_a_batch;
- MFU omitted on CPU: tests/test_metrics.py::test_no_peak_and_no_mfu_on_cpu;
- data loading overlapped with compute (the loader's prefetch thread): tests/test_data_dataset.py.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.config import ModelConfig, resolve
from llmtrain.model import build_model, sdpa
from llmtrain.presets import PRESETS

SEQ = 48  # differs from every dimension of the debug preset, so a [SEQ, SEQ] tensor is the mask


def debug_cfg(**overrides: Any) -> ModelConfig:
    return ModelConfig(**{**PRESETS["debug"], **overrides})


def batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=g)
    return ids, torch.randint(0, cfg.vocab_size, (2, SEQ), generator=g)


class FlashCalls(TorchDispatchMode):
    """Records the CPU flash-attention kernels' calls: forward and backward, with their arguments."""

    FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[dict[str, Any]] = []
        self.backward: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is self.FORWARD:
            q, k = args[0], args[1]
            self.forward.append(
                {
                    "q_heads": q.shape[1],
                    "kv_heads": k.shape[1],
                    "dtype": q.dtype,
                    "is_causal": args[4],
                    **kwargs,
                }
            )
        elif func is self.BACKWARD:
            self.backward.append({"dtype": args[1].dtype, "is_causal": args[7], **kwargs})
        return func(*args, **kwargs)


class SquareTensors(TorchDispatchMode):
    """Records every op output whose last two dimensions are [SEQ, SEQ] (an attention mask or scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and tuple(t.shape[-2:]) == (SEQ, SEQ):
                self.seen.append(f"{func}: {tuple(t.shape)}")
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_causal_training_materializes_no_mask_and_shares_kv_heads(dtype: torch.dtype) -> None:
    """One flash forward and one backward per layer (no recompute), causal without a mask tensor, K/V
    heads shared by their query group; in bf16 the forward in bf16, the backward in fp32 (CPU's fastest)."""
    cfg = debug_cfg()
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # the preset is GQA
    model = build_model(cfg, seed=0).to(dtype)
    ids, labels = batch(cfg)
    with FlashCalls() as calls, SquareTensors() as squares:
        model(ids, labels=labels).backward()
    assert len(calls.forward) == len(calls.backward) == cfg.num_hidden_layers
    for call in calls.forward:
        assert call.get("attn_mask") is None and call["is_causal"] is True and call["dtype"] == dtype
        # the kernel reads each K/V head for its query group; K/V are not repeated
        assert (call["q_heads"], call["kv_heads"]) == (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert all(call["dtype"] == torch.float32 and call["is_causal"] for call in calls.backward)
    assert squares.seen == []  # no [T, T] mask or score matrix anywhere in forward or backward


def test_gqa_without_repeated_kv_equals_mha_with_repeated_kv_weights() -> None:
    """The straightforward path: an MHA model whose K/V projections repeat each GQA head."""
    gqa_cfg = debug_cfg()
    group = gqa_cfg.num_attention_heads // gqa_cfg.num_key_value_heads
    mha_cfg = debug_cfg(num_key_value_heads=gqa_cfg.num_attention_heads)
    gqa, mha = build_model(gqa_cfg, seed=0), build_model(mha_cfg, seed=1)
    state = gqa.state_dict()
    for name, tensor in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            heads = tensor.reshape(gqa_cfg.num_key_value_heads, gqa_cfg.head_width, -1)
            state[name] = heads.repeat_interleave(group, dim=0).reshape(-1, tensor.shape[-1])
    mha.load_state_dict(state)
    ids, labels = batch(gqa_cfg)
    gqa_loss, mha_loss = gqa(ids, labels=labels), mha(ids, labels=labels)
    gqa_loss.backward()
    mha_loss.backward()
    assert abs(gqa_loss.item() - mha_loss.item()) <= 1e-5
    mha_params = dict(mha.named_parameters())
    for name, p in gqa.named_parameters():
        if "k_proj" in name or "v_proj" in name:
            continue  # different shapes: each GQA head's gradient is the sum over its group
        torch.testing.assert_close(p.grad, mha_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_bf16_attention_forward_is_the_bf16_kernel_and_backward_is_at_least_as_exact() -> None:
    """On CPU, bf16 attention runs the flash kernel's forward in bf16 (its output is the plain bf16 call's,
    bit for bit) and its backward in fp32 (faster there): gradients no further from the fp32 truth than
    the bf16 backward's, and backward keeps only bf16 tensors and the fp32 log-sum-exp, no fp32 copies."""
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (2, 4, SEQ, 16), (2, 2, SEQ, 16)
    q, k, v = (torch.randn(s, generator=g).bfloat16().requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    def grads(attention: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_() for t in inputs]
        attention(*leaves, is_causal=True, enable_gqa=True).float().square().sum().backward()
        return [t.grad for t in leaves]  # type: ignore[misc]

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fast = sdpa(q, k, v, is_causal=True)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert fast.dtype == torch.bfloat16 and torch.equal(fast, plain)
    assert all(t.dtype == torch.bfloat16 for t in saved if t.ndim == 4)

    def ours(*inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return sdpa(*inputs, is_causal=True)

    truth = grads(F.scaled_dot_product_attention, q.float(), k.float(), v.float())
    for got, bf16, want in zip(
        grads(ours, q, k, v), grads(F.scaled_dot_product_attention, q, k, v), truth, strict=True
    ):
        assert (got.float() - want).norm() <= (bf16.float() - want).norm()


def test_cpu_bf16_model_loss_is_the_bf16_attention_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = debug_cfg()
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    ids, labels = batch(cfg)
    fast = model(ids, labels=labels).item()
    import llmtrain.model as model_module

    # the straightforward path
    monkeypatch.setattr(
        model_module, "sdpa", functools.partial(F.scaled_dot_product_attention, enable_gqa=True)
    )
    plain = model(ids, labels=labels).item()
    assert fast == plain


# ---------------------------------------------------------------- host-device synchronisation

_PACKAGE = Path(resolve.__code__.co_filename).parent  # the llmtrain package directory
_HOST_READS = {"item", "tolist", "__float__", "__bool__", "__int__", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts tensor-to-host reads (each one a synchronisation on a GPU) made by llmtrain's own code,
    by `module.function` (DeepSpeed's internal reads are its own business and not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if getattr(func, "__name__", "") in _HOST_READS:
            code = sys._getframe(1).f_code
            path = Path(code.co_filename)
            if _PACKAGE in path.parents:
                self.where[f"{path.stem}.{code.co_name}"] += 1
        return func(*args, **(kwargs or {}))


def _count_host_reads(rank: int, world_size: int, run_dir: str) -> list[dict[str, int]]:
    from llmtrain.parallel import distributed
    from llmtrain.train.trainer import build_trainer

    cfg = resolve(
        flags={
            "preset": "debug",
            "train.seq_len": 32,
            "train.micro_batch": 2,
            "train.global_batch": 2 * 3 * world_size,  # 3 micro-batches per optimizer step
            "train.precision": "bf16",
            "zero.stage": 1,
            "train.steps": 3,
            "launch.gpus": world_size,
        }
    )
    world = distributed.World(rank, rank, world_size, "cpu", world_size)
    trainer = build_trainer(cfg, world, Path(run_dir), resume=False)
    per_step = []
    for _ in range(3):
        micro_batches = trainer.loader.next_step()
        with HostReads() as reads:
            result = trainer.train_step(micro_batches)
        trainer.counters.step += 1
        trainer.guard.record(result.loss, result.grad_norm, result.verdict)
        per_step.append(dict(reads.where))
    trainer.loader.close()
    return per_step


@pytest.mark.slow
def test_one_agreement_read_per_optimizer_step_not_per_micro_batch(tmp_path: Path) -> None:
    """The trainer reads the device once to agree (loss, save, stop) across 3 micro-batches and 2 ranks,
    and once for the grad norm the stability guard judges; nothing else in the step."""
    from dist import run_distributed

    per_rank = run_distributed(_count_host_reads, 2, str(tmp_path), timeout=300)
    for steps in per_rank:
        assert steps == [{"trainer._agree": 1, "ds_engine._engine_grad_norm": 1}] * 3
