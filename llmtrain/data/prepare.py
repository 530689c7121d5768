"""Source -> memory-mapped token shards + manifest.json (the layout is in `llmtrain.data.shards`).

Nothing is dropped, truncated or padded. Which documents are validation documents is a function of
(number of documents, val_fraction, split_seed) only, so the split does not depend on `num_proc`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import chain, pairwise
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import datasets
import numpy as np
from tokenizers import Tokenizer

from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import sources
from llmtrain.data import tokenizer as toks
from llmtrain.data.shards import (
    DTYPES,
    MANIFEST,
    SPLITS,
    TOKENIZER,
    Manifest,
    Shard,
    SplitInfo,
    splitmix64,
    token_dtype,
)
from llmtrain.fsutil import fsync_dir, refuse_foreign_names, write_atomic

BATCH_DOCS = 1024  # documents per encode_batch call
PARALLEL_MIN_BYTES = 8 << 20  # below this, starting worker processes costs more than it saves
STREAM_PIECE_DOCS = 100_000  # streaming sources: documents per shard
TOKENIZER_TRAIN_CHARS = 200_000_000  # automatic tokenizers learn from at most this much text


# ---------------------------------------------------------------- which documents are validation


def split_mask(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """True for validation documents: round(n * fraction) of them (at least one, never all), by seed."""
    mask = np.zeros(n_docs, dtype=bool)
    if val_fraction <= 0 or n_docs < 2:
        return mask
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    mask[np.random.default_rng(seed).choice(n_docs, size=n_val, replace=False)] = True
    return mask


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
    ids = toks.encode_documents(tok, texts, toks.start_ids(tok, eot))
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
    out_flag: str = "--out",
) -> Manifest:
    """Tokenize `source` into shards under `out_dir`; write manifest.json last and return it. A
    directory holding anything prepare-data did not write is refused before anything is touched."""
    started = time.perf_counter()
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    tok = toks.load_tokenizer(tokenizer_path, tokenizer_flag)
    eot = toks.eot_id(tok, tokenizer_path, tokenizer_flag)
    chosen_dtype = token_dtype(toks.vocab_size(tok), dtype)
    fingerprint = sources.source_fingerprint(source, text_field=text_field, hub_config=hub_config, flag=flag)
    docs = sources.load_documents(
        source, text_field=text_field, hub_config=hub_config, streaming=streaming, flag=flag
    )
    out = Path(out_dir).expanduser()
    refuse_foreign_files(out, out_flag)
    run = _Run(tok, eot, chosen_dtype, out, val_fraction, split_seed, _want_progress(show_progress))
    splits = run.prepare(docs, num_proc, parallel_min_bytes, where=f"{flag} {source}")
    return run.commit(source, fingerprint, text_field, splits, started)


# What prepare-data writes into its directory: shards, the tokenizer, the manifest (and write_atomic's
# temporary files, left only by a crash).
_OWN_FILE = re.compile(
    r"(train|val)-\d{5}\.bin|tokenizer\.json|manifest\.json|\.tokenizer\.json\.\d+\.tmp|\.manifest\.json\.tmp\d+"
)


def refuse_foreign_files(out: Path, flag: str) -> None:
    """`out` may be absent, empty, or hold a previous (possibly interrupted) preparation; anything else
    is the user's and is refused in one line, nothing touched: a file of another name, a manifest.json
    that is not prepare-data's, or a lone tokenizer.json (a tokenizer's own folder, not a preparation)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"{flag} {out}: not a directory; give a new or empty directory for the shards")
    names = sorted(p.name for p in out.iterdir())
    foreign = [name for name in names if not _OWN_FILE.fullmatch(name)]
    if not foreign and MANIFEST in names and not _written_by_prepare(out / MANIFEST):
        foreign = [MANIFEST]
    if not foreign and names == [TOKENIZER]:
        foreign = names
    refuse_foreign_names(flag, out, foreign, "prepare-data")


def _written_by_prepare(path: Path) -> bool:
    try:
        Manifest.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


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

    def prepare(
        self, docs: sources.Documents, num_proc: int, parallel_min_bytes: int, where: str
    ) -> dict[str, SplitInfo]:
        """Empty the output directory, save the tokenizer, tokenize every document: the splits' shards."""
        _clear_prepared(self.out)
        toks.save_tokenizer(self.tok, self.out / TOKENIZER)
        if isinstance(docs, datasets.IterableDataset):
            results = self.streaming(docs)
        else:
            results = self.table(docs, num_proc, parallel_min_bytes)
        if sum(r.text_tokens for r in results) == 0:
            _clear_prepared(self.out)
            raise ConfigError(f"{where}: empty source (every document is empty); point it at text")
        return _collect_splits(self.out, results)

    def commit(
        self, source: str, fingerprint: str, text_field: str, splits: dict[str, SplitInfo], started: float
    ) -> Manifest:
        """Write manifest.json, the commit point that makes the directory complete; return it."""
        manifest = Manifest(
            source=source,
            source_fingerprint=fingerprint,
            text_field=text_field,
            tokenizer_hash=toks.tokenizer_hash(self.tok),
            vocab_size=toks.vocab_size(self.tok),
            eot_id=self.eot,
            document_prefix=toks.start_ids(self.tok, self.eot),
            dtype=self.dtype,
            val_fraction=self.val_fraction,
            split_seed=self.seed,
            documents=sum(s.documents for s in splits.values()),
            tokens=sum(s.tokens for s in splits.values()),
            splits=splits,
            seconds=round(time.perf_counter() - started, 3),
        )
        fsync_dir(self.out)
        write_atomic(self.out / MANIFEST, manifest.to_json())
        return manifest

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


# ---------------------------------------------------------------- the automatic tokenizer of `train --data`


def train_auto_tokenizer(data: DataConfig, source: str, vocab_size: int, path: Path) -> None:
    """Train `vocab_size` tokens on (the first TOKENIZER_TRAIN_CHARS characters of) `source` into `path`."""
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


def train_mixture_tokenizer(data: DataConfig, source_list: list[str], vocab_size: int, path: Path) -> None:
    """One tokenizer for a mixture: an equal share of TOKENIZER_TRAIN_CHARS from each source, in order.

    Equal shares, not the weights: a fork may change the weights, and the tokenizer must not change.
    """
    share = TOKENIZER_TRAIN_CHARS // len(source_list)

    def documents(source: str) -> sources.Documents:
        return sources.load_documents(
            source,
            text_field=data.text_field,
            hub_config=data.hub_config,
            streaming=data.streaming,
            flag="--data",
        )

    texts = chain.from_iterable(_capped_texts(documents(source), share) for source in source_list)
    toks.train_tokenizer(texts, vocab_size, path, flag="--set model.vocab_size")


def _capped_texts(docs: sources.Documents, max_chars: int) -> Iterator[str]:
    seen = 0
    for batch in docs.iter(batch_size=BATCH_DOCS):
        for text in batch["text"]:
            yield text
            seen += len(text)
            if seen >= max_chars:
                return


# ---------------------------------------------------------------- what `llmtrain prepare-data` prints


def summary(out_dir: str | Path, m: Manifest) -> str:
    """What `llmtrain prepare-data` prints: totals, speed and the two splits."""
    shards = sum(len(s.shards) for s in m.splits.values())
    train, val = m.splits["train"], m.splits["val"]
    return (
        f"prepared {out_dir}: {_count(m.documents, 'document')}, {m.tokens:,} tokens ({m.dtype}) in "
        f"{_count(shards, 'shard')}, {m.seconds:.1f}s ({m.tokens / max(m.seconds, 1e-9):,.0f} tokens/s)\n"
        f"  train: {_count(train.documents, 'document')}, {train.tokens:,} tokens; "
        f"val: {_count(val.documents, 'document')}, {val.tokens:,} tokens"
    )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
