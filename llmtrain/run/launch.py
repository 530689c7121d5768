"""More than one process: re-execute under DeepSpeed's launcher, or run directly inside one.

`llmtrain train --gpus 2` (not inside a launcher) resolves the config, writes RUN_DIR/config.yaml, and
runs `deepspeed --num_gpus 2 ... --module llmtrain resume RUN_DIR --fresh-ok` so every worker reads the
same resolved config. Inside a launcher (RANK / WORLD_SIZE set by deepspeed, torchrun or Slurm) the
workers train directly. The launcher runs in its own session: SIGINT / SIGTERM reach this process
only, which passes SIGTERM to the workers themselves, so they finish the step, save and exit 0
(DeepSpeed's launch.py would kill them after 30 s and exit 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from llmtrain.config import ConfigError, TrainConfig, flag_for

_HOSTFILE_LINE = re.compile(r"^\s*(\S+)\s+slots\s*=\s*(\d+)\s*$")


def read_hostfile(path: str) -> dict[str, int]:
    """DeepSpeed's hostfile: `hostname slots=N` per line; # comments and blank lines allowed."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--hostfile {path}: file not found; write one `hostname slots=N` line per node")
    hosts: dict[str, int] = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        text = line.split("#", 1)[0]
        if not text.strip():
            continue
        match = _HOSTFILE_LINE.match(text)
        if not match or int(match.group(2)) < 1:
            raise ConfigError(
                f"--hostfile {path}:{number}: expected `hostname slots=N` with N >= 1, got {line.strip()!r}"
            )
        if match.group(1) in hosts:
            raise ConfigError(f"--hostfile {path}:{number}: host {match.group(1)} listed twice")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise ConfigError(f"--hostfile {path}: no hosts listed; write one `hostname slots=N` line per node")
    return hosts


def check_launch(cfg: TrainConfig) -> None:
    """Launch settings that can be checked before anything starts."""
    launch = cfg.launch
    if launch.hostfile is not None:
        hosts = read_hostfile(launch.hostfile)
        if launch.nodes > len(hosts):
            raise ConfigError(
                f"{flag_for('launch.nodes')}: {launch.nodes} nodes asked for but {launch.hostfile} lists "
                f"{len(hosts)}; add hosts or lower --nodes"
            )
    elif launch.nodes > 1:
        raise ConfigError(f"{flag_for('launch.nodes')}: {launch.nodes} nodes need --hostfile listing them")


def needs_relaunch(cfg: TrainConfig) -> bool:
    from llmtrain.parallel.distributed import inside_launcher

    return cfg.world_size > 1 and not inside_launcher()


def deepspeed_command(cfg: TrainConfig, worker_args: list[str]) -> list[str]:
    launch = cfg.launch
    runner = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    cmd = [runner, "--num_gpus", str(launch.gpus), "--master_port", str(launch.master_port)]
    if launch.hostfile is not None:
        cmd += [
            "--hostfile",
            launch.hostfile,
            "--num_nodes",
            str(launch.nodes),
            "--launcher",
            launch.launcher,
        ]
        if launch.master_addr:
            cmd += ["--master_addr", launch.master_addr]
    else:
        # No hostfile: single node on this machine (DeepSpeed refuses --num_nodes > 1 without one).
        cmd += ["--hostfile", os.devnull]
    # DeepSpeed's runner and launch.py log every spawn (INFO) and our /dev/null hostfile (WARNING);
    # a failing worker is still reported (ERROR). --debug (LLMTRAIN_DEBUG) brings the rest back.
    cmd += ["--log_level", "info" if debug_requested() else "error"]
    return [*cmd, "--no_local_rank", "--module", "llmtrain", *worker_args]


DEBUG_ENV = "LLMTRAIN_DEBUG"  # set by `llmtrain --debug`, inherited by the workers


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def quiet_worker_output() -> None:
    """Machine-readable worker output: no FutureWarning from DeepSpeed's use of deprecated torch
    collectives on every step, DeepSpeed's logger at WARNING (unless --debug)."""
    if debug_requested():
        return
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    from llmtrain.parallel.distributed import select_accelerator

    select_accelerator()  # before DeepSpeed's first import, which picks its accelerator
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def relaunch(cfg: TrainConfig, worker_args: list[str]) -> int:
    """Run the workers under DeepSpeed's launcher; returns its exit code."""
    cmd = deepspeed_command(cfg, worker_args)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    forward = _SignalForwarder(proc.pid)
    try:
        return proc.wait()
    finally:
        forward.restore()


class _SignalForwarder:
    """SIGINT / SIGTERM -> SIGTERM to the worker processes, leaving the launcher to see them exit 0."""

    def __init__(self, launcher_pid: int) -> None:
        self.launcher_pid = launcher_pid
        self.previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        import psutil

        try:
            children = psutil.Process(self.launcher_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        workers = [c for c in children if _is_worker(c)]
        for proc in workers or children:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _is_worker(proc: object) -> bool:
    try:
        cmdline = proc.cmdline()  # type: ignore[attr-defined]
    except Exception:
        return False
    return "llmtrain" in cmdline and "deepspeed.launcher.launch" not in " ".join(cmdline)


# ---------------------------------------------------------------- what `train` and `resume` run

# Keys a resume may change without breaking exactness: run length, cadences, logging, launch.
RESUME_MAY_CHANGE = (
    "train.steps",
    "train.tokens",
    "train.eval_every",
    "train.eval_batches",
    "train.micro_batch",
    "checkpoint.",
    "logging.",
    "launch.",
    "data.num_proc",
    "data.cache_dir",
    "stability.max_consecutive_skips",
)


def start_train(cfg: TrainConfig, resume_auto: bool) -> int:
    """`llmtrain train`: a fresh run (or, with --resume auto, a resume when a checkpoint exists)."""
    from llmtrain.run import rundir

    run_dir = Path(cfg.run_dir) if cfg.run_dir else rundir.default_run_dir(cfg)
    cfg.run_dir = str(run_dir)
    if resume_auto and rundir.has_checkpoints(run_dir):
        return start_resume(run_dir, None)
    if not _inside_launcher():
        rundir.refuse_fresh_run_over_checkpoints(run_dir)
    check_launch(cfg)
    check_inputs(cfg)
    # The global batch is fixed at the start, so a resume on another world size keeps it.
    cfg.train.global_batch = cfg.train.global_batch or cfg.train.micro_batch * _world_size(cfg)
    cfg.schedule.warmup_steps = cfg.warmup_steps
    existed = run_dir.exists()
    with _discard_new_run_dir_on_bad_input(run_dir, existed):
        if needs_relaunch(cfg):
            _write_config(run_dir, cfg)
            code = relaunch(cfg, ["train", "--config", str(run_dir / rundir.CONFIG_FILE)])
            if code == BAD_INPUT:  # the workers rejected their input and said why
                _discard_if_new(run_dir, existed)
            return code
        return _train_here(cfg, run_dir, resume=False)


BAD_INPUT = 2  # the CLI's exit code for bad input (ConfigError), also what the workers exit with


def check_inputs(cfg: TrainConfig) -> None:
    """Cheap checks of the files a run reads, before anything is created or launched."""
    from llmtrain.data import prepare, sources
    from llmtrain.data import tokenizer as toks

    source = cfg.data.source
    if source and not sources.is_hub_name(source) and not prepare.is_prepared_dir(source):
        files = sources.local_files(source, flag="--data")
        if all(path.stat().st_size == 0 for path in files):
            raise ConfigError(f"--data {source}: empty source (no text); point it at non-empty files")
    if cfg.data.tokenizer:
        tok = toks.load_tokenizer(cfg.data.tokenizer)
        prepare.check_vocab(toks.vocab_size(tok), cfg.model.vocab_size, f"--tokenizer {cfg.data.tokenizer}")


@contextlib.contextmanager
def _discard_new_run_dir_on_bad_input(run_dir: Path, existed: bool) -> Iterator[None]:
    """A run that never started because of bad input leaves no run directory a later command would
    take for a real run."""
    from llmtrain.checkpoint import CheckpointError

    try:
        yield
    except (ConfigError, CheckpointError):
        _discard_if_new(run_dir, existed)
        raise


def _discard_if_new(run_dir: Path, existed: bool) -> None:
    """Remove `run_dir` if this command created it and it holds no checkpoint."""
    from llmtrain.run import rundir

    if not existed and not rundir.has_checkpoints(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)


def start_resume(run_dir: Path, overrides: dict[str, object] | None) -> int:
    """`llmtrain resume RUN_DIR`: the saved config, with only the keys in RESUME_MAY_CHANGE changed."""
    from llmtrain import checkpoint
    from llmtrain import config as config_mod
    from llmtrain.run import rundir

    saved = load_saved_config(run_dir)
    cfg = saved
    if overrides:
        cfg = config_mod.resolve(run_dir / rundir.CONFIG_FILE, overrides["sets"], overrides["flags"])  # type: ignore[arg-type]
        refuse_breaking_changes(saved, cfg, run_dir)
    cfg.run_dir = str(run_dir)
    if not rundir.has_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir}: no checkpoint to resume from; start it with `llmtrain train --run-dir {run_dir}`"
        )
    # A `latest` that is no tag or leads outside the run is refused here, before any process starts.
    checkpoint.read_latest(rundir.checkpoint_root(run_dir))
    check_launch(cfg)
    if needs_relaunch(cfg):
        _write_config(run_dir, cfg)
        return relaunch(cfg, ["resume", str(run_dir)])
    return _train_here(cfg, run_dir, resume=True)


def load_saved_config(run_dir: Path) -> TrainConfig:
    from llmtrain import config as config_mod
    from llmtrain.run import rundir

    path = run_dir / rundir.CONFIG_FILE
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory; list runs with `llmtrain runs`")
    if not path.is_file():
        raise ConfigError(
            f"{run_dir}: not a run directory (no {rundir.CONFIG_FILE}); pass the RUN_DIR of a run"
        )
    return config_mod.load_run_config(path)


def refuse_breaking_changes(saved: TrainConfig, new: TrainConfig, run_dir: Path) -> None:
    from llmtrain.config import _flatten, to_dict

    old_flat, new_flat = _flatten(to_dict(saved)), _flatten(to_dict(new))
    changed = [k for k in new_flat if old_flat.get(k) != new_flat[k] and k != "run_dir"]
    breaking = [k for k in changed if not k.startswith(RESUME_MAY_CHANGE)]
    if breaking:
        diff = ", ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat[k]!r}" for k in breaking)
        raise ConfigError(
            f"resume {run_dir}: these changes would break an exact continuation: {diff}; "
            f"start a new run instead (only {', '.join(k.rstrip('.') for k in RESUME_MAY_CHANGE)} may change)"
        )


def _write_config(run_dir: Path, cfg: TrainConfig) -> None:
    from llmtrain.config import dump_yaml
    from llmtrain.run import rundir

    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_atomic(run_dir / rundir.CONFIG_FILE, dump_yaml(cfg))


def _world_size(cfg: TrainConfig) -> int:
    """The launcher's world size when inside one (torchrun --nnodes 2 runs `train --gpus 1` twice), else
    the one --gpus x --nodes asks for."""
    return int(os.environ["WORLD_SIZE"]) if _inside_launcher() else cfg.world_size


def _inside_launcher() -> bool:
    from llmtrain.parallel.distributed import inside_launcher

    return inside_launcher()


def _train_here(cfg: TrainConfig, run_dir: Path, resume: bool) -> int:
    from llmtrain.train import trainer

    quiet_worker_output()
    summary = trainer.run(cfg, run_dir, resume=resume)
    return 0 if summary is not None else 1
