"""Reading prepared data does not import `datasets` (or the writer): checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from llmtrain.config import DataConfig
from llmtrain.data import cache, shards
from llmtrain.data import prepare as prep
from llmtrain.data import tokenizer as toks

DOCS = [f"document {i} is about tokens, shards, batches and the loss of step {i}." for i in range(40)]


def run_fresh(code: str, *args: str) -> None:
    """Run `code` in a new interpreter (argv[1:] = args); it fails the test by raising."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_importing_the_trainer_does_not_import_datasets() -> None:
    run_fresh(
        """
        import sys
        import llmtrain.train.trainer
        loaded = [m for m in ("datasets", "llmtrain.data.prepare") if m in sys.modules]
        assert not loaded, loaded
        """
    )


def test_opening_prepared_data_does_not_import_datasets(tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    toks.train_tokenizer(DOCS, 300, tmp_path / "tok.json")
    prep.prepare_data(str(source), tmp_path / "tok.json", tmp_path / "prepared", val_fraction=0.1)
    cache_dir = str(tmp_path / "cache")
    # Fill the cache (shards and, without a tokenizer, the automatic tokenizer) in this process.
    cache.ensure_prepared(
        DataConfig(source=str(source), tokenizer=str(tmp_path / "tok.json"), cache_dir=cache_dir), 320
    )
    cache.ensure_prepared(DataConfig(source=str(source), cache_dir=cache_dir), 320)
    assert shards.is_prepared_dir(tmp_path / "prepared")

    run_fresh(
        """
        import sys
        from llmtrain.config import DataConfig
        from llmtrain.data import cache, shards

        source, tok, prepared, cache_dir = sys.argv[1:]
        opened = shards.open_prepared(prepared, tokenizer=tok, vocab_size=320)
        assert len(opened.stream("train")) > 0 and len(opened.stream("val")) > 0
        assert cache.ensure_prepared(DataConfig(source=prepared), 320).path == opened.path
        assert cache.ensure_prepared(DataConfig(source=source, tokenizer=tok, cache_dir=cache_dir), 320).reused
        assert cache.ensure_prepared(DataConfig(source=source, cache_dir=cache_dir), 320).reused
        loaded = [m for m in ("datasets", "llmtrain.data.prepare") if m in sys.modules]
        assert not loaded, loaded
        """,
        str(source),
        str(tmp_path / "tok.json"),
        str(tmp_path / "prepared"),
        cache_dir,
    )
