"""The README's sample outputs are what the code prints, so they cannot drift.

A README code block that shows output has a marker on the line before its opening fence, an HTML
comment that GitHub does not show:

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
Unmarked blocks other than `bash`, `yaml` and `python` ones are refused, so a new sample is checked
or says why not.

Commands run as a user would type them, 250 columns wide, in a directory laid out as the examples
assume: runs/tiny is the session's shared 12-step debug run (tests/trained_run.py) standing in for
`make train`'s run, and runs/tiny.log what its `train` printed; c.jsonl holds the first 20 documents
of the built-in corpus; mine/ holds a file llmtrain did not write; another process (pid 11632 on host
vm) holds the lock of runs/x. Commands run in-process through `llmtrain.cli.main`, except `train` and
`resume`, which run as subprocesses (a run must not start a process group in the test process).
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

import pytest
from trained_run import train_log, trained_run

from llmtrain.cli import main
from llmtrain.data.corpus import builtin_corpus
from llmtrain.run.lock import Holder

README = Path(__file__).resolve().parent.parent / "README.md"
MEASURED = "## Measured results"  # below: figures kept in results files, named in each section
COMMAND_BLOCKS = {"bash", "yaml", "python"}  # commands to type, not output
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
    """One command's (or file's) output as the README shows it."""

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


def samples(block: Block) -> list[Sample]:
    """The commands or files a marked block shows, each with its expected lines."""
    found = MARKER.fullmatch(block.marker or "")
    if found is None or found["mode"] == "illustrative":
        return []  # a malformed marker fails test_every_output_block_in_the_readme_is_marked
    mode, source = found["mode"], found["source"]
    if source is not None or not block.body or not block.body[0].startswith("$ "):
        return [Sample(block.line, mode, source or "(no `$ llmtrain ...` line)", block.body)]
    out: list[Sample] = []
    for offset, text in enumerate(block.body):
        if text.startswith("$ "):
            out.append(Sample(block.line + 1 + offset, mode, text[2:], ()))
        else:
            last = out[-1]
            out[-1] = Sample(last.line, mode, last.source, (*last.expected, text))
    return out


def _readme_samples() -> list[Sample]:
    return [s for b in read_blocks(README.read_text()) if b.marker is not None for s in samples(b)]


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


@pytest.mark.parametrize("sample", _readme_samples(), ids=lambda s: f"line{s.line}")
def test_a_readme_sample_is_what_the_command_prints(
    sample: Sample, world: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(world)
    monkeypatch.setenv("COLUMNS", COLUMNS)
    output = output_of(sample.source, world, capsys)
    missing = first_missing(sample.expected, output, sample.mode)
    assert missing is None, (
        f"README.md:{sample.line} ({sample.mode}) `{sample.source}`: this line is not in the output "
        f"(in order):\n{missing}\n--- the output:\n{output}"
    )


def test_every_output_block_in_the_readme_is_marked() -> None:
    blocks = read_blocks(README.read_text())
    unmarked = [f"README.md:{b.line}" for b in blocks if b.marker is None and b.info not in COMMAND_BLOCKS]
    assert not unmarked, f"output blocks without an <!-- output: ... --> marker: {unmarked}"
    for block in blocks:
        if block.marker is not None:
            found = MARKER.fullmatch(block.marker)
            assert found, f"README.md:{block.line}: malformed marker {block.marker!r}"
            if found["mode"] == "illustrative":
                assert found["source"], f"README.md:{block.line}: say why the block is not checked"


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


RESULT_FILE = re.compile(r"`((?:bench/results/[\w.-]+\.json)|(?:tests/[\w.-]+\.py))")


def test_every_measured_figure_names_the_file_it_comes_from() -> None:
    """Under "## Measured results" each subsection quoting figures names where they are kept: a results
    file written by the benchmark that measured them (bench/results/NAME.json, with the machine and the
    versions), or the test that measures them; every file named exists."""
    text = README.read_text()
    measured = text[text.index(MEASURED) :].split("\n## ", 1)[0]
    root = README.parent
    for section in measured.split("\n### ")[1:]:
        title = section.splitlines()[0]
        named = RESULT_FILE.findall(section)
        assert named, f"README: measured results '{title}' name no results file or test"
        for path in named:
            assert (root / path).is_file(), f"README: '{title}' names {path}, which does not exist"
            if path.endswith(".json"):
                assert "machine" in json.loads((root / path).read_text()), f"{path}: no machine facts"
