"""The run directory: everything needed to understand and resume a run.

RUN_DIR/config.yaml       the frozen TrainConfig (written by run.prepare.freeze; workers and `resume` read it)
RUN_DIR/ds_config.json    the DeepSpeed dict handed to deepspeed.initialize (--engine deepspeed)
RUN_DIR/fsdp2_plan.json   FSDP2's units, policies, optimizer and batch (--engine fsdp2)
RUN_DIR/environment.json  library versions, git sha, hardware, world size, the layout and its process groups
RUN_DIR/metrics.jsonl     one record per logged step (train/metrics.py)
RUN_DIR/curves.png        its loss curves, redrawn at each evaluation and at the end (train/plot.py)
RUN_DIR/checkpoints/      step_XXXXXXXX/ tags, manifest.json in each, `latest` (the checkpoint package)
RUN_DIR/tokenizer.json    the tokenizer the data was prepared with (generate / eval / export use it)
RUN_DIR/wandb/            Weights & Biases' files and the run's wandb id (--wandb offline|online)
RUN_DIR/run.lock          held by the run's one writer (run/lock.py); names it while it runs
RUN_DIR/profile/          --profile's traces and memory snapshots, one file per rank (train/profile.py)
RUN_DIR/fork.json         a forked run's parent run, step and checkpoint (run/fork.py)

A fresh `train` writes only into a new or empty directory, or over the files of a run of llmtrain's that
never saved a checkpoint (`RUN_NAMES`): never beside files llmtrain did not write.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from llmtrain.config import ConfigError, TrainConfig, dump_yaml, load_run_config
from llmtrain.fsutil import refuse_foreign_names, write_atomic
from llmtrain.parallel import mesh
from llmtrain.planning.layout import Layout

CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "ds_config.json"
FSDP2_PLAN_FILE = "fsdp2_plan.json"
ENGINE_CONFIG_FILES = {"deepspeed": DS_CONFIG_FILE, "fsdp2": FSDP2_PLAN_FILE}
ENVIRONMENT_FILE = "environment.json"
CHECKPOINT_DIR = "checkpoints"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # a Hugging Face tokenizer's special-token names
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
WANDB_DIR = "wandb"
LOCK_FILE = "run.lock"
LAUNCH_DIR = "launch"  # a hostfile launch's hostfile and the workers' environment (run.nodes)
PROFILE_DIR = "profile"  # --profile's traces and memory snapshots (train/profile.py)
FORK_FILE = "fork.json"  # a forked run's parent, step and checkpoint (run/fork.py)
# Every name llmtrain writes at the top of a run directory (the one list: a fresh run refuses others).
RUN_NAMES = frozenset(
    {
        CONFIG_FILE,
        DS_CONFIG_FILE,
        FSDP2_PLAN_FILE,
        ENVIRONMENT_FILE,
        METRICS_FILE,
        CURVES_FILE,
        CHECKPOINT_DIR,
        TOKENIZER_FILE,
        TOKENIZER_CONFIG_FILE,
        WANDB_DIR,
        LOCK_FILE,
        LAUNCH_DIR,
        PROFILE_DIR,
        FORK_FILE,
    }
)
# What a write cut short leaves beside them: fsutil.write_atomic's `.NAME.tmpPID`, metrics' `NAME.tmp`.
_LEFTOVER = re.compile(r"^\.(?P<atomic>.+)\.tmp\d+$|^(?P<plain>.+)\.tmp$")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def default_run_dir(cfg: TrainConfig) -> Path:
    """runs/<preset>-zero<stage>-<yyyymmdd-hhmmss>: readable, sortable, unique per second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = _SAFE_NAME.sub("-", f"{cfg.preset}-zero{cfg.zero.stage}-{stamp}")
    return Path("runs") / name


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_DIR


def has_checkpoints(run_dir: Path) -> bool:
    root = checkpoint_root(run_dir)
    return root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir())


def refuse_fresh_run_over_checkpoints(run_dir: Path) -> None:
    if has_checkpoints(run_dir):
        raise ConfigError(
            f"--run-dir {run_dir}: already holds checkpoints; continue it with `llmtrain resume {run_dir}`, "
            "pass --resume auto, or choose another --run-dir"
        )


def is_run_name(name: str) -> bool:
    """A name llmtrain writes at the top of a run directory (or the leftover of one's interrupted write)."""
    leftover = _LEFTOVER.match(name)
    if leftover:
        name = leftover.group("atomic") or leftover.group("plain")
    return name in RUN_NAMES


def foreign_names(run_dir: Path) -> list[str]:
    """What `run_dir` holds that llmtrain did not write there (sorted); none for a missing directory."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if not is_run_name(p.name))


def refuse_foreign_files(run_dir: Path) -> None:
    """A fresh run never writes beside files llmtrain did not write: refused before anything is written."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: not a directory; pass a new or empty directory")
    refuse_foreign_names("--run-dir", run_dir, foreign_names(run_dir), "llmtrain")


def train_run_dir(cfg: TrainConfig) -> Path:
    """The directory a `train` writes: --run-dir, or a new runs/<name> (set in `cfg`, frozen with it).
    Unless it holds a checkpoint to resume or refuse, one holding the user's files is refused here,
    before the lock file is made in it."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    cfg.run_dir = str(run_dir)
    if not has_checkpoints(run_dir):
        refuse_foreign_files(run_dir)
    return run_dir


def write_config(run_dir: Path, cfg: TrainConfig) -> None:
    """RUN_DIR/config.yaml, the frozen config (written only by run.prepare.freeze)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / CONFIG_FILE, dump_yaml(cfg))


def load_saved_config(run_dir: Path) -> TrainConfig:
    """The frozen config of the run in `run_dir`; bad input naming the directory when it is not a run."""
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory; list runs with `llmtrain runs`")
    if not path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no {CONFIG_FILE}); pass the RUN_DIR of a run")
    return load_run_config(path)


def write_run_files(run_dir: Path, engine: str, engine_config: dict[str, Any], layout: Layout) -> None:
    """Rank 0 only: the engine's settings (ds_config.json, or fsdp2_plan.json) and environment.json
    (with the layout and its mesh's process groups by rank), each written atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / ENGINE_CONFIG_FILES[engine], json.dumps(engine_config, indent=2) + "\n")
    env = {**environment(layout.world_size), "layout": layout.describe(), "mesh": mesh.describe(layout)}
    write_atomic(run_dir / ENVIRONMENT_FILE, json.dumps(env, indent=2) + "\n")


def copy_tokenizer(run_dir: Path, tokenizer_json: Path, given: str | None = None) -> None:
    """Rank 0 only: RUN_DIR/tokenizer.json, so the run directory alone is enough to sample or export;
    with it the tokenizer_config.json of a Hugging Face tokenizer the run was `given` (--tokenizer, or
    --init-from's), which names its end-of-text and start tokens."""
    if tokenizer_json.is_file():
        write_atomic(run_dir / TOKENIZER_FILE, tokenizer_json.read_text(encoding="utf-8"))
    if given is None:
        return
    source = Path(given).expanduser()
    config = (source if source.is_dir() else source.parent) / TOKENIZER_CONFIG_FILE
    if config.is_file():
        write_atomic(run_dir / TOKENIZER_CONFIG_FILE, config.read_text(encoding="utf-8"))


# The CPU flags that decide how fast bf16 and fp32 matmuls run (and so what a speed figure means).
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")
# Environment variables that cap the kernels oneDNN and ATen use (`ONEDNN_MAX_CPU_ISA=AVX2` makes an AMX
# CPU run bf16 like an AVX2-only one): recorded when set, since they change every figure.
KERNEL_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")


def environment(world_size: int) -> dict[str, Any]:
    """Versions, commit and hardware: what a later reader needs to reproduce the run or judge a figure."""
    import deepspeed
    import torch

    import llmtrain

    env: dict[str, Any] = {
        "llmtrain": llmtrain.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        **machine_facts(),
        "world_size": world_size,
        "accelerator": os.environ.get("DS_ACCELERATOR", "cpu"),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return env


def machine_facts() -> dict[str, Any]:
    """The commit and the CPU facts a speed figure depends on (also the GPU check's environment)."""
    import torch

    return {
        "git_sha": _git(["rev-parse", "HEAD"]),
        "git_clean": _git_clean(),
        "cpu_model": _cpu_model(),
        "cpu_flags": _matmul_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "kernel_caps": {name: os.environ[name] for name in KERNEL_CAPS if name in os.environ},
    }


def _cpu_model() -> str | None:
    """/proc/cpuinfo's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _matmul_flags() -> list[str]:
    """Which of MATMUL_FLAGS the CPU reports (Linux's /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return [flag for flag in MATMUL_FLAGS if flag in flags]


def _memory_bytes() -> int | None:
    import psutil

    return int(psutil.virtual_memory().total)


def _git_clean() -> bool | None:
    """Whether the checkout had no uncommitted change to tracked files (None outside a git checkout).
    The benchmarks' results files do not count: `make bench` rewrites them one benchmark after another,
    and the code each measures is the same commit."""
    status = _git(
        ["status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
        keep_empty=True,
    )
    return None if status is None else status == ""


def _git(args: list[str], keep_empty: bool = False) -> str | None:
    """`git ARGS` in llmtrain's own checkout: its stripped output, None outside a checkout or on failure."""
    here = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    text = out.stdout.strip()
    return text if text or keep_empty else None
