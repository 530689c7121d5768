"""The Llama model: numbers against Hugging Face, presets, masking, chunked loss, checkpointing, compile."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from llmtrain.config import ModelConfig
from llmtrain.loss import IGNORE_INDEX
from llmtrain.model import (
    Block,
    Llama,
    RMSNorm,
    apply_rope,
    build_model,
    checkpointed_blocks,
    num_parameters,
    rotate_half,
)
from llmtrain.presets import PRESETS, count_parameters


def small(**overrides: object) -> ModelConfig:
    """The debug preset with overrides."""
    return dataclasses.replace(ModelConfig(**PRESETS["debug"]), **overrides)


def randomise_norms(model: Llama, seed: int) -> None:
    """Norm weights start at 1; make them distinct so a swapped norm would show in a comparison."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))


def hf_model_with_our_weights(model: Llama, cfg: ModelConfig) -> LlamaForCausalLM:
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="eager",
    )
    hf = LlamaForCausalLM(hf_cfg).float().eval()
    ours = model.state_dict()
    hf_state = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in ours.items()}
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert unexpected == []
    assert missing == (["lm_head.weight"] if cfg.tie_word_embeddings else [])
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_heads=4),  # multi-head attention
        dict(num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-6),  # grouped-query attention
        dict(num_key_value_heads=1, tie_word_embeddings=True),  # multi-query, tied embeddings
    ],
    ids=["mha", "gqa", "mqa-tied"],
)
def test_logits_and_loss_match_hugging_face(overrides: dict[str, object]) -> None:
    cfg = small(**overrides)
    model = build_model(cfg, seed=1).eval()
    randomise_norms(model, seed=2)
    hf = hf_model_with_our_weights(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
        assert ours.shape == (2, 37, cfg.vocab_size)
        assert ours.abs().max() > 0.05  # not a degenerate comparison of near-zero logits
        assert (ours - theirs).abs().max().item() <= 1e-5

        # Hugging Face shifts labels inside; ours are already shifted (label t is the token after t).
        shifted = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
        assert abs(model(ids, labels=shifted).item() - hf(ids, labels=ids).loss.item()) <= 1e-5


def test_parameter_names_are_hugging_faces_without_model_prefix() -> None:
    cfg = small()
    ours = set(build_model(cfg, device="meta").state_dict())
    hf_names = set(hf_model_with_our_weights(build_model(cfg, seed=0), cfg).state_dict())
    assert {k if k == "lm_head.weight" else f"model.{k}" for k in ours} == hf_names
    assert not any("bias" in k for k in ours)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count_matches_built_model(name: str) -> None:
    cfg = ModelConfig(**PRESETS[name])
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert (
        num_parameters(model)
        == sum(p.numel() for p in model.parameters())
        == count_parameters(**PRESETS[name])
    )


def test_debug_and_tiny_sizes() -> None:
    debug = num_parameters(build_model(ModelConfig(**PRESETS["debug"]), device="meta"))
    tiny = num_parameters(build_model(ModelConfig(**PRESETS["tiny"]), device="meta"))
    assert debug < 1_000_000 / 4  # "well under 1M": a forward pass in milliseconds
    # presets.py calls tiny "about 10M" (9,998,592 today).
    assert 10_000_000 <= tiny <= 20_000_000


def test_tied_embeddings_share_one_parameter_and_store_it_once() -> None:
    cfg = small(tie_word_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.lm_head.weight is model.embed_tokens.weight
    state = model.state_dict()
    assert "lm_head.weight" not in state and "embed_tokens.weight" in state
    assert num_parameters(model) == count_parameters(**dataclasses.asdict(cfg))

    other = build_model(cfg, seed=1)
    other.load_state_dict(state)  # strict, without lm_head.weight
    assert torch.equal(other.lm_head.weight, state["embed_tokens.weight"])
    assert other.lm_head.weight is other.embed_tokens.weight
    other.load_state_dict({**state, "lm_head.weight": torch.zeros_like(state["embed_tokens.weight"])})
    assert torch.equal(other.lm_head.weight, state["embed_tokens.weight"])  # the tie wins


# ---------------------------------------------------------------- initialisation


def test_same_seed_same_weights_and_meta_build_materialises_identically() -> None:
    cfg = small(tie_word_embeddings=True)
    a = build_model(cfg, seed=7).state_dict()
    b = build_model(cfg, seed=7).state_dict()
    c = build_model(cfg, seed=8).state_dict()
    meta = build_model(cfg, device="meta", seed=7)
    assert all(p.is_meta for p in meta.parameters())
    meta.init_weights()
    assert meta.lm_head.weight is meta.embed_tokens.weight  # the tie survives materialisation
    assert all(not p.is_meta for p in meta.parameters())
    for key in a:
        assert torch.equal(a[key], b[key]), key
        assert torch.equal(a[key], meta.state_dict()[key]), key
    assert not torch.equal(a["layers.0.self_attn.q_proj.weight"], c["layers.0.self_attn.q_proj.weight"])


def test_initialisation_statistics() -> None:
    cfg = small(num_hidden_layers=4)
    model = build_model(cfg, seed=0)
    std = cfg.initializer_range
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        expected = (
            std / math.sqrt(2 * cfg.num_hidden_layers) if "o_proj" in name or "down_proj" in name else std
        )
        assert abs(p.float().std().item() - expected) < 0.1 * expected, name
        assert abs(p.float().mean().item()) < 0.1 * expected, name


# ---------------------------------------------------------------- hand-written backward passes


def test_rmsnorm_and_rope_backward_pass_gradcheck_in_float64() -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(6, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(6, generator=g, dtype=torch.float64) + 0.5)
    x = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = norm.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), (x, weight)
    )
    cos, sin = torch.randn(2, 1, 3, 8, generator=g, dtype=torch.float64).unbind(0)  # [B, T, Hd]
    q = torch.randn(1, 3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)  # [B, T, heads, Hd]
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (q,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_rope_equal_autograd_of_their_expressions(dtype: torch.dtype) -> None:
    """Forward bit for bit, gradients within rounding of autograd through Hugging Face's expressions."""
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(2, 16, 64, generator=g).to(dtype).requires_grad_()
    cos, sin = torch.randn(2, 2, 16, 32, generator=g).to(dtype).unbind(0)
    up = torch.randn(2, 16, 64, generator=g).to(dtype)

    def reference(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        q = normed.view(2, 16, 2, 32)
        return q * cos[:, :, None] + rotate_half(q) * sin[:, :, None]

    ours = apply_rope(norm(x).view(2, 16, 2, 32), cos, sin)
    theirs = reference(x)
    assert torch.equal(ours, theirs)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    grads = torch.autograd.grad((ours.reshape(2, 16, 64) * up).sum(), (x, norm.weight))
    want = torch.autograd.grad((theirs.reshape(2, 16, 64) * up).sum(), (x, norm.weight))
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, **tol)


# ---------------------------------------------------------------- loss


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_loss_equals_plain_cross_entropy_and_gradients_match(tied: bool) -> None:
    cfg = small(tie_word_embeddings=tied)
    model = build_model(cfg, seed=0)
    model.lm_head.chunk_rows = 7  # many chunks, the last one ragged
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 29), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (3, 29), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[2, -3:] = IGNORE_INDEX

    fused = model(ids, labels=labels)
    fused.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    logits = model(ids)
    plain = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1), ignore_index=-100)
    plain.backward()

    assert fused.dtype == torch.float32 and fused.ndim == 0
    assert abs(fused.item() - plain.item()) <= 1e-6
    assert len(fused_grads) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(fused_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_loss_of_fully_ignored_labels_is_zero_not_nan() -> None:
    model = build_model(small(), seed=0)
    ids = torch.randint(0, 512, (2, 8))
    assert model(ids, labels=torch.full_like(ids, IGNORE_INDEX)).item() == 0.0


def test_bf16_loss_is_fp32_scalar() -> None:
    model = build_model(small(), seed=0).to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 16))
    loss = model(ids, labels=ids)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    assert model(ids).dtype == torch.bfloat16


# ---------------------------------------------------------------- document masking


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_documents_do_not_see_each_other_and_positions_restart(kv_heads: int) -> None:
    cfg = small(num_key_value_heads=kv_heads)
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
    second = torch.randint(0, cfg.vocab_size, (1, 14), generator=g)
    packed = torch.cat([first, second], dim=1)
    doc_ids = torch.tensor([[0] * 9 + [1] * 14])
    with torch.no_grad():
        masked = model(packed, doc_ids=doc_ids)
        alone_first, alone_second = model(first), model(second)
        unmasked = model(packed)
    assert (masked[:, :9] - alone_first).abs().max().item() <= 1e-5
    assert (masked[:, 9:] - alone_second).abs().max().item() <= 1e-5
    # Without doc_ids the second document attends to the first and sits at positions 9..22.
    assert (unmasked[:, 9:] - alone_second).abs().max().item() > 1e-3


def test_single_document_mask_equals_plain_causal_attention_in_a_batch() -> None:
    cfg = small(num_key_value_heads=2)
    model = build_model(cfg, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        plain = model(ids)
        masked = model(ids, doc_ids=torch.full_like(ids, 5))
        explicit = model(ids, position_ids=torch.arange(17))
    assert (plain - masked).abs().max().item() <= 1e-5
    assert torch.equal(plain, explicit)


def test_repeated_document_ids_later_in_the_row_are_separate_documents() -> None:
    model = build_model(small(), seed=0).eval()
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, 512, (1, n), generator=g) for n in (4, 5, 6))
    packed = torch.cat([a, b, c], dim=1)
    doc_ids = torch.tensor([[3] * 4 + [8] * 5 + [3] * 6])  # the third run reuses the first id
    with torch.no_grad():
        assert (model(packed, doc_ids=doc_ids)[:, 9:] - model(c)).abs().max().item() <= 1e-5


def test_doc_ids_and_position_ids_together_are_refused() -> None:
    model = build_model(small(), seed=0)
    ids = torch.randint(0, 512, (1, 4))
    with pytest.raises(ValueError, match="doc_ids or position_ids"):
        model(ids, doc_ids=torch.zeros_like(ids), position_ids=torch.arange(4))


# ---------------------------------------------------------------- activation checkpointing and compile


def loss_and_grads(model: Llama, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids.roll(-1, dims=1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointed_blocks() -> None:
    assert checkpointed_blocks(5, "none") == []
    assert checkpointed_blocks(5, "full") == [0, 1, 2, 3, 4]
    assert checkpointed_blocks(5, "selective", every_k=2) == [0, 2, 4]
    assert checkpointed_blocks(5, "selective", every_k=3) == [0, 3]
    with pytest.raises(ValueError, match="none, full or selective"):
        checkpointed_blocks(5, "some")


def test_activation_checkpointing_gives_identical_loss_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small(num_hidden_layers=3)
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    # Count Block.forward calls per block (module hooks do not fire during checkpoint recomputation).
    index = {id(block): i for i, block in enumerate(model.layers)}
    calls = [0] * cfg.num_hidden_layers
    original_forward = Block.forward

    def counting_forward(self: Block, *args: torch.Tensor | None) -> torch.Tensor:
        calls[index[id(self)]] += 1
        return original_forward(self, *args)

    monkeypatch.setattr(Block, "forward", counting_forward)

    results = {}
    for mode, expected_calls in (("none", [1, 1, 1]), ("full", [2, 2, 2]), ("selective", [2, 1, 2])):
        model.set_activation_checkpointing(mode, every_k=2)
        calls[:] = [0] * cfg.num_hidden_layers
        results[mode] = loss_and_grads(model, ids)
        assert calls == expected_calls, mode  # a checkpointed block runs again in backward

    base_loss, base_grads = results["none"]
    for mode in ("full", "selective"):
        loss, grads = results[mode]
        assert loss == base_loss, mode
        assert grads.keys() == base_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], base_grads[name], rtol=0, atol=1e-7, msg=name)


def check_compiled_blocks_match_eager(**compile_kwargs: object) -> None:
    cfg = small()
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grads = loss_and_grads(model, ids)
    model.compile_blocks(fullgraph=True, **compile_kwargs)  # fullgraph: a graph break is an error
    compiled_loss, compiled_grads = loss_and_grads(model, ids)
    assert set(model.state_dict()) == set(build_model(cfg, device="meta").state_dict())  # names unchanged
    assert abs(compiled_loss - eager_loss) <= 1e-5
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_blocks_trace_without_graph_breaks_and_match_eager() -> None:
    # Dynamo capture + AOT autograd, without Inductor's C++ code generation: seconds instead of minutes.
    check_compiled_blocks_match_eager(backend="aot_eager")


@pytest.mark.slow
def test_inductor_compiled_blocks_match_eager() -> None:
    # The real `--compile` path (Inductor, C++ kernels via gcc): 1-2 minutes on a cold cache with 2 cores.
    check_compiled_blocks_match_eager()


@pytest.mark.slow
def test_compiled_elementwise_parts_match_eager_in_fp32_and_bf16() -> None:
    """ZeRO 3's --compile: RMSNorm, RoPE and SwiGLU's product through Inductor, the rest eager."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        cfg = small()
        model = build_model(cfg, seed=0).to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        eager_loss, eager_grads = loss_and_grads(model, ids)
        model.compile_elementwise()
        compiled_loss, compiled_grads = loss_and_grads(model, ids)
        assert abs(compiled_loss - eager_loss) <= tol * max(1.0, abs(eager_loss)), dtype
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=10 * tol, atol=tol / 10, msg=name)
