"""The sample outputs and measured figures in README.md and docs/*.md are what the code prints and
what the results files hold, so neither can drift.

A code block that shows output has a marker on the line before its opening fence, an HTML comment that
GitHub does not show:

    <!-- output: exact -->                  the commands are the block's `$ llmtrain ...` lines; each
                                            one's output is the lines up to the next `$ ` line
    <!-- output: exact: llmtrain ARGS -->   the whole block is this command's output
    <!-- output: shape: file PATH -->       the whole block is (part of) this file
    <!-- output: illustrative: REASON -->   not checked, for the reason given (sampled text, ...)

`exact`: each line of the block appears in the real output (stdout, then stderr) in order, character
for character, trailing whitespace aside. A block may leave lines out (it is a subsequence of the
output's lines); a line of just `...` shows the reader where. `shape`: the same after every number is
masked as `#` and runs of spaces and of table rules are collapsed, for what depends on the clock or
on a long run (progress lines, timings, listings, the keys of metrics.jsonl and their order).
Unmarked blocks other than `bash`, `yaml`, `python` and `markdown` ones are refused, so a new sample is checked
or says why not. Test ids name the page and the line (`docs/memory.md:52`).

Commands run as a user would type them, 250 columns wide, in a directory laid out as the examples
assume: runs/tiny is the session's shared 12-step debug run (tests/trained_run.py) standing in for
`make train`'s run, and runs/tiny.log what its `train` printed; c.jsonl holds the first 20 documents
of the built-in corpus; mine/ holds a file llmtrain did not write; another process (pid 11632 on host
vm) holds the lock of runs/x. Commands run in-process through `llmtrain.cli.main`, except `train` and
`resume`, which run as subprocesses (a run must not start a process group in the test process).

Measured figures (tokens/s, ratios, sizes, times, losses of a recorded run) are quoted under a
`<!-- figures: bench/results/NAME.json ... -->` comment that gives each one's JSON path; each is
compared with its file, read at test time, within the rounding it is quoted to. The format and the
rules are in tests/doc_figures.py. The README fits on a page (MAX_README_LINES), every docs page is
linked from it, and no link leaves the repository.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import doc_figures
import pytest
from trained_run import train_log, trained_run

from llmtrain.cli import main
from llmtrain.data.corpus import builtin_corpus
from llmtrain.run.lock import Holder

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 350
COMMAND_BLOCKS = {"bash", "yaml", "python", "markdown"}  # commands or text to type, not output
MARKER = re.compile(r"<!-- output: (?P<mode>exact|shape|illustrative)(?:: (?P<source>.+?))? -->")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
RULES = re.compile(r"([─━═])\1+")  # a table's horizontal rules, as long as its columns are wide
COLUMNS = "250"
CORPUS_DOCUMENTS = 20
# The run standing in for runs/tiny has the debug preset where make train's has tiny: `runs`' preset cell.
STAND_INS = {re.compile(r"(?<=│ )debug(?= +│)"): "tiny"}


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    info: str  # the fence's language
    marker: str | None  # the line before the fence, when it is an output marker
    body: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    """One command's (or file's) output as a page shows it."""

    page: str  # README.md, docs/NAME.md
    line: int
    mode: str
    source: str  # `llmtrain ARGS` or `file PATH`
    expected: tuple[str, ...]


def read_blocks(text: str) -> list[Block]:
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[i - 1].strip() if i > 0 else ""
        marker = before if before.startswith("<!-- output") else None
        blocks.append(Block(i + 1, lines[i][3:].strip(), marker, tuple(lines[i + 1 : end])))
        i = end + 1
    return blocks


def samples(block: Block, page: str = "README.md") -> list[Sample]:
    """The commands or files a marked block shows, each with its expected lines."""
    found = MARKER.fullmatch(block.marker or "")
    if found is None or found["mode"] == "illustrative":
        return []  # a malformed marker fails test_every_output_block_in_the_readme_is_marked
    mode, source = found["mode"], found["source"]
    if source is not None or not block.body or not block.body[0].startswith("$ "):
        return [Sample(page, block.line, mode, source or "(no `$ llmtrain ...` line)", block.body)]
    out: list[Sample] = []
    for offset, text in enumerate(block.body):
        if text.startswith("$ "):
            out.append(Sample(page, block.line + 1 + offset, mode, text[2:], ()))
        else:
            last = out[-1]
            out[-1] = Sample(page, last.line, mode, last.source, (*last.expected, text))
    return out


PAGES = {doc_figures.page_name(path): path for path in doc_figures.pages()}


def _sample_blocks() -> list[tuple[Sample, ...]]:
    """Each marked block's samples, run in order in one test: a block's commands may build on each other
    (`tokenizer train`, then `prepare-data` with its tokenizer), whatever order the tests run in."""
    return [
        found
        for name, path in PAGES.items()
        for b in read_blocks(path.read_text())
        if b.marker is not None and (found := tuple(samples(b, name)))
    ]


# ---------------------------------------------------------------- comparing


def shape(line: str) -> str:
    return RULES.sub(r"\1", re.sub(r"\s+", " ", NUMBER.sub("#", line))).strip()


def first_missing(expected: tuple[str, ...], output: str, mode: str) -> str | None:
    """The first expected line that the output lacks (in order), or None when every one is there."""
    norm: Callable[[str], str] = shape if mode == "shape" else str.rstrip
    if mode == "shape":
        for word, stand_in in STAND_INS.items():
            output = word.sub(stand_in, output)
    have, at = [norm(line) for line in output.splitlines()], 0
    for line in expected:
        if line.strip() == "...":
            continue
        try:
            at = have.index(norm(line), at) + 1
        except ValueError:
            return line
    return None


# ---------------------------------------------------------------- the directory the examples assume


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    run_dir = trained_run(tmp_path_factory)
    w = tmp_path_factory.mktemp("readme")
    (w / "runs").mkdir()
    (w / "runs" / "tiny").symlink_to(run_dir)
    (w / "runs" / "tiny.log").symlink_to(train_log(run_dir))
    with builtin_corpus().open() as corpus:
        (w / "c.jsonl").write_text("".join(next(corpus) for _ in range(CORPUS_DOCUMENTS)))
    (w / "mine").mkdir()
    (w / "mine" / "notes.txt").write_text("my notes\n")
    fd = _hold_lock(w / "runs" / "x", Holder("vm", 11632, "llmtrain train", "2026-12-02T11:37:19+0000"))
    yield w
    os.close(fd)


def _hold_lock(run_dir: Path, holder: Holder) -> int:
    """Hold run_dir's lock as a running `train` elsewhere would: flocked, the file naming its holder."""
    run_dir.mkdir()
    fd = os.open(run_dir / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, (json.dumps(asdict(holder)) + "\n").encode())
    return fd


def output_of(source: str, world: Path, capsys: pytest.CaptureFixture[str]) -> str:
    kind, _, rest = source.partition(" ")
    if kind == "file":
        return (world / rest).read_text()
    assert kind == "llmtrain", f"{source!r}: a sample shows `llmtrain ARGS` or `file PATH`"
    argv = shlex.split(rest)
    if argv[0] in ("train", "resume"):
        env = dict(os.environ, COLUMNS=COLUMNS, OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, "-m", "llmtrain", *argv],
            cwd=world,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        return proc.stdout
    capsys.readouterr()
    main(argv)
    out, err = capsys.readouterr()
    return out + err


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("block", _sample_blocks(), ids=lambda b: f"{b[0].page}:{b[0].line}")
def test_a_sample_is_what_the_command_prints(
    block: tuple[Sample, ...],
    world: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(world)
    monkeypatch.setenv("COLUMNS", COLUMNS)
    for sample in block:
        output = output_of(sample.source, world, capsys)
        missing = first_missing(sample.expected, output, sample.mode)
        assert missing is None, (
            f"{sample.page}:{sample.line} ({sample.mode}) `{sample.source}`: this line is not in the output "
            f"(in order):\n{missing}\n--- the output:\n{output}"
        )


@pytest.mark.parametrize("page", PAGES)
def test_every_output_block_is_marked(page: str) -> None:
    blocks = read_blocks(PAGES[page].read_text())
    unmarked = [f"{page}:{b.line}" for b in blocks if b.marker is None and b.info not in COMMAND_BLOCKS]
    assert not unmarked, f"output blocks without an <!-- output: ... --> marker: {unmarked}"
    for block in blocks:
        if block.marker is not None:
            found = MARKER.fullmatch(block.marker)
            assert found, f"{page}:{block.line}: malformed marker {block.marker!r}"
            if found["mode"] == "illustrative":
                assert found["source"], f"{page}:{block.line}: say why the block is not checked"


def test_the_comparison_finds_a_changed_number_a_changed_word_and_lines_out_of_order() -> None:
    step, evaluation = "step 1/12 loss 6.2593 eta 0:00:01", "eval step 6 val_loss 5.9549"
    output = f"{step}\n{evaluation}\n│ tokens        │   3,072 │\n"
    assert first_missing((step, "...", evaluation), output, "exact") is None
    assert first_missing((evaluation, step), output, "exact") == step
    assert first_missing((step.replace("6.2593", "6.2594"),), output, "exact") is not None
    long_run = ("step 300/300 loss 5.2825 eta 1:00:08", "│ tokens │ 614,400 │")
    assert first_missing(long_run, output, "shape") is None
    assert first_missing(("step 300/300 lost 5.2825 eta 1:00:08",), output, "shape") is not None
    assert first_missing(("│ tiny │ tiny   │ 300 / 300 │",), "│ tiny │ debug  │ 12 / 12 │", "shape") is None


# ---------------------------------------------------------------- measured figures against their files


def _figure_ids() -> list[tuple[str, int]]:
    """(page, line of the entry) for every figure quoted under a figures comment."""
    out: list[tuple[str, int]] = []
    for name, path in PAGES.items():
        try:
            out += [
                (name, e.line) for scope in doc_figures.scopes(path.read_text(), name) for e in scope.entries
            ]
        except doc_figures.FigureError as e:  # a malformed comment: one failing case naming it
            out.append((f"{name}: {e}", 0))
    return out


@pytest.mark.parametrize("page, line", _figure_ids(), ids=lambda v: str(v))
def test_a_quoted_figure_is_what_its_results_file_holds(page: str, line: int) -> None:
    assert line, page
    results = [
        (check, why)
        for scope in doc_figures.scopes(PAGES[page].read_text(), page)
        for check, why in doc_figures.check_scope(scope)
        if check.line == line and check.file
    ]
    assert results, f"{page}:{line}: no figure there"
    for check, why in results:
        assert why is None, f"{check}: {why}"


@pytest.mark.parametrize("page", PAGES)
def test_no_measured_figure_is_quoted_without_its_results_file(page: str) -> None:
    text = PAGES[page].read_text()
    unsourced = doc_figures.unsourced_outside(text, page)
    unsourced += [
        why or ""
        for scope in doc_figures.scopes(text, page)
        for check, why in doc_figures.check_scope(scope)
        if not check.file
    ]
    assert not unsourced, "measured-looking figures without a results file:\n" + "\n".join(unsourced)


RESULT_LINK = re.compile(r"\]\((?:\.\./)?(bench/results/[\w.-]+\.json)\)")


@pytest.mark.parametrize("page", PAGES)
def test_every_results_file_quoted_or_linked_exists_with_its_machine_facts(page: str) -> None:
    text = PAGES[page].read_text()
    named = set(RESULT_LINK.findall(text))
    named |= {e.file for scope in doc_figures.scopes(text, page) for e in scope.entries}
    for path in sorted(named):
        assert (ROOT / path).is_file(), f"{page} quotes or links {path}, which does not exist"
        assert "machine" in json.loads((ROOT / path).read_text()), f"{path}: no machine facts"


def _copy_pages(root: Path) -> None:
    (root / "docs").mkdir()
    for name, path in PAGES.items():
        (root / name).write_text(path.read_text())
    (root / "bench" / "results").mkdir(parents=True)
    for path in (ROOT / "bench" / "results").glob("*.json"):
        (root / "bench" / "results" / path.name).write_text(path.read_text())


def _failures(root: Path) -> list[str]:
    return [f"{check}: {why}" for check, why in doc_figures.all_checks(root) if why is not None]


def test_a_figure_edited_in_a_copy_or_re_recorded_in_its_file_fails(tmp_path: Path) -> None:
    """In a copy of the pages and results files: unedited, every figure holds; a quoted figure edited in
    the text (alone, or with its entry), or its number re-recorded in the file, fails naming it."""
    _copy_pages(tmp_path)
    assert _failures(tmp_path) == []
    scope = next(s for s in doc_figures.scopes(README.read_text(), "README.md") if s.entries)
    entry = next(e for e in scope.entries if doc_figures.quoted_value(e.figure, e.stored) is not None)
    quoted = doc_figures.quoted_value(entry.figure, entry.stored)
    assert quoted is not None
    lines = README.read_text().splitlines(keepends=True)
    at = next(i for i in range(scope.first - 1, scope.last) if entry.figure in lines[i])
    edited = re.sub(r"\d(?=\D*$)", lambda m: str((int(m.group()) + 3) % 10), entry.figure)  # last digit
    assert edited != entry.figure

    def readme_with(text_line: str, entry_line: str) -> None:
        new = list(lines)
        new[at], new[entry.line - 1] = text_line, entry_line
        (tmp_path / "README.md").write_text("".join(new))

    readme_with(lines[at].replace(entry.figure, edited, 1), lines[entry.line - 1])
    assert any(str(entry.line) in f and "is not quoted" in f for f in _failures(tmp_path)), _failures(
        tmp_path
    )
    readme_with(
        lines[at].replace(entry.figure, edited, 1), lines[entry.line - 1].replace(entry.figure, edited, 1)
    )
    assert any(
        f"README.md:{entry.line} {edited!r}" in f and "does not round" in f for f in _failures(tmp_path)
    )

    (tmp_path / "README.md").write_text(README.read_text())
    results = tmp_path / entry.file
    data = json.loads(results.read_text())
    steps = re.findall(r'\.[A-Za-z_][\w-]*|\["[^"]+"\]|\[\d+\]', "." + entry.path.lstrip("."))
    parent = doc_figures.lookup(data, "".join(steps[:-1]))
    last = steps[-1]
    key: str | int = int(last[1:-1]) if last[1:-1].isdigit() else last.strip('.[]"')
    parent[key] += 12 * quoted.tolerance  # twelve times its rounding: a drift, not noise
    results.write_text(json.dumps(data))
    failures = _failures(tmp_path)
    assert any(f"README.md:{entry.line} " in f and "does not round" in f for f in failures), failures


def test_a_figure_holds_within_its_quoted_rounding_only() -> None:
    def holds(figure: str, value: object, stored: str | None = None) -> bool:
        return doc_figures.compare(doc_figures.Entry(1, figure, "f.json", "x", stored), value) is None

    assert holds("1.47×", 1.4651) and not holds("1.47×", 1.4549) and not holds("1.47×", 1.4751)
    assert holds("1,971", 1970.85) and not holds("1,971", 1972.0)
    assert holds("155k", 155059.8) and not holds("155k", 155600.0)
    assert holds("0.3%", 0.00339) and not holds("0.3%", 0.0036)
    assert holds("96.31 MiB", 100986376, "bytes") and not holds("96.31 MiB", 100986376)
    assert holds("2.6 MB", 2596540, "bytes") and not holds("2.7 MB", 2596540, "bytes")
    assert holds("4 min 32 s", 272.4, "seconds") and not holds("4 min 32 s", 273.6, "seconds")
    assert holds("10 minutes", 573.2, "seconds") and not holds("10 minutes", 535.0, "seconds")
    assert holds("11.2 MiB", 11.1757) and holds("−0.20%", -0.002) and not holds("+0.20%", -0.002)
    assert holds("bf16", "bf16") and not holds("bf16", "fp32") and not holds("5.35", "5.35")


def test_the_readme_fits_on_a_page_and_links_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, f"README.md: {len(text.splitlines())} lines"
    linked = {target for target, _ in LINK.findall(text)}
    unlinked = [name for name in PAGES if name.startswith("docs/") and name not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    lines = page.read_text().splitlines()
    code = doc_figures.code_lines(lines)
    headings = [
        line.lstrip("#").strip() for i, line in enumerate(lines) if i not in code and line.startswith("#")
    ]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES)
def test_links_stay_inside_the_repository_and_reach_their_headings(page: str) -> None:
    """Every link is a web address or a file of the repository, relative to the page; a link to a
    heading (`docs/checkpoints.md#soak`) names one the page has."""
    lines = PAGES[page].read_text().splitlines()
    code = doc_figures.code_lines(lines)
    text = "\n".join(line for i, line in enumerate(lines) if i not in code)
    for target, anchor in LINK.findall(text):
        if re.match(r"https?://", target):
            continue
        resolved = (PAGES[page].parent / target).resolve() if target else PAGES[page]
        assert resolved.is_relative_to(ROOT), f"{page}: {target} is outside the repository"
        assert resolved.exists(), f"{page}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(resolved), f"{page}: {target}#{anchor}: no such heading"
