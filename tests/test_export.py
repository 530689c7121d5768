"""Hugging Face export: what LlamaForCausalLM.from_pretrained loads must compute our logits."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaForCausalLM

from llmtrain.config import ConfigError, ModelConfig
from llmtrain.export import export_hf, hf_config, to_hf_state_dict
from llmtrain.model import build_model
from llmtrain.presets import PRESETS

os.environ["HF_HUB_OFFLINE"] = "1"  # every load below is from a local directory


def debug_config(**overrides: object) -> ModelConfig:
    return dataclasses.replace(ModelConfig(**PRESETS["debug"]), **overrides)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (small) byte-level BPE tokenizer with an end-of-text token at id 1."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_exported_model_loads_in_transformers_with_identical_logits(tmp_path: Path, tied: bool) -> None:
    cfg = debug_config(tie_word_embeddings=tied, rope_theta=500000.0)
    model = build_model(cfg, seed=11).eval()
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", eos_token_id=1, bos_token_id=0)

    assert out == tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging directory left behind
    tensors = load_file(str(out / "model.safetensors"))
    assert ("lm_head.weight" in tensors) is not tied
    assert all(t.dtype == torch.float32 for t in tensors.values())

    hf = LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32
    assert hf.config.tie_word_embeddings is tied
    assert hf.config.rope_parameters["rope_theta"] == 500000.0
    assert hf.generation_config.eos_token_id == 1
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.abs().max() > 0.05
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_tokenizer_is_exported_and_loads_with_auto_tokenizer(tmp_path: Path, tokenizer_file: Path) -> None:
    cfg = debug_config()
    model = build_model(cfg, seed=0)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", tokenizer_path=tokenizer_file, eos_token_id=1)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|endoftext|>"

    loaded = AutoTokenizer.from_pretrained(out)
    text = "the lazy fox"
    assert loaded(text)["input_ids"] == Tokenizer.from_file(str(tokenizer_file)).encode(text).ids
    assert loaded.eos_token_id == 1
    assert loaded.decode(loaded(text)["input_ids"]) == text


def test_tokenizer_directory_is_accepted(tmp_path: Path, tokenizer_file: Path) -> None:
    cfg = debug_config()
    out = export_hf(
        build_model(cfg, seed=0).state_dict(), cfg, tmp_path / "hf", tokenizer_path=tokenizer_file.parent
    )
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()


def test_hf_config_fields() -> None:
    cfg = ModelConfig(**PRESETS["1b"])
    config = hf_config(cfg, bos_token_id=128000, eos_token_id=128001)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 64)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 500000.0
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (128000, 128001)
    json.dumps(config)  # serialisable as config.json


def test_to_hf_state_dict_renames_and_accepts_wrapped_names() -> None:
    cfg = debug_config(tie_word_embeddings=True)
    state = build_model(cfg, seed=0).state_dict()
    wrapped = {f"module.{k}": v.to(torch.bfloat16) for k, v in state.items()}
    wrapped["module.lm_head.weight"] = state["embed_tokens.weight"]  # DeepSpeed's consolidation adds it
    hf = to_hf_state_dict(wrapped, cfg)
    assert set(hf) == {f"model.{k}" for k in state}
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in hf.values())


def test_mismatched_weights_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    state = build_model(debug_config(), seed=0).state_dict()
    with pytest.raises(ConfigError, match="missing"):
        export_hf(state, debug_config(num_hidden_layers=3), tmp_path / "hf")
    with pytest.raises(ConfigError, match="shape"):
        export_hf(state, debug_config(vocab_size=1024), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_earlier_export_is_replaced_but_other_directories_are_refused(tmp_path: Path) -> None:
    cfg = debug_config()
    first = build_model(cfg, seed=0).state_dict()
    second = build_model(cfg, seed=1).state_dict()
    out = export_hf(first, cfg, tmp_path / "hf")
    export_hf(second, cfg, out)
    assert torch.equal(load_file(str(out / "model.safetensors"))["model.norm.weight"], second["norm.weight"])
    assert torch.equal(
        load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"], second["embed_tokens.weight"]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]

    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(first, cfg, precious)
    assert [p.name for p in precious.iterdir()] == ["todo.txt"]
