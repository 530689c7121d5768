"""`make train` as a newcomer runs it, on this CPU as it is and under AVX2-only kernels.

`python -m bench make_train` runs the Makefile's `train` target twice, each into a fresh run directory
with a fresh data cache (so the wall time includes tokenizing the built-in corpus, as a first `make
train` after `make install` does), and keeps each run's figures (bench.record_run):

- bench/results/make_train.json: the CPU as it is (`--precision auto` picks bf16 where it is native);
- bench/results/make_train_avx2.json: under `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`, which
  make oneDNN and ATen use their AVX2 kernels only: what a CPU without AMX or AVX-512-bf16 does (auto
  picks fp32 there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ranks import REPO, write_result
from bench.record_run import record

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
CASES = {"make_train": {}, "make_train_avx2": AVX2_ONLY}


def run_make_train(scratch: Path, caps: dict[str, str]) -> dict[str, Any]:
    """`make train` into scratch/run with its own data cache; its record with the whole command's time."""
    run_dir = scratch / "run"
    env = {**os.environ, **caps, "LLMTRAIN_CACHE_DIR": str(scratch / "cache")}
    started = time.perf_counter()
    subprocess.run(["make", "-s", "train", f"TRAIN_RUN_DIR={run_dir}"], cwd=REPO, env=env, check=True)
    wall = time.perf_counter() - started
    return {**record(run_dir), "wall_seconds": round(wall, 1), "data_cache": "cold (tokenized in the run)"}


def main(names: list[str] | None = None) -> None:
    """Every case, or those named (`python -m bench.bench_make_train make_train_avx2`)."""
    unknown = sorted(set(names or []) - set(CASES))
    if unknown:
        raise SystemExit(f"error: no case {', '.join(unknown)}; cases: {', '.join(CASES)}")
    for name, caps in CASES.items():
        if names and name not in names:
            continue
        with tempfile.TemporaryDirectory(prefix=f"llmtrain-{name}-") as scratch:
            result = run_make_train(Path(scratch), caps)
        write_result(result, REPO / "bench" / "results" / f"{name}.json")


if __name__ == "__main__":
    main(sys.argv[1:])
