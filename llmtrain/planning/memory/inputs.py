"""What `llmtrain estimate-memory` reads from its command line: sizes, counts, and the setup to estimate,
from a preset/config as `llmtrain train` reads it or from raw numbers (--params, shape flags)."""

from __future__ import annotations

import math
from typing import Any

from llmtrain.config import resolve
from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for
from llmtrain.planning.memory.setup import Setup, setup_from_config
from llmtrain.units import parse_bytes

# The raw shape flags and the model keys they set; config's errors about these keys name the flag.
SHAPE_FLAGS = {
    "--hidden-size": "hidden_size",
    "--layers": "num_hidden_layers",
    "--heads": "num_attention_heads",
    "--kv-heads": "num_key_value_heads",
    "--intermediate-size": "intermediate_size",
    "--vocab-size": "vocab_size",
}
_REQUIRED_SHAPE = ("--hidden-size", "--layers", "--heads")
_RAW_MAX_POSITIONS = 1 << 24  # raw shapes: positions cost no memory, so never limit --seq-len


def parse_size(text: str, flag: str) -> int:
    """'24GB' (1e9), '24GiB' (2^30), '1.5TB', '512MB', or plain bytes -> bytes; a ConfigError naming `flag`."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise ConfigError(
            f"{flag}: cannot read {text!r} as a size; write e.g. 80GB, 24GiB or 1.5TB"
        ) from None
    if value <= 0:
        raise ConfigError(f"{flag}: must be positive, got {text!r}")
    return value


def parse_count(text: str, flag: str) -> int:
    """'7e9', '7_000_000_000' or '7000000000' -> a positive int; a ConfigError naming `flag` otherwise."""
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise ConfigError(f"{flag}: expected a number such as 7e9, got {text!r}") from None
    if not math.isfinite(value) or value <= 0 or not value.is_integer():
        raise ConfigError(f"{flag}: must be a positive whole number, got {text!r}")
    return int(value)


def _raw_shape(shape: dict[str, int | None]) -> dict[str, Any]:
    """--hidden-size ... flags -> model.* config keys (config's validation checks the values)."""
    given = {flag: value for flag, value in shape.items() if value is not None}
    missing = [f for f in _REQUIRED_SHAPE if f not in given]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: needed with the other shape flags (or use --preset)")
    hidden, heads = given["--hidden-size"], given["--heads"]
    # Llama's SwiGLU width when not given: 8/3 x hidden, rounded up to a multiple of 256.
    mlp = 256 * math.ceil(8 * hidden / 3 / 256)
    flag_values = {"--kv-heads": heads, "--intermediate-size": mlp, "--vocab-size": 32000} | given
    values: dict[str, Any] = {SHAPE_FLAGS[flag]: value for flag, value in flag_values.items()}
    values |= {"tie_word_embeddings": False, "max_position_embeddings": _RAW_MAX_POSITIONS}
    return {f"model.{key}": value for key, value in values.items()}


def _naming_shape_flags(error: ConfigError) -> ConfigError:
    """Config's error about a model key a shape flag set, with the flag in place of the key's name."""
    text = str(error)
    for flag, key in SHAPE_FLAGS.items():
        prefix = f"{flag_for(f'model.{key}')}: "
        if text.startswith(prefix):
            return ConfigError(f"{flag}: {text.removeprefix(prefix)}")
    return error


def resolve_setup(
    config_file: Any,
    sets: list[str],
    flags: dict[str, Any],
    params: str | None = None,
    shape: dict[str, int | None] | None = None,
) -> Setup:
    """Preset/config/--set/flags as `llmtrain train` reads them, or raw numbers (--params, shape flags)."""
    shape = shape or {}
    raw_shape = any(v is not None for v in shape.values())
    count = parse_count(params, "--params") if params is not None else None
    flags = dict(flags)
    if raw_shape:
        flags.update(_raw_shape(shape))
    elif count is not None:
        flags["model.max_position_embeddings"] = _RAW_MAX_POSITIONS
    try:
        cfg = resolve(config_file, sets, flags)
    except ConfigError as error:
        if not raw_shape:
            raise
        raise _naming_shape_flags(error) from None
    return setup_from_config(cfg, count, raw_shape or count is None)
