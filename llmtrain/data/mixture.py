"""A data mixture's sources: their names, weights, shared tokenizer and prepared shards.

`--data a.jsonl:0.7 --data docs/:0.3` (or `data.mixture` in YAML) names several sources. Each is
prepared once into its own shards by the same cache a single `--data` uses (`cache.ensure_prepared`),
so a source mixed today and trained alone tomorrow with the same tokenizer is prepared once.

All sources share ONE tokenizer, chosen in this order:
1. `--tokenizer`, when given;
2. the tokenizer of the prepared directories among the sources (`prepare-data` output carries its own;
   they must agree);
3. the automatic tokenizer, trained once on an equal share of every source (not on the first one only,
   and not by weight: a fork may change the weights, never the tokens) and cached by the sources'
   fingerprints and the vocabulary size.
A prepared directory made with another tokenizer is refused in one line.

How samples are drawn from the prepared sources is `data.blend` (the loader); this module imports
neither torch nor `datasets` (the writer is imported only to build).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmtrain.config import ConfigError, DataConfig, MixtureSource
from llmtrain.data import cache, sources
from llmtrain.data import tokenizer as toks
from llmtrain.data.shards import TOKENIZER, PreparedData, is_prepared_dir, read_manifest


@dataclass(frozen=True)
class MixturePart:
    """One prepared source of a mixture."""

    name: str  # short and unique: what metrics and warnings call it
    source: str
    weight: float  # normalised: the parts' weights sum to 1
    prepared: PreparedData


def source_names(entries: list[MixtureSource]) -> list[str]:
    """A short name per source (file stem, directory or dataset name), made unique with -2, -3, ..."""
    names: list[str] = []
    for entry in entries:
        base = _short_name(entry.source)
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def _short_name(source: str) -> str:
    text = source.rstrip("/")
    stem = Path(text).stem if "*" not in Path(text).name else Path(text).parent.name
    return re.sub(r"[^\w.-]+", "_", stem).strip("_.")[:32] or "data"


def normalised_weights(entries: list[MixtureSource]) -> list[float]:
    total = sum(entry.weight for entry in entries)
    return [entry.weight / total for entry in entries]


def refuse_changed_sources(old: DataConfig, new: DataConfig, where: str) -> None:
    """A fork may change a mixture's weights only: the sources, in order, carry the data position."""
    before = [e.source for e in old.mixture or []]
    after = [e.source for e in new.mixture or []]
    if before != after:
        raise ConfigError(
            f"{where}: the mixture's sources changed ({', '.join(before) or 'none'} -> {', '.join(after) or 'none'}); "
            "a fork may change their weights only; start a new run for other sources"
        )


# ---------------------------------------------------------------- preparing every source


def prepare_mixture(
    data: DataConfig,
    vocab_size: int,
    *,
    local_rank: int = 0,
    barrier: Callable[[], None] | None = None,
    show_progress: bool | None = None,
) -> list[MixturePart]:
    """Every source of `data.mixture` prepared (or reused) with the mixture's one tokenizer."""
    assert data.mixture, "prepare_mixture needs data.mixture"
    tokenizer = _mixture_tokenizer(data, vocab_size, local_rank=local_rank, barrier=barrier)
    names, weights = source_names(data.mixture), normalised_weights(data.mixture)
    parts = []
    for entry, name, weight in zip(data.mixture, names, weights, strict=True):
        one = dataclasses.replace(data, source=entry.source, mixture=None, tokenizer=tokenizer)
        prepared = cache.ensure_prepared(
            one, vocab_size, local_rank=local_rank, barrier=barrier, show_progress=show_progress
        )
        parts.append(MixturePart(name, entry.source, weight, prepared))
    return parts


def _mixture_tokenizer(
    data: DataConfig, vocab_size: int, *, local_rank: int, barrier: Callable[[], None] | None
) -> str:
    assert data.mixture
    prepared_dirs = [e.source for e in data.mixture if is_prepared_dir(e.source)]
    if data.tokenizer:
        chosen, flag = data.tokenizer, f"--tokenizer {data.tokenizer}"
    elif prepared_dirs:
        chosen, flag = str(Path(prepared_dirs[0]) / TOKENIZER), f"the tokenizer of --data {prepared_dirs[0]}"
    else:
        return str(_auto_tokenizer(data, vocab_size, local_rank=local_rank, barrier=barrier))
    expected = toks.tokenizer_hash(toks.load_tokenizer(chosen))
    for directory in prepared_dirs:
        manifest = read_manifest(directory)
        if manifest is not None and manifest.tokenizer_hash != expected:
            raise ConfigError(
                f"--data {directory}: prepared with another tokenizer than {flag}; all sources of a mixture "
                f"share one: prepare it again with `llmtrain prepare-data SOURCE --tokenizer {chosen}`"
            )
    return chosen


def _auto_tokenizer(
    data: DataConfig, vocab_size: int, *, local_rank: int, barrier: Callable[[], None] | None
) -> Path:
    """The tokenizer trained on all the mixture's sources at this vocabulary size; trained when missing."""
    assert data.mixture
    source_list = [e.source for e in data.mixture]
    fingerprints = [
        sources.source_fingerprint(s, text_field=data.text_field, hub_config=data.hub_config, flag="--data")
        for s in source_list
    ]
    digest = cache._digest("\n".join(fingerprints))[:16]
    path = cache.data_cache_dir(data) / "tokenizers" / f"mixture-{digest}-v{vocab_size}.json"

    def build() -> Path:
        if not path.is_file():
            from llmtrain.data.prepare import train_mixture_tokenizer  # `datasets`: only to build

            train_mixture_tokenizer(data, source_list, vocab_size, path)
        return path

    return cache.built_once(
        data, f"mixture-{digest}", build=build, reuse=lambda: path, local_rank=local_rank, barrier=barrier
    )
