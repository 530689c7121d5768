"""bench_data: the run_clm recipe's group_texts and what it drops, the synthetic corpus, and one
measurement on a small corpus where both sides must count the same tokens, token for token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchkit import assert_printed_and_written

from bench.bench_data import (
    NEW_WORDS,
    group_texts,
    group_texts_drop,
    main,
    measure,
    parse_args,
    read_documents,
    write_synthetic,
)
from llmtrain.data import corpus
from llmtrain.data import tokenizer as toks


def test_group_texts_cuts_the_batch_into_blocks_and_drops_the_rest() -> None:
    batch = {"input_ids": [[1, 2, 3], [4, 5, 6, 7]], "attention_mask": [[1, 1, 1], [1, 1, 1, 1]]}
    grouped = group_texts(batch, 3)
    assert grouped["input_ids"] == [[1, 2, 3], [4, 5, 6]] == grouped["labels"]
    assert grouped["attention_mask"] == [[1, 1, 1], [1, 1, 1]]  # token 7 is gone


def test_the_drop_follows_datasets_shards_and_batches() -> None:
    assert group_texts_drop([600, 600, 600], 1, 1024) == 1800 % 1024  # one batch
    assert group_texts_drop([600, 600, 600], 2, 1024) == 1200 % 1024 + 600  # shards [0, 2) and [2, 3)
    assert group_texts_drop([600, 600, 600], 1, 1024, batch=2) == 1200 % 1024 + 600
    assert group_texts_drop([5] * 7, 3, 4, batch=2) == (10 % 4 + 5 % 4) + 10 % 4 + 10 % 4  # 3, 2, 2 rows


def test_the_synthetic_corpus_is_deterministic_varied_and_keeps_meeting_new_words(tmp_path: Path) -> None:
    docs = read_documents(corpus.builtin_corpus())
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    count = write_synthetic(a, docs, 300_000)
    assert write_synthetic(b, docs, 300_000) == count and a.read_bytes() == b.read_bytes()
    assert 300_000 <= a.stat().st_size < 300_000 + 250_000  # stops after the document that crosses it
    texts = [json.loads(line)["text"] for line in a.read_text(encoding="utf-8").splitlines()]
    assert len(texts) == count and min(map(len, texts)) < 1000 < max(map(len, texts))
    known = {w for d in docs for w in d.split()}
    words = [w for t in texts for w in t.split()]
    unseen = sum(w not in known for w in words) / len(words)
    assert NEW_WORDS / 2 < unseen < NEW_WORDS * 2


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """2,100 short documents (lines of the built-in corpus, some not ASCII), so that map(num_proc=2)
    maps two shards of 1,050 rows, each in a batch of 1,000 and one of 50; and a small tokenizer."""
    work = tmp_path_factory.mktemp("small")
    lines = [line for d in read_documents(corpus.builtin_corpus()) for line in d.splitlines() if line.strip()]
    texts = [*lines[:2090], *(line for line in lines if not line.isascii())][:2100]
    source = work / "small.jsonl"
    source.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    toks.train_tokenizer(texts, 1000, work / "tok.json")
    return source, work / "tok.json"


def test_both_sides_count_the_same_tokens_and_only_group_texts_drops_any(
    small_corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    source, tok = small_corpus
    environ = os.environ
    r = measure("small", source, tok, tmp_path, num_proc=2, block_size=64, repeats=1)
    # datasets' map(num_proc) swaps os.environ for a copy: the benchmark puts the process's own back
    # (rich's Console, among others, keeps reading the original; COLUMNS set later would be lost).
    assert os.environ is environ
    assert r["documents"] == 2100
    assert r["same_tokens"] and r["recipe"]["tokens"] == r["text_tokens"] == r["prepare"]["tokens"]
    assert r["prepare"]["stream_tokens"] == r["text_tokens"] + r["documents"]  # one separator each
    assert r["prepare_dropped_tokens"] == 0
    assert 0 < r["recipe_dropped_tokens"] == r["recipe_dropped_expected"] < 4 * 64  # four batches
    assert r["recipe"]["kept"] == r["recipe"]["blocks"] * 64 == r["text_tokens"] - r["recipe_dropped_tokens"]
    assert r["ratio"] == r["recipe"]["seconds"] / r["prepare"]["seconds"] > 0


def test_flags() -> None:
    assert parse_args([]).block_size == 1024 and parse_args([]).synthetic_mb == 100
    assert parse_args([]).repeats == 3 and parse_args([]).synthetic_repeats == 2
    for bad in (["--num-proc", "0"], ["--repeats", "0"], ["--synthetic-repeats", "0"], ["--block-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.slow
def test_the_whole_benchmark_on_a_small_synthetic_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results" / "data.json"
    flags = ["--synthetic-mb", "0.5", "--repeats", "1", "--synthetic-repeats", "1", "--num-proc", "2"]
    result = main([*flags, "--out", str(out)])
    printed = capsys.readouterr().out
    assert_printed_and_written(printed, result, out)
    assert [r["corpus"] for r in result["corpora"]] == ["built-in", "synthetic"]
    assert result["settings"]["num_proc"] == 2 and result["settings"]["synthetic"]["bytes"] == 500_000
    for r in result["corpora"]:
        assert r["same_tokens"] and r["prepare_dropped_tokens"] == 0
        assert r["recipe_dropped_tokens"] == r["recipe_dropped_expected"]
        assert f"{r['ratio']:.2f}x" in printed
    assert "machine" in result and result["machine"]["cpu_count"] >= 1
