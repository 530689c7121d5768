"""The built-in corpus: real English text that ships with every Python installation.

`llmtrain train` without `--data` trains on it, so a fresh machine works offline. It is:
- Python's own reference documentation bundled as `pydoc_data.topics` (what `help("if")` prints),
  one document per topic;
- the docstrings of the standard library, read with `ast` (nothing is imported), one document per
  module: the module docstring followed by each class / function docstring under its qualified name.

Test suites and `site-packages` are skipped. The text is deterministic for a given Python version
(about 2.5 MB of text in ~700 documents on CPython 3.11) and is written once to
`<cache>/corpus/python-docs-<version>.jsonl`, then loaded like any other JSONL source.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from llmtrain.data.sources import cache_root

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}


def corpus_path() -> Path:
    return cache_root() / "corpus" / f"python-docs-{platform.python_version()}.jsonl"


def builtin_corpus() -> Path:
    """The corpus as a JSONL file (`text` field), written on first use."""
    path = corpus_path()
    if not path.is_file():
        write_corpus(path)
    return path


def write_corpus(path: Path) -> None:
    """Write every document as one JSON line, via a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for text in corpus_documents():
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def corpus_documents() -> Iterator[str]:
    yield from _pydoc_topics()
    yield from _stdlib_docstrings(Path(sysconfig.get_paths()["stdlib"]))


def _pydoc_topics() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip the bundled docs; the docstrings remain
        return
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def _stdlib_docstrings(root: Path) -> Iterator[str]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        parts = rel.with_suffix("").parts
        text = _module_text(path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        if text:
            yield text


def _module_text(path: Path, module: str) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return ""  # e.g. lib2to3 test data written in Python 2
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"{module}\n\n{doc}")
    for name, node_doc in _definition_docs(tree, module):
        parts.append(f"{name}\n\n{node_doc}")
    return "\n\n".join(parts)


def _definition_docs(tree: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of classes and functions, in source order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                yield name, doc
            yield from _definition_docs(node, name)
