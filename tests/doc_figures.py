"""Measured figures quoted in README.md and docs/*.md, each read against the results file it comes from.

A figure a benchmark or a recorded run measured is quoted under a `figures` comment, which GitHub does not
show, naming its results files and, per figure, the JSON path of the number:

    <!-- figures: bench/results/train.json, bench/results/make_train.json
    1,971 = ["tiny/zero1"].llmtrain.tokens_per_sec
    **1.47×** = ["tiny/zero1"].llmtrain.speedup
    4 min 32 s = make_train.json: wall_seconds (seconds)
    -->

The comment covers what follows it: the code block, when a fence comes next (other comment lines, such
as an output marker, may stand between), else the lines up to the next blank line (one paragraph, one
table or one list item). Each entry is `FIGURE = [NAME.json:] PATH [(bytes) | (seconds)]`, one a line or
several separated by `;`:

- FIGURE is the text as quoted, found in the covered lines in the entries' order (so a figure quoted
  twice is listed twice); `**` around it is only for reading the entry and is dropped.
- NAME.json picks one of the files the first line names (default: the first). PATH walks the JSON:
  `.key` for a key of letters, digits, `_` and `-` (not first), `["any key"]` for any other, `[N]` for a
  list item (`setups["1f1b 2"].stages[0].bubble`).
- A number is compared within its own rounding: half a unit of its last digit (1.47× takes 1.4651 and
  not 1.4549; 1,971 takes 1970.8; 4.3e-6 takes 4.25e-6). `k` and `M` after the digits scale it (155k,
  10.1M); a sign before it must agree with the value's. `%` quotes a fraction (0.3% is 0.003). A unit
  of size or time quotes the file's number as it stands (11.2 MiB for a `*_mib` value), unless the
  entry says the file holds `(bytes)` (MiB, GiB, KiB: powers of 1024; kB, MB, GB: of 1000) or
  `(seconds)` (ms, s, min, minutes, h; `4 min 32 s` is 272 seconds, to the second); `(bytes in MiB)`
  gives the unit of a figure quoted without its own (`101.5` in `101.5 / 42.1 MiB`).
- A FIGURE that is not a number (with one unit after a space, or `×`, `x`, `%` right after it) is a word,
  equal to the file's value as text (`bf16 = config.train.precision`, `3.11.7 = machine.python`).

The file is read when the check runs, never copied into the text: re-recording a results file makes
every quoted figure that moved beyond its rounding fail, naming the page, the line, the quoted text and
the recorded value. Under a `figures` comment every measured-looking number in prose (one with `×`, `%`,
a size, a time or `tokens/s`) and every number in a table's body row after its first cell must be one of
its entries (a sample's code block may hold other numbers: its marker checks them); anywhere else, prose
quoting a ratio (`1.47×`) or a rate (`1,971 tokens/s`) is refused, so no measured figure is quoted
without its file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OPEN = re.compile(r"<!-- figures:\s*(?P<files>[^\n]*?)\s*$")
ENTRY = re.compile(
    r"^(?P<figure>.+?) = (?:(?P<file>[\w.-]+\.json):\s*)?(?P<path>.+?)"
    r"(?:\s+\((?P<stored>bytes|seconds)(?: in (?P<unit>\w+))?\))?$"
)
PATH_STEP = re.compile(r'\.(?P<key>[A-Za-z_][\w-]*)|\["(?P<quoted>[^"]+)"\]|\[(?P<index>\d+)\]')
FIGURE_NUMBER = re.compile(
    r"^(?P<sign>[+\-−])?(?P<digits>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<decimals>\d+))?"
    r"(?:e(?P<exponent>[-+]?\d+))?(?P<scale>[kM])?(?P<rest>.*)$"
)
SIZES = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "kB": 1e3, "MB": 1e6, "GB": 1e9}
TIMES = {"ms": 1e-3, "s": 1.0, "min": 60.0, "minutes": 60.0, "minute": 60.0, "h": 3600.0}
RATIOS = {"×", "x"}
DURATION = re.compile(r"^(?P<minutes>\d+) min (?P<seconds>\d+) s$")
# A measured-looking number in prose: a ratio, a share, a size, a time or a rate.
NUM = r"(?<![\w.,/-])\d+(?:,\d{3})*(?:\.\d+)?[kM]?"
MEASURED = re.compile(
    NUM + r"(?:×|x(?![\w])|\s?%|\s(?:KiB|MiB|GiB|kB|MB|GB|ms|s|min|minutes|seconds|nats)(?![\w/])"
    r"|\s(?:tokens/s|tok/s))"
)
UNSOURCED = re.compile(NUM + r"(?:×|\s(?:tokens/s|tok/s))")  # outside a figures comment: never
ANY_NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?(?![\w]|[.,]\d)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


class FigureError(AssertionError):
    pass


@dataclass(frozen=True)
class Entry:
    line: int  # of the entry, 1-based
    figure: str
    file: str  # bench/results/NAME.json
    path: str
    stored: str | None  # "bytes", "seconds" or None: in the figure's own unit
    unit: str | None = None  # the unit of a figure quoted without one (`101.5 / 42.1 MiB`)


@dataclass(frozen=True)
class Scope:
    page: str  # README.md, docs/NAME.md
    line: int  # of the `<!-- figures:` line
    entries: tuple[Entry, ...]
    first: int  # the covered lines, 1-based, inclusive
    last: int
    text: str  # the covered lines
    kind: str  # "code" (a sample's block), "table" or "prose"


@dataclass(frozen=True)
class Check:
    """One figure compared with its file: what the test ids and failures name."""

    page: str
    line: int  # of the entry
    figure: str
    file: str
    path: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} {self.figure!r} = {Path(self.file).name}:{self.path}"


# ---------------------------------------------------------------- reading the pages


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def page_name(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


def code_lines(lines: list[str]) -> set[int]:
    """The 0-based indices of lines inside fenced code blocks, fences included."""
    inside, out = False, set()
    for i, line in enumerate(lines):
        if line.startswith("```"):
            out.add(i)
            inside = not inside
        elif inside:
            out.add(i)
    return out


def scopes(text: str, page: str) -> list[Scope]:
    lines, found, i = text.splitlines(), [], 0
    code = code_lines(lines)  # a figures comment shown in a code block is an example
    while i < len(lines):
        opened = None if i in code else OPEN.match(lines[i].strip())
        if not opened:
            i += 1
            continue
        start = i
        files = [f.strip() for f in opened["files"].split(",") if f.strip()]
        if not files or any(not re.fullmatch(r"bench/results/[\w.-]+\.json", f) for f in files):
            raise FigureError(
                f"{page}:{start + 1}: name the results files: <!-- figures: bench/results/NAME.json"
            )
        entries: list[Entry] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "-->":
            entries += [
                _entry(part.strip(), files, page, i + 1) for part in lines[i].split(";") if part.strip()
            ]
            i += 1
        if i == len(lines):
            raise FigureError(f"{page}:{start + 1}: the figures comment is not closed by a line `-->`")
        i += 1
        while i < len(lines) and lines[i].strip().startswith("<!--") and lines[i].strip().endswith("-->"):
            i += 1
        is_code = i < len(lines) and lines[i].startswith("```")
        if is_code:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise FigureError(f"{page}:{i + 1}: a code block that is never closed")
            first, last = i + 1, end - 1
        else:
            first = i
            last = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines)) - 1
        if last < first or not entries:
            raise FigureError(f"{page}:{start + 1}: a figures comment with nothing under it, or no figures")
        covered = lines[first : last + 1]
        kind = "code" if is_code else "table" if all(x.lstrip().startswith("|") for x in covered) else "prose"
        found.append(Scope(page, start + 1, tuple(entries), first + 1, last + 1, "\n".join(covered), kind))
        i = last + 1
    return found


def _entry(line: str, files: list[str], page: str, number: int) -> Entry:
    m = ENTRY.match(line)
    if m is None:
        raise FigureError(f"{page}:{number}: not `FIGURE = [NAME.json:] PATH [(bytes)|(seconds)]`: {line!r}")
    name = m["file"]
    if name is None:
        file = files[0]
    else:
        named = [f for f in files if Path(f).name == name]
        if not named:
            raise FigureError(f"{page}:{number}: {name} is not among the comment's files {files}")
        file = named[0]
    figure = m["figure"].strip()
    if figure.startswith("**") and figure.endswith("**"):
        figure = figure[2:-2]
    return Entry(number, figure, file, m["path"].strip(), m["stored"], m["unit"])


# ---------------------------------------------------------------- reading the results files


def _load(path: Path) -> Any:
    key = (path, path.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = json.loads(path.read_text())
    return _LOADED[key]


_LOADED: dict[tuple[Path, int], Any] = {}


def lookup(data: Any, path: str) -> Any:
    at, value = 0, data
    if path and path[0] not in ".[":
        path = "." + path
    while at < len(path):
        m = PATH_STEP.match(path, at)
        if m is None:
            raise FigureError(f"path {path!r}: cannot read it from {path[at:]!r}")
        key = m["key"] or m["quoted"]
        try:
            value = value[int(m["index"])] if m["index"] is not None else value[key]
        except (KeyError, IndexError, TypeError):
            raise FigureError(f"path {path!r}: no {path[: m.end()]!r} in the file") from None
        at = m.end()
    return value


@dataclass(frozen=True)
class Quoted:
    value: float
    tolerance: float


def quoted_value(figure: str, stored: str | None, unit: str | None = None) -> Quoted | None:
    """What a quoted figure says in the file's unit, with the rounding it was printed to (None: a word)."""
    text = figure.strip() + (f" {unit}" if unit else "")
    duration = DURATION.match(text)
    if duration:
        if stored != "seconds":
            raise FigureError(f"{figure!r}: a duration quotes a number of (seconds)")
        return Quoted(int(duration["minutes"]) * 60 + int(duration["seconds"]), 0.5)
    m = FIGURE_NUMBER.match(text)
    if m is None:
        return None
    if m["rest"] and not (re.fullmatch(r"\s\S+", m["rest"]) or m["rest"] in RATIOS or m["rest"] == "%"):
        return None  # a version, a description: a word
    decimals = m["decimals"] or ""
    value = float(m["digits"].replace(",", "") + ("." + decimals if decimals else ""))
    tolerance = 0.5 * 10.0 ** -len(decimals)
    if m["exponent"]:
        value, tolerance = value * 10.0 ** int(m["exponent"]), tolerance * 10.0 ** int(m["exponent"])
    if m["scale"]:
        factor = {"k": 1e3, "M": 1e6}[m["scale"]]
        value, tolerance = value * factor, tolerance * factor
    if m["sign"] in ("-", "−"):
        value = -value
    unit = m["rest"].strip()
    factor = 1.0
    if unit == "%":
        factor = 0.01
    elif unit in RATIOS or unit == "":
        factor = 1.0
    elif unit in SIZES:
        factor = SIZES[unit] if stored == "bytes" else 1.0
    elif unit in TIMES:
        factor = TIMES[unit] if stored == "seconds" else 1.0
    elif stored is not None:
        raise FigureError(f"{figure!r}: unit {unit!r} cannot be read from ({stored})")
    return Quoted(value * factor, tolerance * factor)


def compare(entry: Entry, value: Any) -> str | None:
    """Why the quoted figure is not the recorded value (None when it is, within the quoted rounding)."""
    quoted = quoted_value(entry.figure, entry.stored, entry.unit)
    if quoted is None:
        return None if str(value) == entry.figure else f"the file says {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"the file holds {value!r}, not a number"
    if not math.isfinite(value):
        return f"the file holds {value!r}"
    tol = quoted.tolerance * (1 + 1e-9) + 1e-12 * abs(value)
    if abs(value - quoted.value) <= tol:
        return None
    return f"the file says {value!r}, which does not round to {entry.figure!r} (expected {quoted.value:g} ± {quoted.tolerance:g})"


# ---------------------------------------------------------------- the checks


def _find(figure: str, text: str, start: int) -> re.Match[str] | None:
    pattern = r"(?<![\w.,])" + re.escape(figure) + (r"(?![\w]|[.,]\d)" if figure[-1].isalnum() else "")
    return re.compile(pattern).search(text, start)


def check_scope(scope: Scope, root: Path = ROOT) -> Iterator[tuple[Check, str | None]]:
    """Each entry of a figures comment with why it fails (None: it holds), then anything unsourced."""
    covered: list[tuple[int, int]] = []
    at = 0
    for entry in scope.entries:
        check = Check(scope.page, entry.line, entry.figure, entry.file, entry.path)
        found = _find(entry.figure, scope.text, at)
        if found is None:
            yield (
                check,
                f"{entry.figure!r} is not quoted in {scope.page}:{scope.first}-{scope.last} (after the figures before it)",
            )
            continue
        covered.append(found.span())
        at = found.end()
        path = root / entry.file
        if not path.is_file():
            yield check, f"{entry.file} does not exist"
            continue
        try:
            value = lookup(_load(path), entry.path)
            yield check, compare(entry, value)
        except FigureError as e:
            yield check, str(e)
    for start, number in unsourced_in_scope(scope):
        if not any(s <= start < e for s, e in covered):
            line = scope.first + scope.text.count("\n", 0, start)
            yield (
                Check(scope.page, line, number, "", ""),
                (
                    f"{scope.page}:{line}: {number!r} looks measured but is not among the figures of the comment "
                    f"at line {scope.line}: source it or leave it out"
                ),
            )


def unsourced_in_scope(scope: Scope) -> Iterator[tuple[int, str]]:
    """Where a number that must be an entry's starts, and the text: a sample's block needs none."""
    if scope.kind == "table":
        offset = 0
        for n, line in enumerate(scope.text.split("\n")):
            # The header and its rule name things, a row's first cell names the row; the rest are figures.
            first_cell = line.find("|", line.find("|") + 1)
            if n >= 2:
                for m in ANY_NUMBER.finditer(line, first_cell + 1):
                    yield offset + m.start(), m.group()
            offset += len(line) + 1
    elif scope.kind == "prose":
        for m in MEASURED.finditer(scope.text):
            yield m.start(), m.group()


def unsourced_outside(text: str, page: str) -> list[str]:
    """Ratios and rates in prose that no figures comment covers: `page:line: text` each."""
    lines = text.splitlines()
    skip = code_lines(lines)
    for scope in scopes(text, page):
        skip.update(range(scope.line - 1, scope.last))
    out = []
    for i, line in enumerate(lines):
        if i in skip or line.strip().startswith("<!--"):
            continue
        for m in UNSOURCED.finditer(INLINE_CODE.sub("``", line)):
            out.append(f"{page}:{i + 1}: {m.group()!r}")
    return out


def all_checks(root: Path = ROOT) -> list[tuple[Check, str | None]]:
    return [
        result
        for page in pages(root)
        for scope in scopes(page.read_text(), page_name(page, root))
        for result in check_scope(scope, root)
    ]
