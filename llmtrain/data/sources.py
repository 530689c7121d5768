"""Text sources -> a Hugging Face `datasets` table with one column, `text`, one row per document.

What a SOURCE may be (checked in this order):
- a directory written by `Dataset.save_to_disk` (it holds `dataset_info.json` / `state.json`);
- a directory: every supported file below it, recursively, in sorted order;
- a glob (`data/*.jsonl`, `corpus/**/*.txt`), sorted;
- a file: `.txt` / `.md` / `.rst` (the whole file is ONE document: splitting on blank lines would tear
  code and lists apart; put one document per row of a JSONL file when you need finer documents),
  `.jsonl` / `.json` (a field per row, `--text-field`, default `text`), `.parquet`, `.csv`;
- otherwise a Hugging Face Hub dataset name (`owner/name`), with `data.hub_config` and `data.streaming`.

Bad input is a `ConfigError` naming the file (and for JSONL the line) and the fix.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from llmtrain.config import ConfigError

if TYPE_CHECKING:
    import datasets

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
KINDS = {
    **dict.fromkeys(TEXT_SUFFIXES, "text"),
    **dict.fromkeys(JSON_SUFFIXES, "json"),
    ".parquet": "parquet",
    ".csv": "csv",
}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GLOB_CHARS = set("*?[")

Documents: TypeAlias = "datasets.Dataset | datasets.IterableDataset"


def cache_root() -> Path:
    """Where llmtrain caches corpora, tokenizers and prepared data: $LLMTRAIN_CACHE_DIR or ~/.cache/llmtrain."""
    return Path(os.environ.get("LLMTRAIN_CACHE_DIR") or Path.home() / ".cache" / "llmtrain").expanduser()


# ---------------------------------------------------------------- what the source is


def is_save_to_disk_dir(path: Path) -> bool:
    names = ("dataset_info.json", "state.json", "dataset_dict.json")
    return path.is_dir() and any((path / n).is_file() for n in names)


def is_hub_name(source: str) -> bool:
    """`name` or `owner/name` that is no local path and has no data-file suffix."""
    if Path(source).expanduser().exists() or _GLOB_CHARS & set(source):
        return False
    return bool(_HUB_NAME.match(source)) and Path(source).suffix.lower() not in KINDS


def local_files(source: str, flag: str = "SOURCE") -> list[Path]:
    """The data files a local source names, sorted; errors name the path and the fix."""
    if _GLOB_CHARS & set(source):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        files = [p for p in matches if p.is_file() and p.suffix.lower() in KINDS]
        if not files:
            raise ConfigError(f"{flag} {source}: the pattern matches no {_supported()} file; check the glob")
        return files
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in KINDS)
        if not files:
            raise ConfigError(f"{flag} {source}: the directory holds no {_supported()} file")
        return files
    if not path.exists():
        raise ConfigError(f"{flag} {source}: file not found; pass an existing file, directory or glob")
    if path.suffix.lower() not in KINDS:
        raise ConfigError(f"{flag} {source}: unsupported file type {path.suffix!r}; use {_supported()}")
    return [path]


def _supported() -> str:
    return "/".join(sorted(KINDS))


# ---------------------------------------------------------------- fingerprint


def source_fingerprint(
    source: str, *, text_field: str = "text", hub_config: str | None = None, flag: str = "SOURCE"
) -> str:
    """A hash that changes when the source's files (path, size, mtime) or the text field change.

    Stat-based, not content-based, so it costs nothing on terabytes; a file rewritten in place with
    identical size and mtime is the one change it misses.
    """
    h = hashlib.sha256()
    h.update(f"field={text_field}\n".encode())
    if is_hub_name(source):
        h.update(f"hub={source}\nconfig={hub_config}\n".encode())
        return h.hexdigest()
    path = Path(source).expanduser()
    if is_save_to_disk_dir(path):
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        files = local_files(source, flag)
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- loading


def load_documents(
    source: str,
    *,
    text_field: str = "text",
    hub_config: str | None = None,
    streaming: bool = False,
    flag: str = "SOURCE",
) -> Documents:
    """Load a source as a table with exactly one column, `text` (one row per document)."""
    # Imported here, not at the top: fingerprints, cache look-ups and readers of prepared data skip it.
    import datasets

    datasets.disable_progress_bars()  # our own progress bar reports the work that matters
    path = Path(source).expanduser()
    if is_save_to_disk_dir(path):
        ds: Documents = _load_saved(path, text_field, flag)
    elif is_hub_name(source):
        ds = _load_hub(source, hub_config, streaming, text_field, flag)
    else:
        ds = _load_files(local_files(source, flag), text_field, flag)
    if isinstance(ds, datasets.Dataset) and ds.num_rows == 0:
        raise ConfigError(f"{flag} {source}: empty source (no documents); point it at text")
    return ds


def _load_files(files: list[Path], text_field: str, flag: str) -> datasets.Dataset:
    """Files of several kinds load kind by kind (in order of first appearance) and are concatenated."""
    import datasets

    if all(f.stat().st_size == 0 for f in files):
        where = files[0] if len(files) == 1 else f"{len(files)} files like {files[0]}"
        raise ConfigError(f"{flag} {where}: empty source (no text); point it at non-empty files")
    files = [f for f in files if f.stat().st_size > 0]  # an empty file holds no document
    parts = [
        _load_kind(kind, [f for f in files if KINDS[f.suffix.lower()] == kind], text_field, flag)
        for kind in _kinds(files)
    ]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _kinds(files: list[Path]) -> list[str]:
    seen: dict[str, None] = {}
    for f in files:
        seen.setdefault(KINDS[f.suffix.lower()])
    return list(seen)


def _load_kind(kind: str, files: list[Path], text_field: str, flag: str) -> datasets.Dataset:
    import datasets

    names = [str(f) for f in files]
    # A text file is one document (sample_by="document"); other kinds have a row per document.
    options = {"sample_by": "document"} if kind == "text" else {}
    ds = _quiet_load(
        names,
        flag,
        lambda: datasets.load_dataset(kind, data_files=names, split="train", **options),
        json_files=files if kind == "json" else None,
        text_field=text_field,
    )
    return ds if kind == "text" else _text_column(ds, text_field, files, flag)


def _quiet_load(
    names: list[str], flag: str, load: Any, json_files: list[Path] | None = None, text_field: str = "text"
) -> datasets.Dataset:
    """Run a `datasets` loader without its stderr logging; turn its failures into one-line errors."""
    try:
        with _datasets_logging_off():
            return load()
    except ConfigError:
        raise
    except Exception as exc:
        if json_files:
            _check_jsonl(json_files, text_field, flag)  # raises with file and line when it finds the fault
        where = names[0] if len(names) == 1 else f"{len(names)} files like {names[0]}"
        raise ConfigError(
            f"{flag} {where}: could not read it ({_short(exc)}); check the file format"
        ) from None


@contextlib.contextmanager
def _datasets_logging_off() -> Iterator[None]:
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _short(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if cause is not None and str(cause):
        text = f"{text}: {cause}"
    return " ".join(text.split())[:200]


def _text_column(ds: datasets.Dataset, text_field: str, files: list[Path], flag: str) -> datasets.Dataset:
    """Keep only the text field, renamed `text`; a missing, non-string or null field is an error."""
    import datasets

    where = files[0] if len(files) == 1 else f"{len(files)} files like {files[0]}"
    json_files = [f for f in files if f.suffix.lower() in JSON_SUFFIXES]
    if text_field not in ds.column_names or ds.data.column(text_field).null_count:
        _check_jsonl(json_files, text_field, flag)  # names the first offending line, when there is one
    if text_field not in ds.column_names:
        raise ConfigError(
            f"{flag} {where}: no field {text_field!r} (fields: {', '.join(ds.column_names)}); "
            "name the text field with --text-field"
        )
    feature = ds.features[text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ConfigError(
            f"{flag} {where}: field {text_field!r} holds {feature}, not text; pick a text field with --text-field"
        )
    if ds.data.column(text_field).null_count:
        raise ConfigError(f"{flag} {where}: some rows have no {text_field!r} value; fix or drop those rows")
    ds = ds.select_columns([text_field])
    return ds.rename_column(text_field, "text") if text_field != "text" else ds


def _check_jsonl(files: list[Path], text_field: str, flag: str) -> None:
    """Find the first bad line of JSON-lines files: not JSON, not an object, or without the text field."""
    for f in files:
        if f.suffix.lower() == ".json" and _is_json_document(f):
            continue  # a single JSON document (array / object), not JSON lines
        with f.open("rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for non-UTF-8 bytes
                    reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                    raise ConfigError(
                        f"{flag} {f}:{number}: line {number} is not valid JSON ({reason}); fix or remove it"
                    ) from None
                if not isinstance(row, dict):
                    raise ConfigError(
                        f"{flag} {f}:{number}: line {number} is a JSON {type(row).__name__}, not an object"
                    )
                if not isinstance(row.get(text_field), str):
                    got = "has no" if text_field not in row else "has a non-text"
                    raise ConfigError(
                        f"{flag} {f}:{number}: line {number} {got} field {text_field!r} "
                        f"(fields: {', '.join(row) or 'none'}); name the text field with --text-field"
                    )


def _is_json_document(path: Path) -> bool:
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def _load_saved(path: Path, text_field: str, flag: str) -> datasets.Dataset:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ConfigError(f"{flag} {path}: not a readable save_to_disk directory ({_short(exc)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise ConfigError(
                f"{flag} {path}: holds splits {', '.join(loaded)} and none is 'train'; save one split"
            )
    return _text_column(loaded, text_field, [path], flag)


def _load_hub(source: str, hub_config: str | None, streaming: bool, text_field: str, flag: str) -> Documents:
    import datasets

    try:
        with _datasets_logging_off():
            ds = datasets.load_dataset(source, hub_config, split="train", streaming=streaming)
    except Exception as exc:
        raise ConfigError(
            f"{flag} {source}: no such local file, and loading it as a Hugging Face Hub dataset failed "
            f"({_short(exc)}); check the path, or the dataset name and --set data.hub_config"
        ) from None
    if isinstance(ds, datasets.IterableDataset):
        columns = ds.column_names
        if columns is not None and text_field not in columns:
            raise ConfigError(
                f"{flag} {source}: no field {text_field!r} (fields: {', '.join(columns)}); "
                "name the text field with --text-field"
            )
        ds = ds.select_columns([text_field])
        return ds.rename_column(text_field, "text") if text_field != "text" else ds
    return _text_column(ds, text_field, [Path(source)], flag)
