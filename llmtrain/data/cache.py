"""The cache `train --data` uses: prepared shards per (source, tokenizer, settings), built once, reused.

Reusing (or opening a directory `prepare-data` wrote) reads the manifest and stats the source only;
the writer (`llmtrain.data.prepare`, and with it `datasets`) is imported only when something has to be
built: the shards, or the automatic tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock
from tokenizers import Tokenizer

from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import corpus, sources
from llmtrain.data import tokenizer as toks
from llmtrain.data.shards import (
    FORMAT_VERSION,
    PreparedData,
    check_vocab,
    is_prepared_dir,
    open_prepared,
    read_manifest,
    token_dtype,
)

T = TypeVar("T")


def data_cache_dir(data: DataConfig) -> Path:
    return Path(data.cache_dir).expanduser() if data.cache_dir else sources.cache_root() / "data"


def ensure_prepared(
    data: DataConfig,
    vocab_size: int,
    *,
    local_rank: int = 0,
    barrier: Callable[[], None] | None = None,
    show_progress: bool | None = None,
) -> PreparedData:
    """Prepared shards for `data` (built, or reused when source, tokenizer and settings are unchanged).

    Multi-process: pass `barrier` (e.g. torch.distributed.barrier): local rank 0 prepares, everyone
    waits at the barrier, then the other ranks open what rank 0 wrote (and never build). Without a
    barrier each process takes a file lock in turn; the first builds, the rest find the work done.
    """
    return built_once(
        data,
        _digest(data.source or "builtin")[:16],
        build=lambda: _prepare_or_reuse(data, vocab_size, build=True, show_progress=show_progress),
        reuse=lambda: _prepare_or_reuse(data, vocab_size, build=False, show_progress=False),
        local_rank=local_rank,
        barrier=barrier,
    )


def built_once(
    data: DataConfig,
    lock_name: str,
    *,
    build: Callable[[], T],
    reuse: Callable[[], T],
    local_rank: int,
    barrier: Callable[[], None] | None,
) -> T:
    """`build` once per machine: by local rank 0 while the others wait at `barrier` and then `reuse`
    what it wrote; without a barrier, by each process in turn under a file lock in the cache (the
    first builds, the rest find the work done)."""
    if local_rank == 0 or barrier is None:
        lock = data_cache_dir(data) / "locks" / f"{lock_name}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            result = build()
        if barrier is not None:
            barrier()
        return result
    barrier()
    return reuse()


def _prepare_or_reuse(
    data: DataConfig, vocab_size: int, *, build: bool, show_progress: bool | None
) -> PreparedData:
    if data.source and is_prepared_dir(data.source):
        return open_prepared(data.source, tokenizer=data.tokenizer, vocab_size=vocab_size)
    source = data.source or str(corpus.builtin_corpus() if build else corpus.corpus_path())
    fingerprint = sources.source_fingerprint(
        source, text_field=data.text_field, hub_config=data.hub_config, flag="--data"
    )
    tok_path = (
        Path(data.tokenizer)
        if data.tokenizer
        else _auto_tokenizer(data, source, fingerprint, vocab_size, build)
    )
    tok = toks.load_tokenizer(tok_path)
    check_vocab(toks.vocab_size(tok), vocab_size, f"--tokenizer {tok_path}")
    expected = _expected_settings(data, fingerprint, tok, tok_path)
    out = data_cache_dir(data) / f"{_slug(source)}-{_digest(json.dumps(expected, sort_keys=True))[:16]}"
    existing = read_manifest(out)
    if existing is not None and existing.settings() == expected:
        return PreparedData(out, existing, reused=True)
    if not build:
        raise ConfigError(f"--data {source}: local rank 0 did not finish preparing {out}; see its error")
    from llmtrain.data.prepare import prepare_data  # the writer, and `datasets`: only to build

    manifest = prepare_data(
        source,
        tok_path,
        out,
        text_field=data.text_field,
        hub_config=data.hub_config,
        streaming=data.streaming,
        val_fraction=data.val_fraction,
        split_seed=data.split_seed,
        num_proc=data.num_proc,
        show_progress=show_progress,
        flag="--data",
    )
    return PreparedData(out, manifest, reused=False)


def _expected_settings(data: DataConfig, fingerprint: str, tok: Tokenizer, tok_path: Path) -> dict[str, Any]:
    """The manifest settings (Manifest.settings()) a preparation of `data` with `tok` would write."""
    eot = toks.eot_id(tok, tok_path)
    prefix = toks.start_ids(tok, eot)
    return {
        **({"document_prefix": prefix} if prefix else {}),
        "format": FORMAT_VERSION,
        "source_fingerprint": fingerprint,
        "text_field": data.text_field,
        "tokenizer_hash": toks.tokenizer_hash(tok),
        "eot_id": eot,
        "dtype": token_dtype(toks.vocab_size(tok)),
        "val_fraction": data.val_fraction,
        "split_seed": data.split_seed,
    }


def _auto_tokenizer(data: DataConfig, source: str, fingerprint: str, vocab_size: int, build: bool) -> Path:
    """The cached tokenizer trained on this source at this vocabulary size; trained when missing."""
    path = data_cache_dir(data) / "tokenizers" / f"{_slug(source)}-{fingerprint[:16]}-v{vocab_size}.json"
    if path.is_file() or not build:
        return path
    from llmtrain.data.prepare import train_auto_tokenizer  # the writer, and `datasets`: only to build

    train_auto_tokenizer(data, source, vocab_size, path)
    return path


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _slug(source: str) -> str:
    name = Path(source.rstrip("/")).stem if not sources.is_hub_name(source) else source.replace("/", "--")
    return re.sub(r"[^\w.-]+", "_", name)[:48] or "data"
