"""The built-in corpus: real English text from the Python installation, cached, used without --data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.config import DataConfig
from llmtrain.data import cache, corpus


@pytest.mark.slow
def test_builtin_corpus_is_materialised_once_and_trains_without_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path))
    path = corpus.builtin_corpus()
    assert path.parent == tmp_path / "corpus" and path.name.startswith("python-docs-")
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(docs) > 300 and sum(len(d) for d in docs) > 1_000_000
    assert any("if_stmt" in d for d in docs)  # pydoc_data's grammar for the `if` statement
    assert any(d.startswith("json\n\nJSON (JavaScript Object Notation)") for d in docs)  # a module docstring
    mtime = path.stat().st_mtime_ns
    assert corpus.builtin_corpus() == path and path.stat().st_mtime_ns == mtime  # not rewritten

    prepared = cache.ensure_prepared(DataConfig(num_proc=1), 512)
    assert prepared.manifest.source == str(path) and prepared.manifest.documents == len(docs)
    assert prepared.vocab_size <= 512 and prepared.manifest.splits["val"].documents == round(len(docs) * 0.02)
    assert cache.ensure_prepared(DataConfig(num_proc=1), 512).reused
