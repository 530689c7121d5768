"""Reading prepared data: the manifest, one split's shards as a token stream, an opened directory.

Layout of a prepared directory (written by `llmtrain.data.prepare`):
    tokenizer.json            the tokenizer the shards were made with
    train-00000.bin ...       raw token ids (uint16 when the vocabulary fits, else uint32), no header
    val-00000.bin ...
    manifest.json             written LAST: its presence is what makes the directory complete

Each split's stream is its shards concatenated in order; it holds, for every document of the split
in source order, exactly `encode(document, add_special_tokens=False) + [eot]`.

Nothing here imports `datasets`: training and inference open prepared data without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmtrain.config import ConfigError
from llmtrain.data import tokenizer as toks

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DTYPES: dict[str, Any] = {"uint16": np.uint16, "uint32": np.uint32}


# ---------------------------------------------------------------- manifest


@dataclass
class Shard:
    file: str
    tokens: int


@dataclass
class SplitInfo:
    documents: int = 0
    tokens: int = 0
    shards: list[Shard] = field(default_factory=list)


@dataclass
class Manifest:
    source: str
    source_fingerprint: str
    text_field: str
    tokenizer_hash: str
    vocab_size: int
    eot_id: int
    dtype: str
    val_fraction: float
    split_seed: int
    documents: int
    tokens: int
    splits: dict[str, SplitInfo]
    seconds: float = 0.0
    format: int = FORMAT_VERSION
    document_prefix: list[int] = field(default_factory=list)  # tokenizer.start_ids: before each document

    def settings(self) -> dict[str, Any]:
        """Everything that decides the shards' contents: equal settings, equal shards. A document prefix
        is named only when there is one, so directories prepared before it existed stay valid."""
        settings = {k: getattr(self, k) for k in SETTINGS_KEYS}
        if self.document_prefix:
            settings["document_prefix"] = self.document_prefix
        return settings

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        splits = {
            name: SplitInfo(s["documents"], s["tokens"], [Shard(**sh) for sh in s["shards"]])
            for name, s in data["splits"].items()
        }
        return cls(**{**data, "splits": splits})


SETTINGS_KEYS = (
    "format",
    "source_fingerprint",
    "text_field",
    "tokenizer_hash",
    "eot_id",
    "dtype",
    "val_fraction",
    "split_seed",
)


def read_manifest(directory: str | Path) -> Manifest | None:
    """The manifest of a COMPLETE prepared directory, else None (missing, unreadable, shards missing)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if manifest.format != FORMAT_VERSION:
        return None
    itemsize = np.dtype(DTYPES[manifest.dtype]).itemsize
    for split in manifest.splits.values():
        for shard in split.shards:
            f = Path(directory) / shard.file
            if not f.is_file() or f.stat().st_size != shard.tokens * itemsize:
                return None
    return manifest


def is_prepared_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


# ---------------------------------------------------------------- token dtype and mixing


def token_dtype(vocab: int, requested: str = "auto", flag: str = "--dtype") -> str:
    """uint16 when every id (0..vocab-1) fits, else uint32; a forced dtype too small is an error."""
    if requested == "auto":
        return "uint16" if vocab <= 1 << 16 else "uint32"
    if requested not in DTYPES:
        raise ConfigError(f"{flag} {requested}: unknown token dtype; choose auto, uint16 or uint32")
    limit = int(np.iinfo(DTYPES[requested]).max) + 1
    if vocab > limit:
        raise ConfigError(
            f"{flag} {requested}: holds token ids below {limit}, but the tokenizer has {vocab} tokens; "
            "use --dtype uint32 (or auto)"
        )
    return requested


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (SplitMix64's finaliser), elementwise on uint64 arrays."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# ---------------------------------------------------------------- reading


class TokenStream:
    """One split's shards as a single read-only token sequence, memory-mapped."""

    def __init__(self, directory: Path, split: SplitInfo, dtype: str) -> None:
        self.maps = [np.memmap(directory / s.file, dtype=DTYPES[dtype], mode="r") for s in split.shards]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        self.documents = split.documents

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length), copied out of the maps (a window may span shards)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside a stream of {len(self)}")
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        local = start - int(self.starts[shard])
        piece = self.maps[shard][local : local + length]
        if len(piece) == length:
            return np.array(piece)
        parts, need = [piece], length - len(piece)
        while need > 0:
            shard += 1
            parts.append(self.maps[shard][:need])
            need -= len(parts[-1])
        return np.concatenate(parts)


@dataclass
class PreparedData:
    """A complete prepared directory, opened."""

    path: Path
    manifest: Manifest
    reused: bool = False

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER

    @property
    def eot_id(self) -> int:
        return self.manifest.eot_id

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    def stream(self, split: str = "train") -> TokenStream:
        return TokenStream(self.path, self.manifest.splits[split], self.manifest.dtype)


def open_prepared(
    directory: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int | None = None,
    flag: str = "--data",
) -> PreparedData:
    """Open a directory written by `prepare_data` (what `train --data DIR` does with one)."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise ConfigError(
            f"{flag} {directory}: not a complete prepared dataset (manifest.json missing, unreadable or its "
            "shards are incomplete: an interrupted preparation?); run `llmtrain prepare-data` again"
        )
    if tokenizer is not None:
        given = toks.tokenizer_hash(toks.load_tokenizer(tokenizer))
        if given != manifest.tokenizer_hash:
            raise ConfigError(
                f"--tokenizer {tokenizer}: {directory} was prepared with a different tokenizer; "
                "drop --tokenizer to use the dataset's own, or prepare the data again with this one"
            )
    if vocab_size is not None:
        check_vocab(manifest.vocab_size, vocab_size, f"{flag} {directory}")
    return PreparedData(Path(directory), manifest, reused=True)


def check_vocab(tokenizer_vocab: int, model_vocab: int, where: str) -> None:
    if tokenizer_vocab > model_vocab:
        suggestion = -(-tokenizer_vocab // 64) * 64
        raise ConfigError(
            f"{where}: the tokenizer has {tokenizer_vocab} tokens, more than model.vocab_size={model_vocab}; "
            f"raise it (--set model.vocab_size={suggestion}) or pass a smaller --tokenizer"
        )
