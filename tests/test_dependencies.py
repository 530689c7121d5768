"""What pyproject.toml declares is what the code imports, and the installed environment is consistent.

llmtrain/ is checked against `dependencies`; tests/ and bench/ against `dependencies` plus the `test`
extra. An import with no declaration (a package that only arrives through another one) fails, and so
does a declaration nothing imports, unless it is in an allow-list below with the reason it is needed.
Import names map to distribution names through importlib.metadata.packages_distributions(). Then:
`pip check` passes in the environment, and the offline install (scripts/wheelhouse.sh) refuses a
wheelhouse it cannot use in one line.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent

# Needed at run time although no file imports them.
RUNTIME_ONLY = {
    # torch.utils.cpp_extension builds DeepSpeed's ops (cpu_adam for CPU offload, fused_adam, async_io
    # for NVMe offload) with ninja the first time a run uses them; scripts/install.sh builds them with it.
    "ninja",
}
# Tools and pytest plugins of the test extra: run as programs or loaded by pytest, never imported.
TOOLS = {
    "pytest-timeout",  # pyproject's [tool.pytest.ini_options] timeout
    "pytest-randomly",  # random test order (disable with -p no:randomly)
    "pytest-xdist",  # parallel test processes (-n)
    "ruff",  # make lint
    "mypy",  # make typecheck
    "types-pyyaml",  # yaml's type stubs, read by mypy
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(section: str = "dependencies") -> set[str]:
    """Distribution names of pyproject's `dependencies`, or of one optional extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = (
        project["dependencies"] if section == "dependencies" else project["optional-dependencies"][section]
    )
    names = set()
    for spec in specs:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
        assert match, f"pyproject.toml: cannot read the distribution name of {spec!r}"
        names.add(normalize(match.group()))
    return names


def local_modules() -> set[str]:
    """Names that resolve to this repository's own files: its packages, and tests/ helper modules
    (conftest puts tests/ on sys.path)."""
    return {"llmtrain", "bench"} | {p.stem for p in (REPO / "tests").glob("*.py")}


def imported_modules(*folders: str) -> dict[str, str]:
    """Top-level module name -> the first file importing it (absolute imports only)."""
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def third_party(*folders: str) -> dict[str, str]:
    """Distribution name -> a file importing it, for every import outside the stdlib and the repo."""
    local = local_modules()
    distributions = importlib.metadata.packages_distributions()
    result: dict[str, str] = {}
    for module, where in imported_modules(*folders).items():
        if module in sys.stdlib_module_names or module in local:
            continue
        dists = distributions.get(module)
        assert dists, f"{where} imports {module}, which no installed distribution provides"
        result.setdefault(normalize(dists[0]), where)
    return result


def test_llmtrain_imports_what_it_declares() -> None:
    imports = third_party("llmtrain")
    undeclared = {dist: where for dist, where in imports.items() if dist not in declared()}
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"
    unused = declared() - set(imports) - RUNTIME_ONLY
    assert not unused, f"in pyproject's dependencies but imported by no file of llmtrain/: {unused}"


def test_tests_and_bench_import_what_the_test_extra_declares() -> None:
    imports = third_party("tests", "bench")
    allowed = declared() | declared("test")
    undeclared = {dist: where for dist, where in imports.items() if dist not in allowed}
    assert not undeclared, f"imported but not in pyproject's dependencies or test extra: {undeclared}"
    unused = declared("test") - set(imports) - TOOLS
    assert not unused, f"in pyproject's test extra but imported by no file of tests/ or bench/: {unused}"


def test_allow_lists_name_declared_distributions() -> None:
    assert declared() >= RUNTIME_ONLY
    assert declared("test") >= TOOLS


@pytest.mark.parametrize("holds", ["python 2.7\nplatform manylinux_2_28_x86_64\n", None])
def test_install_offline_refuses_a_wheelhouse_it_cannot_use_in_one_line(
    tmp_path: Path, holds: str | None
) -> None:
    """Before creating anything: a wheelhouse built for another Python, or no wheelhouse at all."""
    wheelhouse = tmp_path / "wheelhouse"
    if holds is not None:
        wheelhouse.mkdir()
        (wheelhouse / "wheelhouse.txt").write_text(holds)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "wheelhouse.sh"), "install", str(wheelhouse)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: WHEELHOUSE {wheelhouse}"), lines


def test_pip_check_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
