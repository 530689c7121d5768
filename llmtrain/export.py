"""Hugging Face export: our weights and ModelConfig -> a directory LlamaForCausalLM.from_pretrained loads.

Our parameter names are Hugging Face's without the leading `model.` (see llmtrain/model.py), so the
conversion is a rename; a tied lm_head is left out and re-tied by `tie_word_embeddings` on load.
The export directory is written under a temporary name and renamed into place, so a crash never leaves
a half-written export behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from llmtrain.config import ConfigError, ModelConfig
from llmtrain.presets import count_parameters

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
# Files that mark a directory as an earlier export, which export_hf may replace.
_EXPORT_MARKERS = (WEIGHTS_NAME, CONFIG_NAME)
# Wrappers that prefix parameter names: DeepSpeed / DDP (`module.`) and torch.compile (`_orig_mod.`).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def hf_config(
    cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A LlamaConfig-compatible config.json dict for this shape, with fp32 weights.

    RoPE is written both as `rope_theta` + `rope_scaling` (transformers 4.x and most other readers) and
    as `rope_parameters` (transformers 5.x).
    """
    scaling = rope_scaling(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_width,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})},
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """Hugging Face's `rope_scaling` dict for the config's RoPE scaling (None without one)."""
    if cfg.rope_scaling_type == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": cfg.rope_scaling_type, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling_type == "llama3":
        scaling["low_freq_factor"] = cfg.rope_scaling_low_freq_factor
        scaling["high_freq_factor"] = cfg.rope_scaling_high_freq_factor
        scaling["original_max_position_embeddings"] = cfg.rope_scaling_original_max_position_embeddings
    return scaling


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for this config (lm_head only when untied)."""
    d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_width
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * cfg.head_width, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, cfg.num_attention_heads * cfg.head_width)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, cfg.intermediate_size)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def strip_wrapper_prefixes(name: str) -> str:
    """A parameter name without the wrappers' prefixes: `module.` (DeepSpeed / DDP), `_orig_mod.`
    (torch.compile), leading in any order and `._orig_mod.` inside."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name.replace("._orig_mod.", ".")


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face LlamaForCausalLM names, as contiguous fp32 CPU tensors.

    Accepts names wrapped by DeepSpeed/DDP (`module.`) or torch.compile (`_orig_mod.`). With tied
    embeddings a `lm_head.weight` in the input is dropped (Hugging Face re-ties it on load). Raises
    ConfigError when the names or shapes do not match `cfg`, so a checkpoint exported with the wrong
    config fails loudly instead of producing a model that loads with random weights.
    """
    ours = {strip_wrapper_prefixes(k): v for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"weights do not match the model config ({count_parameters(**vars(cfg)):,} parameters): "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}; export with the run's own config.yaml"
        )
    out: dict[str, Tensor] = {}
    for name, tensor in ours.items():
        if tuple(tensor.shape) != expected[name]:
            raise ConfigError(
                f"weight {name} has shape {tuple(tensor.shape)}, the model config needs {expected[name]}; "
                "export with the run's own config.yaml"
            )
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        out[hf_name] = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return out


def export_hf(
    state_dict: dict[str, Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> Path:
    """Write a Hugging Face model directory and return its path.

    Files: model.safetensors (fp32), config.json, generation_config.json and, when `tokenizer_path`
    (a tokenizer.json, or a directory holding one) is given, tokenizer.json plus tokenizer_config.json,
    so `AutoTokenizer.from_pretrained(out_dir)` works offline. An existing earlier export at `out_dir`
    is replaced; any other non-empty directory there is refused (ConfigError).
    """
    out = Path(out_dir)
    _check_destination(out)
    tensors = to_hf_state_dict(state_dict, cfg)
    tokenizer_file = _find_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        save_file(tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        _write_json(staging / CONFIG_NAME, hf_config(cfg, bos_token_id, eos_token_id))
        _write_json(staging / GENERATION_CONFIG_NAME, _generation_config(bos_token_id, eos_token_id))
        if tokenizer_file is not None:
            _write_tokenizer(tokenizer_file, staging, cfg, bos_token_id, eos_token_id)
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _check_destination(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export directory {out} is a file; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in _EXPORT_MARKERS):
        raise ConfigError(
            f"export directory {out} is not empty and holds no earlier export; choose a new or empty directory"
        )


def _find_tokenizer(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_NAME
    if not p.is_file():
        raise ConfigError(
            f"tokenizer {path}: no tokenizer.json found; pass a tokenizer.json or its directory"
        )
    return p


def _generation_config(bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    config: dict[str, Any] = {"_from_model_config": True}
    if bos_token_id is not None:
        config["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    return config


def _write_tokenizer(
    tokenizer_file: Path, staging: Path, cfg: ModelConfig, bos_token_id: int | None, eos_token_id: int | None
) -> None:
    """Copy tokenizer.json (with the start-of-document token added, see `_with_bos`); keep the source
    directory's tokenizer_config.json, else write a minimal one."""
    _write_with_bos(tokenizer_file, staging / TOKENIZER_NAME, bos_token_id)
    existing_config = tokenizer_file.parent / TOKENIZER_CONFIG_NAME
    if existing_config.is_file():
        shutil.copyfile(existing_config, staging / TOKENIZER_CONFIG_NAME)
        return
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    vocab = _token_strings(tokenizer_file)
    for key, token_id in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
        if token_id is not None and token_id in vocab:
            config[key] = vocab[token_id]
    _write_json(staging / TOKENIZER_CONFIG_NAME, config)


def _write_with_bos(tokenizer_file: Path, out: Path, bos_token_id: int | None) -> None:
    """The tokenizer, made to start every text with `bos_token_id` as llmtrain's model expects: a model
    trained by llmtrain reads each document after the end-of-text token that separated it from the one
    before, and `llmtrain generate` starts every context with it. Without it in the exported tokenizer,
    `tokenizer(prompt)` + `generate` in transformers would continue a context the model never saw. A
    tokenizer that already has a post-processor (one imported from elsewhere) keeps its own rules."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if bos_token_id is None or tokenizer.post_processor is not None:
        shutil.copyfile(tokenizer_file, out)
        return
    bos = tokenizer.id_to_token(bos_token_id)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)]
    )
    tokenizer.save(str(out))


def _token_strings(tokenizer_file: Path) -> dict[int, str]:
    """id -> token text, from the tokenizer's vocabulary and its added (special) tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return {token_id: token for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished staging directory to `out`, replacing an earlier export only once done."""
    os.chmod(staging, 0o755)  # mkdtemp makes it private; an export is meant to be shared
    if not out.exists():
        staging.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
