"""`llmtrain tokenizer train` and `llmtrain prepare-data` through the CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from llmtrain.cli import main
from llmtrain.data import shards

LLMTRAIN = Path(sys.executable).parent / "llmtrain"
DOCS = [f"document number {i} says something about tokens, shards and batches." for i in range(30)]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    return path


def test_train_a_tokenizer_then_prepare_data(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = tmp_path / "tok.json"
    code, out, err = run_cli(
        capsys,
        "tokenizer",
        "train",
        str(corpus),
        "--vocab-size",
        "300",
        "--out",
        str(tok),
        "--text-field",
        "body",
    )
    assert code == 0, err
    assert tok.is_file() and "from 30 documents" in out
    code, out, err = run_cli(
        capsys, "prepare-data", str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "prep"),
        "--text-field", "body", "--val-fraction", "0.1", "--seed", "5", "--num-proc", "1",
    )  # fmt: skip
    assert code == 0, err
    manifest = shards.read_manifest(tmp_path / "prep")
    assert manifest is not None and manifest.documents == 30 and manifest.splits["val"].documents == 3
    assert f"30 documents, {manifest.tokens:,} tokens (uint16) in 2 shards" in out


def _big_tokenizer(path: Path) -> Path:
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


BAD_INPUTS = {
    "missing file": ({}, "missing.jsonl", [], "missing.jsonl: file not found"),
    "empty source": ({"empty.jsonl": ""}, "empty.jsonl", [], "empty.jsonl: empty source"),
    "line not JSON": (
        {"bad.jsonl": '{"text": "fine"}\n{"text": "fine"}\n{oops}\n'},
        "bad.jsonl",
        [],
        "bad.jsonl:3: line 3 is not valid JSON",
    ),
    "missing text field": ({"f.jsonl": '{"body": "x"}\n'}, "f.jsonl", [], "line 1 has no field 'text'"),
    "vocabulary too large for dtype": (
        {"ok.jsonl": '{"text": "w1 w2"}\n'},
        "ok.jsonl",
        ["--dtype", "uint16", "--tokenizer", "BIG"],
        "--dtype uint16: holds token ids below 65536, but the tokenizer has 70001 tokens; use --dtype uint32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    files, source, extra, expected = BAD_INPUTS[case]
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    tok = tmp_path / "tok.json"
    if "BIG" in extra:
        extra = [str(_big_tokenizer(tmp_path / "big.json")) if a == "BIG" else a for a in extra]
    else:
        from llmtrain.data.tokenizer import train_tokenizer

        train_tokenizer(DOCS, 300, tok)
        extra = ["--tokenizer", str(tok), *extra]
    code, _out, err = run_cli(
        capsys, "prepare-data", str(tmp_path / source), "--out", str(tmp_path / "o"), *extra
    )
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_installed_command_reports_bad_jsonl_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json at all\n')
    proc = subprocess.run(
        [
            str(LLMTRAIN),
            "tokenizer",
            "train",
            str(bad),
            "--vocab-size",
            "300",
            "--out",
            str(tmp_path / "t.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr
        == f"error: SOURCE {bad}:2: line 2 is not valid JSON (Expecting value); fix or remove it\n"
    )
    assert not (tmp_path / "t.json").exists()
