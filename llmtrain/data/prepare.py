"""Source -> memory-mapped token shards + manifest.json, and the cache that reuses them.

Layout of a prepared directory:
    tokenizer.json            the tokenizer the shards were made with
    train-00000.bin ...       raw token ids (uint16 when the vocabulary fits, else uint32), no header
    val-00000.bin ...
    manifest.json             written LAST: its presence is what makes the directory complete

Each split's stream is its shards concatenated in order; it holds, for every document of the split
in source order, exactly `encode(document, add_special_tokens=False) + [eot]`. Nothing is dropped,
truncated or padded. Which documents are validation documents is a function of (number of
documents, val_fraction, split_seed) only, so the split does not depend on `num_proc`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from itertools import chain, pairwise
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from filelock import FileLock
from tokenizers import Tokenizer

from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import corpus, sources
from llmtrain.data import tokenizer as toks
from llmtrain.fsutil import fsync_dir, write_atomic

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DTYPES: dict[str, Any] = {"uint16": np.uint16, "uint32": np.uint32}
BATCH_DOCS = 1024  # documents per encode_batch call
PARALLEL_MIN_BYTES = 8 << 20  # below this, starting worker processes costs more than it saves
STREAM_PIECE_DOCS = 100_000  # streaming sources: documents per shard
TOKENIZER_TRAIN_CHARS = 200_000_000  # automatic tokenizers learn from at most this much text


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

    def settings(self) -> dict[str, Any]:
        """Everything that decides the shards' contents: equal settings, equal shards."""
        return {k: getattr(self, k) for k in SETTINGS_KEYS}

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


# ---------------------------------------------------------------- dtype and split


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


def split_mask(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """True for validation documents: round(n * fraction) of them (at least one, never all), by seed."""
    mask = np.zeros(n_docs, dtype=bool)
    if val_fraction <= 0 or n_docs < 2:
        return mask
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    mask[np.random.default_rng(seed).choice(n_docs, size=n_val, replace=False)] = True
    return mask


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (SplitMix64's finaliser), elementwise on uint64 arrays."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _streaming_val(indices: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Streaming sources have no length up front: each document is validation with probability f."""
    keyed = splitmix64(indices.astype(np.uint64) ^ splitmix64(np.array([seed], dtype=np.uint64)))
    return (keyed >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction


# ---------------------------------------------------------------- tokenizing one piece


@dataclass
class _Piece:
    """A contiguous range of documents, tokenized into its own train/val shard pair."""

    index: int
    start: int
    stop: int


@dataclass
class _PieceResult:
    index: int
    documents: dict[str, int]
    tokens: dict[str, int]
    text_tokens: int  # tokens other than the separators, to detect an all-empty source


class _ShardWriter:
    """Appends each split's tokens to `<split>-<piece>.bin`."""

    def __init__(self, out_dir: Path, index: int, dtype: str) -> None:
        self.files = {s: (out_dir / f"{s}-{index:05d}.bin").open("wb") for s in SPLITS}
        self.dtype = DTYPES[dtype]
        self.documents = dict.fromkeys(SPLITS, 0)
        self.tokens = dict.fromkeys(SPLITS, 0)

    def write(self, split: str, docs: list[list[int]], eot: int) -> None:
        count = sum(len(d) for d in docs) + len(docs)
        flat = np.fromiter(chain.from_iterable(chain(d, (eot,)) for d in docs), dtype=self.dtype, count=count)
        flat.tofile(self.files[split])
        self.documents[split] += len(docs)
        self.tokens[split] += count

    def close(self) -> None:
        for fh in self.files.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()


def _encode_into(writer: _ShardWriter, tok: Tokenizer, eot: int, texts: list[str], is_val: np.ndarray) -> int:
    ids = toks.encode_documents(tok, texts)
    for split, pick in (("train", ~is_val), ("val", is_val)):
        chosen = [d for d, keep in zip(ids, pick, strict=True) if keep]
        if chosen:
            writer.write(split, chosen, eot)
    return sum(len(d) for d in ids)


def _tokenize_piece(
    ds: datasets.Dataset, piece: _Piece, mask: np.ndarray, tok_json: str, eot: int, dtype: str, out_dir: str
) -> _PieceResult:
    """Worker body (also run inline): encode documents [start, stop) in batches into one shard pair."""
    tok = Tokenizer.from_str(tok_json)
    tok.encode_special_tokens = True
    writer = _ShardWriter(Path(out_dir), piece.index, dtype)
    text_tokens = 0
    try:
        part = ds.select(range(piece.start, piece.stop))
        offset = piece.start
        for batch in part.iter(batch_size=BATCH_DOCS):
            texts = batch["text"]
            text_tokens += _encode_into(writer, tok, eot, texts, mask[offset : offset + len(texts)])
            offset += len(texts)
    finally:
        writer.close()
    return _PieceResult(piece.index, writer.documents, writer.tokens, text_tokens)


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no nested threads


# ---------------------------------------------------------------- prepare


def prepare_data(
    source: str,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    *,
    text_field: str = "text",
    hub_config: str | None = None,
    streaming: bool = False,
    val_fraction: float = 0.02,
    split_seed: int = 1234,
    num_proc: int = 2,
    dtype: str = "auto",
    show_progress: bool | None = None,
    parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    flag: str = "SOURCE",
    tokenizer_flag: str = "--tokenizer",
) -> Manifest:
    """Tokenize `source` into shards under `out_dir`; write manifest.json last and return it."""
    started = time.perf_counter()
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    tok = toks.load_tokenizer(tokenizer_path, tokenizer_flag)
    vocab = toks.vocab_size(tok)
    eot = toks.eot_id(tok, tokenizer_path, tokenizer_flag)
    chosen_dtype = token_dtype(vocab, dtype)
    fingerprint = sources.source_fingerprint(source, text_field=text_field, hub_config=hub_config, flag=flag)
    docs = sources.load_documents(
        source, text_field=text_field, hub_config=hub_config, streaming=streaming, flag=flag
    )

    out = Path(out_dir).expanduser()
    _clear_prepared(out)
    toks.save_tokenizer(tok, out / TOKENIZER)
    run = _Run(tok, eot, chosen_dtype, out, val_fraction, split_seed, _want_progress(show_progress))
    if isinstance(docs, datasets.IterableDataset):
        results = run.streaming(docs)
    else:
        results = run.table(docs, num_proc, parallel_min_bytes)
    if sum(r.text_tokens for r in results) == 0:
        _clear_prepared(out)
        raise ConfigError(f"{flag} {source}: empty source (every document is empty); point it at text")

    manifest = Manifest(
        source=source,
        source_fingerprint=fingerprint,
        text_field=text_field,
        tokenizer_hash=toks.tokenizer_hash(tok),
        vocab_size=vocab,
        eot_id=eot,
        dtype=chosen_dtype,
        val_fraction=val_fraction,
        split_seed=split_seed,
        documents=0,
        tokens=0,
        splits=_collect_splits(out, results),
    )
    manifest.documents = sum(s.documents for s in manifest.splits.values())
    manifest.tokens = sum(s.tokens for s in manifest.splits.values())
    manifest.seconds = round(time.perf_counter() - started, 3)
    fsync_dir(out)
    write_atomic(out / MANIFEST, manifest.to_json())  # the commit point
    return manifest


def _clear_prepared(out: Path) -> None:
    """Remove the manifest FIRST (so the directory stops looking complete), then old shards."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    fsync_dir(out)
    for old in out.glob("*.bin"):
        old.unlink()


def _collect_splits(out: Path, results: list[_PieceResult]) -> dict[str, SplitInfo]:
    splits = {s: SplitInfo() for s in SPLITS}
    for r in sorted(results, key=lambda r: r.index):
        for s in SPLITS:
            file = f"{s}-{r.index:05d}.bin"
            if r.tokens[s] == 0:
                (out / file).unlink(missing_ok=True)
                continue
            splits[s].documents += r.documents[s]
            splits[s].tokens += r.tokens[s]
            splits[s].shards.append(Shard(file, r.tokens[s]))
    return splits


class _Run:
    """One preparation: the tokenizer, output settings and the progress display."""

    def __init__(
        self,
        tok: Tokenizer,
        eot: int,
        dtype: str,
        out: Path,
        val_fraction: float,
        seed: int,
        progress: bool,
        stream_piece_docs: int = STREAM_PIECE_DOCS,
        batch_docs: int = BATCH_DOCS,
    ) -> None:
        self.tok, self.eot, self.dtype, self.out = tok, eot, dtype, out
        self.val_fraction, self.seed, self.progress = val_fraction, seed, progress
        self.stream_piece_docs, self.batch_docs = stream_piece_docs, batch_docs

    def table(self, ds: datasets.Dataset, num_proc: int, parallel_min_bytes: int) -> list[_PieceResult]:
        n = ds.num_rows
        mask = split_mask(n, self.val_fraction, self.seed)
        parallel = num_proc > 1 and _text_bytes(ds) >= parallel_min_bytes
        pieces = _plan_pieces(n, num_proc * 4 if parallel else 1)
        tok_json = self.tok.to_str()
        with _progress(self.progress, n) as advance:
            if not parallel:
                results = []
                for p in pieces:
                    results.append(
                        _tokenize_piece(ds, p, mask, tok_json, self.eot, self.dtype, str(self.out))
                    )
                    advance(p.stop - p.start)
                return results
            return self._in_processes(ds, pieces, mask, tok_json, num_proc, advance)

    def _in_processes(
        self,
        ds: datasets.Dataset,
        pieces: list[_Piece],
        mask: np.ndarray,
        tok_json: str,
        num_proc: int,
        advance: Callable[[int], None],
    ) -> list[_PieceResult]:
        # fork where the platform has it: spawn would re-import the caller's __main__ in every worker.
        # The workers encode single-threaded (_worker_init), so the parent's tokenizer threads are moot.
        ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
        results = []
        with ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=_worker_init) as pool:
            futures = {
                pool.submit(_tokenize_piece, ds, p, mask, tok_json, self.eot, self.dtype, str(self.out)): p
                for p in pieces
            }
            for fut in as_completed(futures):
                results.append(fut.result())
                advance(futures[fut].stop - futures[fut].start)
        return results

    def streaming(self, ds: datasets.IterableDataset) -> list[_PieceResult]:
        """Single process: shards of `stream_piece_docs` documents, encode_batch threads doing the work."""
        results: list[_PieceResult] = []
        index, seen = 0, 0
        writer = _ShardWriter(self.out, index, self.dtype)
        text_tokens = 0
        with _progress(self.progress, None) as advance:
            for batch in ds.iter(batch_size=self.batch_docs):
                texts = batch["text"]
                is_val = _streaming_val(np.arange(seen, seen + len(texts)), self.val_fraction, self.seed)
                text_tokens += _encode_into(writer, self.tok, self.eot, texts, is_val)
                seen += len(texts)
                advance(len(texts))
                if sum(writer.documents.values()) >= self.stream_piece_docs:
                    writer.close()
                    results.append(_PieceResult(index, writer.documents, writer.tokens, text_tokens))
                    index, text_tokens = index + 1, 0
                    writer = _ShardWriter(self.out, index, self.dtype)
        writer.close()
        results.append(_PieceResult(index, writer.documents, writer.tokens, text_tokens))
        return results


def _text_bytes(ds: datasets.Dataset) -> int:
    import pyarrow.compute as pc

    total = pc.sum(pc.binary_length(ds.data.column("text"))).as_py()
    return int(total or 0)


def _plan_pieces(n: int, count: int) -> list[_Piece]:
    count = max(1, min(count, n))
    bounds = np.linspace(0, n, count + 1).astype(int)
    return [_Piece(i, int(a), int(b)) for i, (a, b) in enumerate(pairwise(bounds))]


def _want_progress(show: bool | None) -> bool:
    return sys.stderr.isatty() if show is None else show


@contextlib.contextmanager
def _progress(enabled: bool, total: int | None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (documents tokenized), or a no-op."""
    if not enabled:
        yield lambda _n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("tokenizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("documents"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokenize", total=total)
        yield lambda n: bar.advance(task, n)


# ---------------------------------------------------------------- reading prepared data


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


# ---------------------------------------------------------------- the cache `train --data` uses


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
    prepared: PreparedData | None = None
    if local_rank == 0 or barrier is None:
        lock = data_cache_dir(data) / "locks" / f"{_digest(data.source or 'builtin')[:16]}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            prepared = _prepare_or_reuse(data, vocab_size, build=True, show_progress=show_progress)
    if barrier is not None:
        barrier()
        if prepared is None:
            prepared = _prepare_or_reuse(data, vocab_size, build=False, show_progress=False)
    assert prepared is not None
    return prepared


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
    expected = {
        "format": FORMAT_VERSION,
        "source_fingerprint": fingerprint,
        "text_field": data.text_field,
        "tokenizer_hash": toks.tokenizer_hash(tok),
        "eot_id": toks.eot_id(tok, tok_path),
        "dtype": token_dtype(toks.vocab_size(tok)),
        "val_fraction": data.val_fraction,
        "split_seed": data.split_seed,
    }
    out = data_cache_dir(data) / f"{_slug(source)}-{_digest(json.dumps(expected, sort_keys=True))[:16]}"
    existing = read_manifest(out)
    if existing is not None and existing.settings() == expected:
        return PreparedData(out, existing, reused=True)
    if not build:
        raise ConfigError(f"--data {source}: local rank 0 did not finish preparing {out}; see its error")
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


def _auto_tokenizer(data: DataConfig, source: str, fingerprint: str, vocab_size: int, build: bool) -> Path:
    """The cached tokenizer trained on this source at this vocabulary size; trained when missing."""
    path = data_cache_dir(data) / "tokenizers" / f"{_slug(source)}-{fingerprint[:16]}-v{vocab_size}.json"
    if path.is_file() or not build:
        return path
    docs = sources.load_documents(
        source,
        text_field=data.text_field,
        hub_config=data.hub_config,
        streaming=data.streaming,
        flag="--data",
    )
    toks.train_tokenizer(
        _capped_texts(docs, TOKENIZER_TRAIN_CHARS), vocab_size, path, flag="--set model.vocab_size"
    )
    return path


def _capped_texts(docs: sources.Documents, max_chars: int) -> Iterator[str]:
    seen = 0
    for batch in docs.iter(batch_size=BATCH_DOCS):
        for text in batch["text"]:
            yield text
            seen += len(text)
            if seen >= max_chars:
                return


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _slug(source: str) -> str:
    name = Path(source.rstrip("/")).stem if not sources.is_hub_name(source) else source.replace("/", "--")
    return re.sub(r"[^\w.-]+", "_", name)[:48] or "data"


def prepare_data_command(
    source: str,
    tokenizer_path: str,
    out_dir: str,
    *,
    text_field: str = "text",
    hub_config: str | None = None,
    streaming: bool = False,
    val_fraction: float = 0.02,
    split_seed: int = 1234,
    num_proc: int = 2,
    dtype: str = "auto",
) -> str:
    """`llmtrain prepare-data`: prepare, then a short summary for the terminal."""
    if num_proc < 1:
        raise ConfigError(f"--num-proc {num_proc}: must be at least 1")
    m = prepare_data(
        source,
        tokenizer_path,
        out_dir,
        text_field=text_field,
        hub_config=hub_config,
        streaming=streaming,
        val_fraction=val_fraction,
        split_seed=split_seed,
        num_proc=num_proc,
        dtype=dtype,
    )
    shards = sum(len(s.shards) for s in m.splits.values())
    train, val = m.splits["train"], m.splits["val"]
    return (
        f"prepared {out_dir}: {m.documents} documents, {m.tokens:,} tokens ({m.dtype}) in {shards} shards, "
        f"{m.seconds:.1f}s ({m.tokens / max(m.seconds, 1e-9):,.0f} tokens/s)\n"
        f"  train: {train.documents} documents, {train.tokens:,} tokens; "
        f"val: {val.documents} documents, {val.tokens:,} tokens"
    )
