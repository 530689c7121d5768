"""Data pipeline benchmark on the built-in corpus at seq_len 512.

Baseline: the per-item Dataset most scripts start with: a loop calling `tokenizer.encode` once per
document, each example padded to seq_len (either truncated to one example, as
`tokenizer(text, truncation=True, padding="max_length")` does, or cut into seq_len chunks with the
last one padded, which loses nothing). Compared with `prepare_data` (batched encode into packed
token shards) on tokens per second, and on the fraction of padding tokens the model would be fed.
Every timing, the settings and the machine go to bench/results/data.json (--out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.ranks import REPO, write_result
from llmtrain.data import corpus, prepare, shards, tokenizer

SEQ_LEN = 512
VOCAB = 8192
REPEATS = 3  # best of, to damp noise from other work on the machine
DEFAULT_OUT = REPO / "bench" / "results" / "data.json"


def per_item_baseline(tok_path: Path, docs: list[str]) -> dict[str, Any]:
    """Encode one document at a time and pad every example to SEQ_LEN; best time of REPEATS."""
    tok = tokenizer.load_tokenizer(tok_path)
    pad = tok.token_to_id(tokenizer.PAD)
    assert pad is not None
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        truncated: list[np.ndarray] = []
        chunked: list[np.ndarray] = []
        for doc in docs:
            ids = tok.encode(doc, add_special_tokens=False).ids
            truncated.append(_padded(ids[:SEQ_LEN], pad))
            chunked.extend(_padded(ids[i : i + SEQ_LEN], pad) for i in range(0, max(len(ids), 1), SEQ_LEN))
        batch_trunc, batch_chunk = np.stack(truncated), np.stack(chunked)
        times.append(time.perf_counter() - started)
    tokens = int((batch_chunk != pad).sum())
    return {
        "seconds": min(times),
        "samples_s": times,
        "tokens": tokens,
        "pad_fraction_truncate": float((batch_trunc == pad).mean()),
        "dropped_fraction_truncate": 1 - float((batch_trunc != pad).sum()) / tokens,
        "pad_fraction_chunk": float((batch_chunk == pad).mean()),
    }


def _padded(ids: list[int], pad: int) -> np.ndarray:
    row = np.full(SEQ_LEN, pad, dtype=np.int32)
    row[: len(ids)] = ids
    return row


def packed(source: Path, tok_path: Path, work: Path) -> dict[str, Any]:
    """prepare_data into shards, best time of REPEATS (the first run also warms the datasets cache)."""
    times, manifest = [], None
    for i in range(REPEATS + 1):
        started = time.perf_counter()
        manifest = prepare.prepare_data(
            str(source), tok_path, work / f"prep{i}", val_fraction=0.0, show_progress=False
        )
        if i > 0:
            times.append(time.perf_counter() - started)
    assert manifest is not None
    stream = shards.open_prepared(work / f"prep{REPEATS}").stream("train")
    tokens = stream.read(0, len(stream))
    pad = tokenizer.load_tokenizer(tok_path).token_to_id(tokenizer.PAD)
    return {
        "seconds": min(times),
        "samples_s": times,
        "tokens": manifest.tokens - manifest.documents,  # without the separators, as the baseline counts
        "pad_fraction": float((tokens == pad).mean()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_data", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    out = parser.parse_args(argv or []).out
    from llmtrain import rundir

    source = corpus.builtin_corpus()
    docs = [json.loads(line)["text"] for line in source.read_text(encoding="utf-8").splitlines()]
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        work = Path(tmp)
        tok_path = work / "tokenizer.json"
        tokenizer.train_tokenizer(docs, VOCAB, tok_path)
        base = per_item_baseline(tok_path, docs)
        pack = packed(source, tok_path, work)
    assert base["tokens"] == pack["tokens"], "both paths must tokenize the same text"
    base_tps, pack_tps = base["tokens"] / base["seconds"], pack["tokens"] / pack["seconds"]
    size_mb = source.stat().st_size / 1e6
    print(f"built-in corpus {source.name}: {len(docs)} documents, {size_mb:.1f} MB, {pack['tokens']:,} tokens "
          f"(byte-level BPE, vocab {VOCAB}), seq_len {SEQ_LEN}, best of {REPEATS}")  # fmt: skip
    print(f"  per-document tokenizer.encode loop + pad: {base_tps:>12,.0f} tokens/s")
    print(
        f"  prepare_data (batched, packed shards):    {pack_tps:>12,.0f} tokens/s   {pack_tps / base_tps:.2f}x"
    )
    print(
        f"  padding tokens fed to the model: per-item truncate+pad {base['pad_fraction_truncate']:.1%} "
        f"(and {base['dropped_fraction_truncate']:.1%} of the text truncated away), "
        f"per-item chunk+pad {base['pad_fraction_chunk']:.1%}, packing {pack['pad_fraction']:.1%}"
    )
    result = {
        "settings": {"seq_len": SEQ_LEN, "vocab": VOCAB, "repeats": REPEATS, "corpus": source.name},
        "machine": rundir.environment(1),
        "documents": len(docs),
        "tokens": pack["tokens"],
        "baseline": base,
        "prepare": pack,
        "baseline_tokens_per_s": base_tps,
        "prepare_tokens_per_s": pack_tps,
        "speedup": pack_tps / base_tps,
    }
    write_result(result, out)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
