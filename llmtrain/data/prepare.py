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
from tokenizers import Tokenizer, pre_tokenizers

from llmtrain import terminal
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


# ---------------------------------------------------------------- encoding documents

# The pattern the byte-level pre-tokenizer cuts text with (GPT-2's), with its classes \s (less the space,
# which the pattern names itself), \p{L} and \p{N} left as slots for the characters the tokenizer puts
# in them. Python's `re` and the tokenizer's regex engine both take the first alternative that matches.
_BYTE_LEVEL_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^ {S}{L}{N}]+|[ {S}]+(?![^ {S}])|[ {S}]+"
# A character between two letters, two digits and two marks: how many pieces the tokenizer cuts each
# into tells which class its pattern gives the character.
_PROBES = ("a{}a", "0{}0", "!{}!")
_CLASS_BY_PIECES: dict[tuple[int, ...], str] = {
    (1, 3, 3): "L",
    (3, 1, 3): "N",
    (3, 3, 1): "O",
    (3, 3, 3): "S",
}
_SELF_TEST = [
    "it's we'll I'd they're you've I'm don't 'S ''s x's  'll 're've'm'd't",
    "a  b   c\t\td\n\n  e \n\r\n\x0b\x0c\x1c\x1f\x7f\x00 end   ",
    "12345 x1y2 3.14 !!! ... ?!? --> ''' \"\"\" <|endoftext|> <|pad|>",
    "naïve café 東京 ١٢٣ Ⅻ ½ \u00a0nbsp \u2003em x\u3000y \u0085 e\u0301 🙂",
]
PIECE_CACHE = 1 << 18  # distinct pieces remembered (tens of MB a process), before the memory starts over


def _splits_like_byte_level(tok: Tokenizer) -> bool:
    """Does `tok` cut text with the byte-level pattern alone and encode each piece on its own? No
    normalizer, no prefix space, no added token that is not special (special ones are read as text),
    no truncation or padding: then a document's ids are its pieces' ids, in order."""
    pre = tok.pre_tokenizer
    return (
        isinstance(pre, pre_tokenizers.ByteLevel)
        and pre.use_regex
        and not pre.add_prefix_space
        and tok.normalizer is None
        and tok.truncation is None
        and tok.padding is None
        and tok.encode_special_tokens
        and all(token.special for token in tok.get_added_tokens_decoder().values())
    )


def _char_class(chars: set[str]) -> str:
    return "".join(f"\\U{ord(c):08x}" for c in sorted(chars))


class _DocumentEncoder:
    """The ids `toks.encode_documents` gives, for a third of the work with tokenizers that cut text with
    the byte-level pattern alone (llmtrain's own): Python's `re` cuts the pieces, and each distinct
    piece is encoded once by the tokenizer and remembered.

    The pattern's classes hold what the tokenizer says: each character met is classified by how the
    tokenizer cuts it (`_PROBES`), so both sides use the same Unicode tables. A document with a
    character that fits no class, and every document of another kind of tokenizer, is encoded by the
    tokenizer; so is everything when a sample of awkward text (`_SELF_TEST`) comes out differently.
    """

    def __init__(self, tok: Tokenizer, prefix: list[int]) -> None:
        self.tok, self.prefix = tok, prefix
        self.pieces: dict[str, list[int]] = {}
        self.classes: dict[str, set[str]] = {name: set() for name in "LNSO"}
        self.unclassified: set[str] = set()
        self.known: set[str] = set()  # every character classified (or not classifiable) so far
        self.split = self.unknown = re.compile("")  # built by _learn
        self.refuse: re.Pattern[str] | None = None  # matches an unclassifiable character
        self.fast = _splits_like_byte_level(tok)
        if self.fast:
            self._learn({chr(i) for i in range(128)} - {" "})
            self.fast = all(self.classes[name] for name in "LNS") and self._agrees(_SELF_TEST)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids: `prefix`, then the text's (the separator after it is the caller's)."""
        if not self.fast:
            return toks.encode_documents(self.tok, texts, self.prefix)
        self._learn(
            set().union(*(t for t in texts if not t.isascii() and self.unknown.search(t))) - self.known
        )
        cut = [None if self._refused(t) else self.split.findall(t) for t in texts]
        self._remember(set(chain.from_iterable(pieces for pieces in cut if pieces is not None)))
        refused = [t for t, pieces in zip(texts, cut, strict=True) if pieces is None]
        slow = iter(toks.encode_documents(self.tok, refused, self.prefix) if refused else [])
        ids = self.pieces.__getitem__
        return [next(slow) if p is None else [*self.prefix, *chain.from_iterable(map(ids, p))] for p in cut]

    def _refused(self, text: str) -> bool:
        return self.refuse is not None and self.refuse.search(text) is not None

    def _remember(self, pieces: set[str]) -> None:
        """Encode the pieces not remembered yet, in one batch."""
        missing = pieces.difference(self.pieces)
        if len(self.pieces) + len(missing) > PIECE_CACHE:
            self.pieces.clear()
            missing = pieces
        order = list(missing)
        for piece, enc in zip(order, self.tok.encode_batch(order, add_special_tokens=False), strict=True):
            self.pieces[piece] = enc.ids

    def _learn(self, chars: set[str]) -> None:
        """Classify `chars` and build the patterns that use the classes again."""
        if not chars:
            return
        for c in chars:
            name = self._classify(c)
            (self.unclassified if name is None else self.classes[name]).add(c)
        self.known = {" ", *self.unclassified, *chain.from_iterable(self.classes.values())}
        letters, digits, spaces = (_char_class(self.classes[name]) for name in "LNS")
        self.split = re.compile(_BYTE_LEVEL_SPLIT.format(L=letters, N=digits, S=spaces))
        self.unknown = re.compile(f"[^{_char_class(self.known)}]")
        self.refuse = re.compile(f"[{_char_class(self.unclassified)}]") if self.unclassified else None

    def _classify(self, c: str) -> str | None:
        try:
            pieces = tuple(len(self.tok.pre_tokenizer.pre_tokenize_str(p.format(c))) for p in _PROBES)
        except Exception:  # one the tokenizer cannot take (a lone surrogate): it fails on the document too
            return None
        return _CLASS_BY_PIECES.get(pieces)

    def _agrees(self, texts: list[str]) -> bool:
        try:
            return self.encode(texts) == toks.encode_documents(self.tok, texts, self.prefix)
        except Exception:
            return False


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

    def write(self, split: str, docs: list[list[int]], eot: int) -> int:
        """Append the documents, each followed by `eot`; the number of tokens written."""
        flat: list[int] = []
        for doc in docs:  # one list, then one conversion: faster than numpy iterating nested iterators
            flat += doc
            flat.append(eot)
        np.array(flat, dtype=self.dtype).tofile(self.files[split])
        self.documents[split] += len(docs)
        self.tokens[split] += len(flat)
        return len(flat)

    def close(self) -> None:
        for fh in self.files.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()


def _encode_into(
    writer: _ShardWriter, encoder: _DocumentEncoder, eot: int, texts: list[str], is_val: np.ndarray
) -> int:
    """Encode `texts` into their splits' shards; the number of tokens other than the separators."""
    docs = encoder.encode(texts)
    text_tokens = 0
    for split, pick in (("train", ~is_val), ("val", is_val)):
        chosen = [d for d, keep in zip(docs, pick, strict=True) if keep]
        if chosen:
            text_tokens += writer.write(split, chosen, eot) - len(chosen)
    return text_tokens


def _tokenize_piece(
    ds: datasets.Dataset,
    piece: _Piece,
    mask: np.ndarray,
    encoder: _DocumentEncoder,
    eot: int,
    dtype: str,
    out_dir: str,
) -> _PieceResult:
    """Encode documents [start, stop) in batches into one shard pair (inline, or in a worker)."""
    writer = _ShardWriter(Path(out_dir), piece.index, dtype)
    text_tokens = 0
    try:
        part = ds.select(range(piece.start, piece.stop))
        offset = piece.start
        for batch in part.iter(batch_size=BATCH_DOCS):
            texts = batch["text"]
            text_tokens += _encode_into(writer, encoder, eot, texts, mask[offset : offset + len(texts)])
            offset += len(texts)
    finally:
        writer.close()
    return _PieceResult(piece.index, writer.documents, writer.tokens, text_tokens)


def _encoder(tok_json: str, prefix: list[int]) -> _DocumentEncoder:
    tok = Tokenizer.from_str(tok_json)
    tok.encode_special_tokens = True  # document text is text, special tokens' spellings included
    return _DocumentEncoder(tok, prefix)


_worker_encoder: _DocumentEncoder | None = None  # a worker process's, built once: its pieces outlive a shard


def _worker_init(tok_json: str, prefix: list[int]) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no nested threads
    _worker_encoder = _encoder(tok_json, prefix)


def _tokenize_piece_in_worker(
    ds: datasets.Dataset, piece: _Piece, mask: np.ndarray, eot: int, dtype: str, out_dir: str
) -> _PieceResult:
    assert _worker_encoder is not None, "_worker_init builds it"
    return _tokenize_piece(ds, piece, mask, _worker_encoder, eot, dtype, out_dir)


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
        with _progress(self.progress, n) as advance:
            if not parallel:
                encoder = self.encoder()
                results = []
                for p in pieces:
                    results.append(_tokenize_piece(ds, p, mask, encoder, self.eot, self.dtype, str(self.out)))
                    advance(p.stop - p.start)
                return results
            return self._in_processes(ds, pieces, mask, num_proc, advance)

    def encoder(self) -> _DocumentEncoder:
        return _encoder(self.tok.to_str(), toks.start_ids(self.tok, self.eot))

    def _in_processes(
        self,
        ds: datasets.Dataset,
        pieces: list[_Piece],
        mask: np.ndarray,
        num_proc: int,
        advance: Callable[[int], None],
    ) -> list[_PieceResult]:
        # fork where the platform has it: spawn would re-import the caller's __main__ in every worker.
        # The workers encode single-threaded (_worker_init), so the parent's tokenizer threads are moot.
        ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
        setup = (self.tok.to_str(), toks.start_ids(self.tok, self.eot))
        results = []
        with ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=_worker_init, initargs=setup) as pool:
            futures = {
                pool.submit(_tokenize_piece_in_worker, ds, p, mask, self.eot, self.dtype, str(self.out)): p
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
        encoder = self.encoder()
        text_tokens = 0
        with _progress(self.progress, None) as advance:
            for batch in ds.iter(batch_size=self.batch_docs):
                texts = batch["text"]
                is_val = _streaming_val(np.arange(seen, seen + len(texts)), self.val_fraction, self.seed)
                text_tokens += _encode_into(writer, encoder, self.eot, texts, is_val)
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("tokenizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("documents"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=terminal.console(stderr=True), transient=True) as bar:
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
