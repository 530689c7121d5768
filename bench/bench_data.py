"""Data pipeline benchmark: `prepare_data` against the Hugging Face `run_clm` recipe.

The recipe is what transformers' examples/pytorch/language-modeling/run_clm.py does with a JSON-lines
file: `datasets.load_dataset("json")`, then `ds.map(tokenize_function, batched=True, num_proc=N,
remove_columns=["text"])` with a `PreTrainedTokenizerFast` over the same tokenizer.json, then
`ds.map(group_texts, batched=True, num_proc=N)` into blocks of `block_size` tokens (`labels` a copy of
`input_ids`). group_texts drops what is left over at the end of each batch of 1,000 documents.
`prepare_data` writes every document, followed by its end-of-text separator, into packed token shards.

Both sides read the same file with the same tokenizer and number of processes, each repeat from a fresh
`datasets` cache (no cache hit on either side). Measured on the built-in corpus and on a synthetic
JSON-lines corpus (paragraphs of the built-in corpus drawn with a seeded RNG into documents of
log-normal lengths, 2% of the words replaced by random letters). Tokens/s counts the text's tokens,
which both sides must agree on: the recipe's before group_texts, and prepare_data's stream without its
separators, compared token for token.
Every timing, the settings and the machine go to bench/results/data.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import statistics
import string
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

import numpy as np

from bench.ranks import REPO, write_result
from llmtrain.data import corpus, prepare, shards, tokenizer

VOCAB = 8192
BLOCK_SIZE = 1024  # run_clm's default: min(1024, the tokenizer's model_max_length)
MAP_BATCH = 1000  # datasets' default batch for map(batched=True); group_texts drops per batch
REPEATS = 3
SYNTHETIC_REPEATS = 2  # its runs take minutes: two keep the benchmark within about five
SYNTHETIC_MB = 100.0
SYNTHETIC_SEED = 20240601
NEW_WORDS = 0.02  # share of the synthetic corpus's words made up of random letters
DEFAULT_OUT = REPO / "bench" / "results" / "data.json"


# ---------------------------------------------------------------- the corpora


def read_documents(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def write_synthetic(path: Path, docs: list[str], size_bytes: int, seed: int = SYNTHETIC_SEED) -> int:
    """A JSON-lines corpus of about `size_bytes`, the same bytes for the same inputs: each document
    is paragraphs of `docs` drawn at random until a log-normal length (median 3 kB, a long tail) is
    reached, with NEW_WORDS of its words replaced by random letters, so that, as in real text, words
    never seen before keep turning up. Returns the number of documents."""
    paragraphs = [p for doc in docs for p in doc.split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    letters = "".join(rng.choice(list(string.ascii_lowercase), size=1 << 20))
    draws = iter(())
    written = count = 0
    with path.open("w", encoding="utf-8") as fh:
        while written < size_bytes:
            target = int(np.clip(rng.lognormal(np.log(3000), 1.0), 200, 200_000))
            picks, length = [], 0
            while length < target:
                index = next(draws, None)
                if index is None:  # drawn in blocks: one call per paragraph would take most of the time
                    draws = iter(rng.integers(len(paragraphs), size=1 << 16).tolist())
                    continue
                picks.append(paragraphs[index])
                length += len(paragraphs[index]) + 2
            line = json.dumps({"text": _new_words("\n\n".join(picks), rng, letters)}, ensure_ascii=False)
            fh.write(line + "\n")
            written += len(line.encode("utf-8")) + 1
            count += 1
    return count


def _new_words(text: str, rng: np.random.Generator, letters: str) -> str:
    words = text.split(" ")
    chosen = np.flatnonzero(rng.random(len(words)) < NEW_WORDS).tolist()
    starts = rng.integers(len(letters) - 64, size=len(chosen)).tolist()
    for i, start in zip(chosen, starts, strict=True):
        words[i] = letters[start : start + min(max(2, len(words[i])), 60)]
    return " ".join(words)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- a fresh datasets cache per run


@contextlib.contextmanager
def datasets_cache(path: Path) -> Iterator[None]:
    """Point `datasets` (load_dataset's Arrow files, map's cache files) at `path`, an empty folder."""
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = path
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = saved


# ---------------------------------------------------------------- the run_clm recipe


def group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """run_clm's group_texts: concatenate the batch, cut it into blocks, drop the remainder."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total_length = len(concatenated[next(iter(examples))])
    total_length = (total_length // block_size) * block_size
    result = {
        k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
        for k, t in concatenated.items()
    }
    result["labels"] = result["input_ids"].copy()
    return result


@dataclass
class RecipeRun:
    seconds: float
    cpu_seconds: float  # this process's and its finished children's: what the load moves less
    tokens: int  # input_ids after tokenize_function, before group_texts
    kept: int  # input_ids after group_texts
    blocks: int


def run_recipe(source: Path, tok_path: Path, num_proc: int, block_size: int) -> tuple[RecipeRun, Any]:
    """One run of the recipe; returns its counts and the tokenized (pre-grouping) dataset."""
    import datasets
    import pyarrow.compute as pc

    datasets.disable_progress_bars()
    with environment_kept():
        started, cpu = time.perf_counter(), cpu_seconds()
        tokenized, grouped = _recipe(source, tok_path, num_proc, block_size)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    tokens = int(pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py() or 0)
    kept = grouped.num_rows * block_size
    return RecipeRun(seconds, cpu, tokens, kept, grouped.num_rows), tokenized


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (both sides' pools end in the run)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _recipe(source: Path, tok_path: Path, num_proc: int, block_size: int) -> tuple[Any, Any]:
    """run_clm's steps. map(num_proc=N) sets TOKENIZERS_PARALLELISM=false for its N processes: one
    encoding thread each, as prepare_data's workers."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    # The inputs a Llama or GPT-2 tokenizer returns (the bare class would add token_type_ids).
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_path), model_input_names=["input_ids", "attention_mask"]
    )
    raw = datasets.load_dataset("json", data_files=str(source), split="train")

    def tokenize_function(examples: dict[str, list[str]]) -> Any:
        return tok(examples["text"])

    tokenized = raw.map(
        tokenize_function,
        batched=True,
        num_proc=num_proc,
        remove_columns=raw.column_names,
        load_from_cache_file=False,
    )
    grouped = tokenized.map(
        group_texts,
        batched=True,
        num_proc=num_proc,
        fn_kwargs={"block_size": block_size},
        load_from_cache_file=False,
    )
    return tokenized, grouped


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """datasets' map(num_proc) swaps `os.environ` for a copy taken before it set TOKENIZERS_PARALLELISM=false,
    and leaves the variable set in the process's real environment. Both leak: the tokenizer would stay on
    one thread in prepare_data's turn (`llmtrain prepare-data`, a process of its own, has every thread), and
    whatever holds the original mapping (rich's Console reads COLUMNS from it) stops seeing later changes.
    The original mapping is put back, the variable unset where it was unset before."""
    environ, was_set = os.environ, "TOKENIZERS_PARALLELISM" in os.environ
    try:
        yield
    finally:
        os.environ = environ  # noqa: B003 (the original object back, not a new environment)
        if not was_set:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)  # also unsets it in the real environment


def group_texts_drop(doc_tokens: list[int], num_proc: int, block_size: int, batch: int = MAP_BATCH) -> int:
    """The tokens group_texts drops, from the documents' token counts: map(num_proc=N) cuts the rows
    into N contiguous shards (datasets' `shard(contiguous=True)`), each mapped in batches of `batch`
    rows, and each batch loses its total modulo block_size."""
    n = len(doc_tokens)
    size, extra = divmod(n, num_proc)
    bounds = [size * i + min(i, extra) for i in range(num_proc + 1)]
    dropped = 0
    for start, stop in pairwise(bounds):
        for first in range(start, stop, batch):
            dropped += sum(doc_tokens[first : min(first + batch, stop)]) % block_size
    return dropped


# ---------------------------------------------------------------- llmtrain


@dataclass
class PrepareRun:
    seconds: float
    cpu_seconds: float
    tokens: int  # the text's tokens: the stream without its separators (and start tokens)
    stream_tokens: int  # everything written, separators included
    documents: int


def run_prepare(source: Path, tok_path: Path, out: Path, num_proc: int) -> PrepareRun:
    started, cpu = time.perf_counter(), cpu_seconds()
    manifest = prepare.prepare_data(
        str(source), tok_path, out, val_fraction=0.0, num_proc=num_proc, show_progress=False
    )
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    per_doc = 1 + len(manifest.document_prefix)
    text_tokens = manifest.tokens - manifest.documents * per_doc
    return PrepareRun(seconds, cpu, text_tokens, manifest.tokens, manifest.documents)


def document_tokens(prepared: Path) -> tuple[np.ndarray, list[int]]:
    """The text's tokens of a prepared directory in document order (separators and start tokens
    removed), and each document's count."""
    ds = shards.open_prepared(prepared)
    stream = ds.stream("train")
    ids = np.asarray(stream.read(0, len(stream)))
    eot, prefix = ds.manifest.eot_id, len(ds.manifest.document_prefix)
    ends = np.flatnonzero(ids == eot)
    starts = np.concatenate(([0], ends[:-1] + 1)) + prefix
    keep = np.ones(len(ids), dtype=bool)
    keep[ends] = False
    for k in range(prefix):
        keep[starts - prefix + k] = False
    return ids[keep], (ends - starts).tolist()


def same_tokens(prepared: Path, tokenized: Any) -> tuple[bool, list[int]]:
    """prepare_data's text tokens equal the recipe's input_ids, token for token, in order."""
    import pyarrow.compute as pc

    ours, per_doc = document_tokens(prepared)
    theirs = pc.list_flatten(tokenized.data.column("input_ids")).to_numpy()
    return bool(len(ours) == len(theirs) and np.array_equal(ours, theirs)), per_doc


# ---------------------------------------------------------------- one corpus, both sides


def measure(
    name: str, source: Path, tok_path: Path, work: Path, num_proc: int, block_size: int, repeats: int
) -> dict[str, Any]:
    """Alternate the two sides `repeats` times (load drifts hit both), each in a fresh cache; check the
    last repeat's outputs against each other."""
    recipe_s, prepare_s, recipe_cpu, prepare_cpu = [], [], [], []
    for i in range(repeats):
        last = i == repeats - 1
        run_dir = work / f"{name}-{i}"
        with datasets_cache(run_dir / "recipe-cache"):
            recipe, tokenized = run_recipe(source, tok_path, num_proc, block_size)
        recipe_s.append(recipe.seconds)
        recipe_cpu.append(recipe.cpu_seconds)
        with datasets_cache(run_dir / "prepare-cache"):
            ours = run_prepare(source, tok_path, run_dir / "prepared", num_proc)
        prepare_s.append(ours.seconds)
        prepare_cpu.append(ours.cpu_seconds)
        if last:
            identical, per_doc = same_tokens(run_dir / "prepared", tokenized)
        del tokenized
        if not last:
            shutil.rmtree(run_dir)
    expected_drop = group_texts_drop(per_doc, num_proc, block_size)
    text_bytes = source.stat().st_size
    best_recipe, best_prepare = min(recipe_s), min(prepare_s)
    result = {
        "corpus": name,
        "file_bytes": text_bytes,
        "documents": ours.documents,
        "text_tokens": ours.tokens,
        "recipe": {
            **asdict(recipe),
            "seconds": best_recipe,
            "samples_s": recipe_s,
            "cpu_seconds": min(recipe_cpu),
            "cpu_samples_s": recipe_cpu,
        },
        "prepare": {
            **asdict(ours),
            "seconds": best_prepare,
            "samples_s": prepare_s,
            "cpu_seconds": min(prepare_cpu),
            "cpu_samples_s": prepare_cpu,
        },
        "recipe_tokens_per_s": recipe.tokens / best_recipe,
        "prepare_tokens_per_s": ours.tokens / best_prepare,
        "ratio": best_recipe / best_prepare,
        "ratio_median": statistics.median(recipe_s) / statistics.median(prepare_s),
        "cpu_ratio": min(recipe_cpu) / min(prepare_cpu),
        "recipe_dropped_tokens": recipe.tokens - recipe.kept,
        "recipe_dropped_expected": expected_drop,
        "recipe_dropped_fraction": (recipe.tokens - recipe.kept) / recipe.tokens,
        "prepare_dropped_tokens": recipe.tokens - ours.tokens,
        "same_tokens": identical,
    }
    check(result)
    return result


def check(r: dict[str, Any]) -> None:
    """The comparison means something only if both sides tokenized the same text the same way."""
    assert r["recipe"]["tokens"] == r["text_tokens"], f"{r['corpus']}: the two sides count different tokens"
    assert r["same_tokens"], f"{r['corpus']}: prepare_data's tokens differ from the recipe's input_ids"
    assert r["recipe_dropped_tokens"] == r["recipe_dropped_expected"], f"{r['corpus']}: unexpected drop"


# ---------------------------------------------------------------- the command


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_data", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON results go")
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count() or 1, help="processes, both sides (default: cores)"
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="group_texts' block size")
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help="runs of each side on the built-in corpus (best kept)"
    )
    parser.add_argument(
        "--synthetic-repeats",
        type=int,
        default=SYNTHETIC_REPEATS,
        help="runs of each side on the synthetic one",
    )
    parser.add_argument(
        "--synthetic-mb", type=float, default=SYNTHETIC_MB, help="size of the synthetic corpus; 0 skips it"
    )
    args = parser.parse_args(argv)
    for flag in ("num_proc", "block_size", "repeats", "synthetic_repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m bench` calls this with no arguments: the defaults."""
    args = parse_args(argv or [])
    from llmtrain import rundir

    builtin = corpus.builtin_corpus()
    docs = read_documents(builtin)
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        work = Path(tmp)
        tok_path = work / "tokenizer.json"
        tokenizer.train_tokenizer(docs, VOCAB, tok_path)
        corpora = [("built-in", builtin, args.repeats)]
        synthetic: dict[str, Any] = {}
        if args.synthetic_mb > 0:
            path = work / "synthetic.jsonl"
            size = int(args.synthetic_mb * 1e6)
            synthetic = {
                "bytes": size,
                "seed": SYNTHETIC_SEED,
                "documents": write_synthetic(path, docs, size),
            }
            synthetic["sha256"] = sha256_file(path)
            corpora.append(("synthetic", path, args.synthetic_repeats))
        results = [
            measure(name, path, tok_path, work, args.num_proc, args.block_size, repeats)
            for name, path, repeats in corpora
        ]
    print_table(results, args)
    result = {
        "settings": {
            "vocab": VOCAB,
            "block_size": args.block_size,
            "map_batch": MAP_BATCH,
            "num_proc": args.num_proc,
            "repeats": args.repeats,
            "synthetic_repeats": args.synthetic_repeats,
            "builtin_corpus": builtin.name,
            "synthetic": synthetic,
        },
        "machine": rundir.environment(1),
        "corpora": results,
    }
    write_result(result, args.out)
    return result


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"run_clm recipe (load_dataset json, map tokenize + group_texts, block_size {args.block_size}) "
        f"vs prepare_data; {args.num_proc} processes each, BPE vocabulary {VOCAB}; best of "
        f"{args.repeats} (built-in), {args.synthetic_repeats} (synthetic)"
    )
    print(
        f"{'corpus':<10} {'documents':>10} {'MB':>7} {'tokens':>12} {'recipe tok/s':>13} "
        f"{'prepare tok/s':>14} {'ratio':>6} {'cpu ratio':>9} {'recipe drops':>13} {'prepare drops':>14}"
    )
    for r in results:
        print(
            f"{r['corpus']:<10} {r['documents']:>10,} {r['file_bytes'] / 1e6:>7.1f} {r['text_tokens']:>12,} "
            f"{r['recipe_tokens_per_s']:>13,.0f} {r['prepare_tokens_per_s']:>14,.0f} {r['ratio']:>5.2f}x "
            f"{r['cpu_ratio']:>8.2f}x "
            f"{r['recipe_dropped_fraction']:>13.3%} {r['prepare_dropped_tokens']:>14,}"
        )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
