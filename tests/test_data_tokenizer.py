"""Byte-level BPE training, loading (file or Hugging Face directory), end-of-text id and hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.config import ConfigError
from llmtrain.data import tokenizer as toks

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Unicode survives: naïve café, Ελληνικά, 日本語, emoji 🙂.",
    "Packing joins documents with one end-of-text token between them.",
] * 5


def test_trained_tokenizer_has_the_special_tokens_and_round_trips_bytes(tmp_path: Path) -> None:
    out = tmp_path / "tok.json"
    tok = toks.train_tokenizer(TEXTS, 400, out)
    assert out.is_file()
    assert toks.vocab_size(tok) <= 400
    assert tok.token_to_id(toks.EOT) == 0 and tok.token_to_id(toks.PAD) == 1
    assert toks.eot_id(tok) == 0
    for text in [*TEXTS[:4], "unseen ✓ text"]:
        ids = toks.encode_documents(tok, [text])[0]
        assert tok.decode(ids) == text
        assert 0 not in ids and 1 not in ids


def test_literal_special_token_text_is_encoded_as_text(tmp_path: Path) -> None:
    tok = toks.train_tokenizer(TEXTS, 300, tmp_path / "tok.json")
    loaded = toks.load_tokenizer(tmp_path / "tok.json")
    for t in (tok, loaded):
        ids = toks.encode_documents(t, ["before <|endoftext|> after"])[0]
        assert toks.eot_id(t) not in ids
        assert t.decode(ids) == "before <|endoftext|> after"


def test_hash_is_stable_across_save_and_load_and_differs_between_tokenizers(tmp_path: Path) -> None:
    a = toks.train_tokenizer(TEXTS, 300, tmp_path / "a.json")
    b = toks.train_tokenizer(TEXTS, 320, tmp_path / "b.json")
    assert toks.tokenizer_hash(toks.load_tokenizer(tmp_path / "a.json")) == toks.tokenizer_hash(a)
    assert toks.tokenizer_hash(a) != toks.tokenizer_hash(b)


def test_hugging_face_directory_uses_its_configured_eos(tmp_path: Path) -> None:
    toks.train_tokenizer(TEXTS, 300, tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": toks.PAD}}))
    tok = toks.load_tokenizer(tmp_path / "hf")
    assert toks.eot_id(tok, tmp_path / "hf") == 1  # the configured eos, not the default name
    assert toks.eot_id(tok) == 0


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing.json", "file not found"),
        (lambda d: (d / "empty_dir").mkdir() or d / "empty_dir", "has no tokenizer.json"),
        (lambda d: (d / "bad.json").write_text("{}") and d / "bad.json", "not a tokenizers JSON file"),
    ],
)
def test_bad_tokenizer_paths(tmp_path: Path, make, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        toks.load_tokenizer(make(tmp_path))


def test_vocabulary_below_the_byte_alphabet_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 258"):
        toks.train_tokenizer(TEXTS, 100, tmp_path / "t.json")
