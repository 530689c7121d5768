import os
import sys
from pathlib import Path

import pytest

# DeepSpeed picks its accelerator at import; tests run on CPU unless a GPU test asks otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

# The files whose tests take minutes (trained references, multi-process kills and resumes, the loopback
# cluster), longest first. `make test` hands whole files to its xdist workers in collection order, so
# these start first and the short files fill in around them; in a shuffled order a long file starting
# last kept one worker running alone for ten minutes at the end of the suite.
LONGEST_FIRST = [
    "test_resume.py",
    "test_multinode.py",
    "test_zero_plus.py",
    "test_hsdp.py",
    "test_parallel.py",
    "test_faults.py",
    "test_checkpoint.py",
    "test_pipeline.py",
    "test_slurm.py",
    "test_train_dist.py",
    "test_readme.py",
    "test_data_mixture_run.py",
    "test_export_parallel.py",
    "test_export_fsdp2.py",
    "test_init_from.py",
    "test_killed_launch.py",
    "test_train_cli.py",
    "test_export_pipeline.py",
    "test_lock.py",
    "test_bench_engines.py",
    "test_bench_memory.py",
    "test_bad_input.py",
    "test_run_prepare.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, after pytest-randomly's shuffle (a stable sort: the shuffled order of the
    tests inside each file, and of all other files, is kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
