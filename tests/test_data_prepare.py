"""prepare_data and the cache: exact token accounting, split, dtype, commit-last, reuse and rebuild."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import cache, shards
from llmtrain.data import prepare as prep
from llmtrain.data import tokenizer as toks

WORDS = [
    "the",
    "a",
    "model",
    "token",
    "data",
    "train",
    "step",
    "loss",
    "batch",
    "shard",
    "python",
    "docs",
    "value",
    "error",
    "state",
    "rank",
    "epoch",
]


def make_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) for _ in range(n)]
    docs[3] = ""  # an empty document still gets its end-of-text token
    docs[5] = "literal <|endoftext|> inside a document, and ünïcödé"
    docs[7] = "line one\n\n    indented code()\n"
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, list[str]]:
    docs = make_documents(60)
    return write_jsonl(tmp_path / "docs.jsonl", docs), docs


@pytest.fixture
def tok_path(tmp_path: Path) -> Path:
    toks.train_tokenizer(make_documents(40, 1), 400, tmp_path / "tok.json")
    return tmp_path / "tok.json"


def expected_stream(tok: Tokenizer, docs: list[str], mask: np.ndarray) -> np.ndarray:
    eot = toks.eot_id(tok)
    out: list[int] = []
    for doc, keep in zip(docs, mask, strict=True):
        if keep:
            out += [*tok.encode(doc, add_special_tokens=False).ids, eot]
    return np.array(out, dtype=np.int64)


def test_shards_hold_exactly_the_tokenizer_output_plus_one_eot_per_document(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, docs = source
    m = prep.prepare_data(str(path), tok_path, tmp_path / "out", val_fraction=0.2, split_seed=7)
    prepared = shards.open_prepared(tmp_path / "out")
    tok = toks.load_tokenizer(tok_path)
    is_val = prep.split_mask(len(docs), 0.2, 7)
    assert is_val.sum() == 12
    for split, mask in (("train", ~is_val), ("val", is_val)):
        stream = prepared.stream(split)
        got = stream.read(0, len(stream)).astype(np.int64)
        np.testing.assert_array_equal(got, expected_stream(tok, docs, mask))
        assert m.splits[split].documents == int(mask.sum())
        assert (got == m.eot_id).sum() == int(mask.sum())  # one separator per document, none from text
        assert (got == tok.token_to_id(toks.PAD)).sum() == 0  # no padding anywhere
    assert m.documents == len(docs) and m.tokens == m.splits["train"].tokens + m.splits["val"].tokens
    assert m.dtype == "uint16" and m.tokenizer_hash == toks.tokenizer_hash(tok)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_worker_processes_write_the_same_stream_as_one_process(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, _ = source
    prep.prepare_data(str(path), tok_path, tmp_path / "one", num_proc=1)
    m = prep.prepare_data(
        str(path), tok_path, tmp_path / "two", num_proc=2, parallel_min_bytes=0, dtype="uint32"
    )
    assert len(m.splits["train"].shards) > 1 and m.dtype == "uint32"
    for split in ("train", "val"):
        a = shards.open_prepared(tmp_path / "one").stream(split)
        b = shards.open_prepared(tmp_path / "two").stream(split)
        np.testing.assert_array_equal(a.read(0, len(a)), b.read(0, len(b)))


def test_split_is_deterministic_from_the_seed() -> None:
    a, b, c = prep.split_mask(1000, 0.1, 1), prep.split_mask(1000, 0.1, 1), prep.split_mask(1000, 0.1, 2)
    assert a.sum() == 100 and np.array_equal(a, b) and not np.array_equal(a, c)
    assert prep.split_mask(10, 0.0, 1).sum() == 0 and prep.split_mask(3, 0.01, 1).sum() == 1


def test_token_dtype_choice_and_refusal() -> None:
    assert shards.token_dtype(65536) == "uint16" and shards.token_dtype(65537) == "uint32"
    assert shards.token_dtype(50000, "uint32") == "uint32"
    with pytest.raises(
        ConfigError, match="--dtype uint16: holds token ids below 65536, but the tokenizer has 70000"
    ):
        shards.token_dtype(70000, "uint16")


def test_an_interrupted_preparation_never_looks_complete(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, _ = source
    out = tmp_path / "out"
    m = prep.prepare_data(str(path), tok_path, out)
    assert shards.read_manifest(out) == m
    shard = out / m.splits["train"].shards[0].file
    shard.write_bytes(shard.read_bytes()[:-2])  # a shard cut short
    assert shards.read_manifest(out) is None
    (out / "manifest.json").unlink()  # killed before the commit
    assert shards.read_manifest(out) is None
    with pytest.raises(ConfigError, match="not a complete prepared dataset"):
        shards.open_prepared(out)


def _cfg(tmp_path: Path, source: Path, tokenizer: Path | None, **kw) -> DataConfig:
    return DataConfig(
        source=str(source),
        tokenizer=str(tokenizer) if tokenizer else None,
        cache_dir=str(tmp_path / "cache"),
        **kw,
    )


def test_cache_reuses_unchanged_data_and_rebuilds_on_any_change(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, docs = source
    first = cache.ensure_prepared(_cfg(tmp_path, path, tok_path), 512)
    again = cache.ensure_prepared(_cfg(tmp_path, path, tok_path), 512)
    assert not first.reused and again.reused and again.path == first.path

    other_tok = toks.train_tokenizer(make_documents(40, 2), 300, tmp_path / "other.json")
    with_other = cache.ensure_prepared(_cfg(tmp_path, path, tmp_path / "other.json"), 512)
    assert not with_other.reused and with_other.manifest.tokenizer_hash == toks.tokenizer_hash(other_tok)

    resplit = cache.ensure_prepared(_cfg(tmp_path, path, tok_path, split_seed=99), 512)
    assert not resplit.reused and resplit.path != first.path

    write_jsonl(path, [*docs, "one more document"])  # the source changed
    grown = cache.ensure_prepared(_cfg(tmp_path, path, tok_path), 512)
    assert not grown.reused and grown.manifest.documents == len(docs) + 1


def test_a_cache_directory_prepared_with_other_settings_is_rebuilt(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, _ = source
    first = cache.ensure_prepared(_cfg(tmp_path, path, tok_path), 512)
    stale = json.loads((first.path / "manifest.json").read_text())
    stale["tokenizer_hash"] = "0" * 64  # as if this directory held another tokenizer's shards
    (first.path / "manifest.json").write_text(json.dumps(stale))
    rebuilt = cache.ensure_prepared(_cfg(tmp_path, path, tok_path), 512)
    assert not rebuilt.reused and rebuilt.path == first.path
    assert rebuilt.manifest.settings() == first.manifest.settings()
    assert shards.read_manifest(first.path) == rebuilt.manifest


def test_without_a_tokenizer_one_is_trained_for_the_source_and_cached(
    tmp_path: Path, source: tuple[Path, list[str]]
) -> None:
    path, _ = source
    first = cache.ensure_prepared(_cfg(tmp_path, path, None), 320)
    assert first.vocab_size <= 320
    trained = list((tmp_path / "cache" / "tokenizers").glob("*-v320.json"))
    assert len(trained) == 1
    assert cache.ensure_prepared(_cfg(tmp_path, path, None), 320).reused


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, _ = source
    size = toks.vocab_size(toks.load_tokenizer(tok_path))
    assert 320 < size <= 384
    with pytest.raises(
        ConfigError, match=r"more than model.vocab_size=300; raise it \(--set model.vocab_size=384\)"
    ):
        cache.ensure_prepared(_cfg(tmp_path, path, tok_path), 300)


def test_train_data_can_be_a_prepared_directory(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    path, _ = source
    prep.prepare_data(str(path), tok_path, tmp_path / "prepared")
    opened = cache.ensure_prepared(_cfg(tmp_path, tmp_path / "prepared", None), 512)
    assert opened.path == tmp_path / "prepared" and opened.reused
    toks.train_tokenizer(make_documents(40, 3), 300, tmp_path / "other.json")
    with pytest.raises(ConfigError, match="prepared with a different tokenizer"):
        cache.ensure_prepared(_cfg(tmp_path, tmp_path / "prepared", tmp_path / "other.json"), 512)


def test_ids_above_uint16_are_stored_as_uint32(tmp_path: Path) -> None:
    vocab = {toks.EOT: 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=toks.EOT))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    write_jsonl(tmp_path / "d.jsonl", ["w1 w69999 w65536", "w2"])
    m = prep.prepare_data(str(tmp_path / "d.jsonl"), tmp_path / "big.json", tmp_path / "out", val_fraction=0)
    stream = shards.open_prepared(tmp_path / "out").stream("train")
    assert m.dtype == "uint32"
    assert stream.read(0, len(stream)).tolist() == [2, 70000, 65537, 0, 3, 0]


def _prepare_in_rank(rank: int, world_size: int, cfg: DataConfig) -> tuple[str, bool]:
    import torch.distributed as dist

    prepared = cache.ensure_prepared(cfg, 512, local_rank=rank, barrier=dist.barrier)
    return str(prepared.path), prepared.reused


@pytest.mark.slow
def test_only_local_rank_zero_prepares(
    tmp_path: Path, source: tuple[Path, list[str]], tok_path: Path
) -> None:
    from dist import run_distributed

    path, _ = source
    results = run_distributed(_prepare_in_rank, 2, _cfg(tmp_path, path, tok_path), timeout=240)
    assert results[0][0] == results[1][0]
    assert results[0][1] is False and results[1][1] is True  # rank 0 built it, rank 1 opened it


def test_streamed_documents_are_split_by_hash_and_sharded_in_order(tmp_path: Path, tok_path: Path) -> None:
    import datasets

    docs = make_documents(50)
    streamed = datasets.Dataset.from_list([{"text": d} for d in docs]).to_iterable_dataset()
    tok = toks.load_tokenizer(tok_path)
    run = prep._Run(
        tok, toks.eot_id(tok), "uint16", tmp_path, 0.3, 4, False, stream_piece_docs=20, batch_docs=10
    )
    splits = prep._collect_splits(tmp_path, run.streaming(streamed))
    is_val = prep._streaming_val(np.arange(len(docs)), 0.3, 4)
    assert 0 < is_val.sum() < len(docs) and len(splits["train"].shards) == 3
    for split, mask in (("train", ~is_val), ("val", is_val)):
        stream = shards.TokenStream(tmp_path, splits[split], "uint16")
        np.testing.assert_array_equal(stream.read(0, len(stream)), expected_stream(tok, docs, mask))
