"""`train --init-from SOURCE`: where a run's first weights come from, and the model shape they fix.

SOURCE is a Hugging Face Llama directory (config.json, model.safetensors or a sharded
model.safetensors.index.json, tokenizer.json) or an llmtrain run directory, optionally with the step of
one of its checkpoints (`RUN_DIR:STEP`; default: its latest intact one). Either way only the weights
are taken: the optimizer, the schedule and the data position start fresh.

This module reads the source's description only (JSON and YAML, no tensors): the config layer uses it
to fill the `model` section before the user's own keys apply. The tensors are read by
engine.pretrained inside the workers, one at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from llmtrain.errors import ConfigError

FLAG = "--init-from"
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_TOKENIZER = "tokenizer.json"
RUN_CONFIG = "config.yaml"  # rundir.CONFIG_FILE (rundir imports the config layer, which imports this)

# Model keys that decide the weights' shapes: the source fixes them, a user's value must agree.
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


@dataclass(frozen=True)
class InitSource:
    kind: Literal["hf", "run"]
    path: Path
    checkpoint: str | None  # run: the step or tag asked for (None: its latest intact checkpoint)

    def describe(self) -> str:
        if self.kind == "hf":
            return f"Hugging Face model {self.path}"
        return f"run {self.path}" + (f" at checkpoint {self.checkpoint}" if self.checkpoint else "")


def parse(spec: str) -> InitSource:
    """`DIR` (a Hugging Face Llama directory or a run) or `RUN_DIR:STEP`; a missing or unknown
    directory is bad input."""
    path, checkpoint = Path(spec).expanduser(), None
    if not path.exists() and ":" in spec:
        head, _, tail = spec.rpartition(":")
        if tail.strip():
            path, checkpoint = Path(head).expanduser(), tail.strip()
    if not path.is_dir():
        raise ConfigError(
            f"{FLAG} {spec}: no such directory; give a Hugging Face model directory or a run directory"
        )
    path = path.resolve()
    if (path / RUN_CONFIG).is_file():
        return InitSource("run", path, checkpoint)
    if checkpoint is not None:
        raise ConfigError(
            f"{FLAG} {spec}: {path} is not a run directory, so it has no checkpoint {checkpoint}"
        )
    if (path / HF_CONFIG).is_file():
        return InitSource("hf", path, None)
    raise ConfigError(
        f"{FLAG} {spec}: neither a Hugging Face model directory ({HF_CONFIG}) nor a run ({RUN_CONFIG})"
    )


def model_keys(source: InitSource) -> dict[str, Any]:
    """The `model` section the source's weights need, as ModelConfig keys."""
    if source.kind == "run":
        return _run_model_keys(source.path)
    return from_hf_config(read_json(source.path / HF_CONFIG), source.path / HF_CONFIG)


def tokenizer_path(source: InitSource) -> Path | None:
    """The source's tokenizer, reused unless --tokenizer names another: a run's tokenizer.json, or a
    Hugging Face directory (its tokenizer_config.json names the end-of-text token)."""
    if source.kind == "run":
        file = source.path / HF_TOKENIZER
        return file if file.is_file() else None
    return source.path if (source.path / HF_TOKENIZER).is_file() else None


# ---------------------------------------------------------------- Hugging Face weights, by header


def hf_weight_files(directory: Path) -> dict[str, tuple[Path, str]]:
    """Our parameter name -> (safetensors file, the tensor's name there), from model.safetensors or the
    sharded index. Buffers some older exports carry (rotary inv_freq) are not weights and are left out."""
    index = directory / HF_WEIGHTS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{FLAG}: {index} has no weight_map")
        located = {name: directory / str(file) for name, file in weight_map.items()}
    elif (directory / HF_WEIGHTS).is_file():
        located = {name: directory / HF_WEIGHTS for name in _header(directory / HF_WEIGHTS)}
    else:
        raise ConfigError(
            f"{FLAG} {directory}: no {HF_WEIGHTS} or {HF_WEIGHTS_INDEX}; save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    return {
        name.removeprefix("model."): (file, name)
        for name, file in located.items()
        if not name.endswith("rotary_emb.inv_freq")
    }


def check_hf_weights(directory: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Every parameter the model needs is in the files with its shape (read from the headers only);
    a tied model ignores a stored lm_head."""
    files = hf_weight_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted({file for file, _ in files.values()}):
        if not file.is_file():
            raise ConfigError(f"{FLAG} {directory}: {file.name} is listed in the index but missing")
        header = _header(file)
        shapes.update(
            {ours: header[stored] for ours, (f, stored) in files.items() if f == file and stored in header}
        )
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ConfigError(
            f"{FLAG} {directory}: the weights lack {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            + f"; they do not match its {HF_CONFIG}"
        )
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ConfigError(
                f"{FLAG} {directory}: {name} has shape {shapes[name]}, its {HF_CONFIG} implies {shape}"
            )


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's JSON header (8-byte length, then the JSON)."""
    try:
        with file.open("rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{FLAG}: {file} is not a safetensors file ({type(exc).__name__})") from None
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{FLAG}: {path} is not readable JSON ({type(exc).__name__}); fix or replace it"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{FLAG}: {path} is not a JSON object")
    return data


def _run_model_keys(run_dir: Path) -> dict[str, Any]:
    try:
        saved = yaml.safe_load((run_dir / RUN_CONFIG).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{FLAG} {run_dir}: unreadable {RUN_CONFIG} ({type(exc).__name__})") from None
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        raise ConfigError(f"{FLAG} {run_dir}: its {RUN_CONFIG} has no model section")
    return dict(model)


# ---------------------------------------------------------------- Hugging Face config.json -> ours


def from_hf_config(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """A LlamaConfig dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`) -> ModelConfig keys.

    What the model cannot reproduce is refused rather than approximated: another architecture,
    biases, an activation other than SiLU, a RoPE scaling other than linear or llama3.
    """
    _refuse_unsupported(hf, where)
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    keys: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "num_hidden_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(hf.get("num_key_value_heads") or heads),
        # Written only when it is not the derived width, so a plain config stays plain.
        "head_dim": int(head_dim) if head_dim and int(head_dim) * heads != int(hf["hidden_size"]) else None,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "initializer_range": float(hf.get("initializer_range", 0.02)),
    }
    keys.update(_rope_keys(hf, where))
    return keys


def _refuse_unsupported(hf: dict[str, Any], where: Path) -> None:
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"{FLAG}: {where} describes a {model_type!r} model; llmtrain starts from Llama checkpoints "
            "(model_type llama, LlamaForCausalLM)"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{FLAG}: {where} has {key}: true; llmtrain's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{FLAG}: {where} has hidden_act {hf['hidden_act']!r}; llmtrain's MLP is SwiGLU (silu)"
        )
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if k not in hf
    ]
    if missing:
        raise ConfigError(f"{FLAG}: {where} lacks {', '.join(missing)}; is it a Llama config.json?")


def _rope_keys(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """RoPE base and scaling from `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(
            f"{FLAG}: {where} uses RoPE scaling {rope_type!r}; llmtrain implements linear and llama3"
        )
    keys: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_type": _ROPE_TYPES[rope_type]}
    if rope_type in ("linear", "llama3"):
        keys["rope_scaling_factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        keys["rope_scaling_low_freq_factor"] = float(scaling["low_freq_factor"])
        keys["rope_scaling_high_freq_factor"] = float(scaling["high_freq_factor"])
        keys["rope_scaling_original_max_position_embeddings"] = int(
            scaling["original_max_position_embeddings"]
        )
    return keys
