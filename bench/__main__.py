"""Run every `bench/bench_*.py` module's `main()` in turn: `python -m bench [NAME ...]`.

NAME filters by module name (`python -m bench data` runs bench_data only).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from pathlib import Path


def discover() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def run(names: list[str]) -> int:
    modules = [m for m in discover() if not names or any(n in m for n in names)]
    if not modules:
        print(
            f"error: no benchmark matches {' '.join(names)}; available: {', '.join(discover())}",
            file=sys.stderr,
        )
        return 2
    for name in modules:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        importlib.import_module(f"bench.{name}").main()
        print(f"== {name} done in {time.perf_counter() - started:.1f}s\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
