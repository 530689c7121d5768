"""Sources: every local format loads as one `text` column; bad input names the file (and line)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest

from llmtrain.config import ConfigError
from llmtrain.data import sources


def _texts(ds: datasets.Dataset) -> list[str]:
    assert ds.column_names == ["text"]
    return list(ds["text"])


def test_text_files_are_one_document_each_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second file\n\nwith a blank line inside\n")
    (tmp_path / "a.md").write_text("first file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    ds = sources.load_documents(str(tmp_path))
    assert _texts(ds) == ["first file", "second file\n\nwith a blank line inside\n", "third"]


def test_jsonl_parquet_csv_and_save_to_disk_use_the_text_field(tmp_path: Path) -> None:
    rows = [{"body": "alpha", "id": 1}, {"body": "beta", "id": 2}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    for name in ("d.jsonl", "d.parquet", "d.csv", "saved"):
        ds = sources.load_documents(str(tmp_path / name), text_field="body")
        assert _texts(ds) == ["alpha", "beta"], name


def test_glob_picks_matching_files_only(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": f"doc {i}"}) + "\n")
    (tmp_path / "notes.txt").write_text("not matched")
    ds = sources.load_documents(str(tmp_path / "part*.jsonl"))
    assert _texts(ds) == ["doc 0", "doc 1", "doc 2"]


def test_fingerprint_follows_files_and_text_field(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n')
    first = sources.source_fingerprint(str(f))
    assert sources.source_fingerprint(str(f)) == first
    assert sources.source_fingerprint(str(f), text_field="body") != first
    f.write_text('{"text": "ab"}\n')
    os.utime(f, ns=(1, 1))
    assert sources.source_fingerprint(str(f)) != first


def test_hub_names_are_told_from_paths(tmp_path: Path) -> None:
    assert sources.is_hub_name("roneneldan/TinyStories")
    assert sources.is_hub_name("wikitext")
    assert not sources.is_hub_name("data/train.jsonl")
    assert not sources.is_hub_name(str(tmp_path))
    assert not sources.is_hub_name("corpus/*.txt")


@pytest.mark.parametrize(
    ("files", "source", "expected"),
    [
        ({}, "missing.jsonl", "missing.jsonl: file not found"),
        ({"e.jsonl": ""}, "e.jsonl", "e.jsonl: empty source"),
        ({"d/": None}, "d", "holds no"),
        (
            {"b.jsonl": '{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n'},
            "b.jsonl",
            "b.jsonl:3: line 3 is not valid JSON",
        ),
        ({"m.jsonl": '{"text": "ok"}\n{"body": "x"}\n'}, "m.jsonl", "m.jsonl:2: line 2 has no field 'text'"),
        ({"n.jsonl": '{"body": "x"}\n'}, "n.jsonl", "line 1 has no field 'text' (fields: body)"),
        ({"c.csv": "body\nx\n"}, "c.csv", "no field 'text' (fields: body)"),
        ({"x.xml": "<a/>"}, "x.xml", "unsupported file type"),
    ],
)
def test_bad_sources_raise_one_line_errors(tmp_path: Path, files: dict, source: str, expected: str) -> None:
    for name, content in files.items():
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError) as err:
        sources.load_documents(str(tmp_path / source))
    message = str(err.value)
    assert expected in message
    assert "\n" not in message
