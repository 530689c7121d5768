"""Prepare a run once, before any worker starts: resolve, check, apply the resume rules, derive, freeze.

`llmtrain train` and `llmtrain resume` prepare in the process the user started; under an outside
launcher (torchrun, Slurm's srun) every rank prepares and all reach the same result. What comes out is
frozen: `freeze` writes RUN_DIR/config.yaml (its one writer), and the workers DeepSpeed's launcher
starts (`llmtrain worker RUN_DIR`) read it back and derive nothing again.

    train:  flags -> config.resolve -> inputs checked -> derived numbers fixed -> PreparedRun
    resume: RUN_DIR/config.yaml (+ --config/--set/flags under RESUME_MAY_CHANGE) -> checked -> PreparedRun
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmtrain import config as config_mod
from llmtrain import precision, rundir
from llmtrain.config import ConfigError, TrainConfig, flag_for
from llmtrain.fsutil import write_atomic
from llmtrain.parallel.node import inside_launcher
from llmtrain.planning import rules
from llmtrain.planning.layout import check_resume
from llmtrain.run import nodes
from llmtrain.train import faults, schedule

# Keys a resume may change: run length, cadences, logging, launch, the tp and pp degrees (the
# checkpoint is re-partitioned, checkpoint.universal) and FSDP2's shard group (DCP reshards); losses
# continue within float rounding.
RESUME_MAY_CHANGE = (
    "parallel.tp",
    "parallel.pp",
    "parallel.dp_shard",
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


@dataclass(frozen=True)
class ConfigChanges:
    """What the user typed besides the verb: --config FILE, --set items, first-class flags."""

    config_file: Path | None
    sets: list[str]
    flags: dict[str, Any]

    @property
    def given(self) -> bool:
        return bool(self.config_file or self.sets or any(v is not None for v in self.flags.values()))


@dataclass(frozen=True)
class PreparedRun:
    cfg: TrainConfig
    run_dir: Path
    resume: bool
    new_dir: bool  # this command creates run_dir: a run refused for bad input removes it again


def prepare_train(cfg: TrainConfig, resume_auto: bool, made_dir: bool = False) -> PreparedRun:
    """`llmtrain train`: a fresh run (or, with --resume auto, a resume when a checkpoint exists).
    `made_dir`: the run directory's lock (run.lock) made the directory for this command."""
    run_dir = rundir.train_run_dir(cfg)
    if resume_auto and rundir.has_checkpoints(run_dir):
        return prepare_resume(run_dir, None)
    if not inside_launcher():
        rundir.refuse_fresh_run_over_checkpoints(run_dir)
    rundir.refuse_foreign_files(run_dir)
    check_launch(cfg)
    check_inputs(cfg)
    pin_init_source(cfg, run_dir)
    say_precision(derive(cfg))
    return PreparedRun(cfg, run_dir, resume=False, new_dir=made_dir or not run_dir.exists())


def prepare_resume(run_dir: Path, changes: ConfigChanges | None) -> PreparedRun:
    """`llmtrain resume RUN_DIR`: the saved config, with only the keys in RESUME_MAY_CHANGE changed."""
    from llmtrain import checkpoint

    saved = rundir.load_saved_config(run_dir)
    cfg = saved
    if changes is not None and changes.given:
        cfg = config_mod.resolve(changes.config_file, changes.sets, changes.flags, base=saved)
        refuse_breaking_changes(saved, cfg, run_dir)
    cfg.run_dir = str(run_dir)
    if not rundir.has_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir}: no checkpoint to resume from; start it with `llmtrain train --run-dir {run_dir}`"
        )
    # A `latest` that is no tag or leads outside the run is refused here, before any process starts.
    root = rundir.checkpoint_root(run_dir)
    checkpoint.read_latest(root)
    check_launch(cfg)
    newest = checkpoint.list_complete(root)
    if newest:
        layout = cfg.layout()
        was = checkpoint.saved_layout(newest[-1], layout)
        info = newest[-1]
        check_resume(
            layout, was, cfg.zero.stage, info.partitioned, cfg.model.num_key_value_heads, engine=info.engine
        )
    schedule.check_schedule(cfg)  # a new --steps must still hold the (frozen) warmup and decay
    return PreparedRun(cfg, run_dir, resume=True, new_dir=False)


def derive(cfg: TrainConfig) -> precision.Decision | None:
    """Fix the derived numbers in the config, so that a resume on another world size keeps them: the
    global batch (from the launcher's world size when inside one: torchrun --nnodes 2 runs
    `train --gpus 1` twice), the warmup, whether blocks are compiled and the precision `auto` stands for
    (measured on this machine: a resume, or a worker, never measures again); then check the schedule
    against the run's length. Returns the precision decision, None when the config named a precision."""
    world_size = int(os.environ["WORLD_SIZE"]) if inside_launcher() else cfg.world_size
    data_parallel = cfg.layout(world_size).dp
    cfg.train.global_batch = rules.batch_triple(cfg.train.micro_batch, cfg.train.global_batch, data_parallel)[
        0
    ]
    cfg.schedule.warmup_steps = cfg.warmup_steps
    cfg.train.compile = cfg.compiles  # a resumed run keeps its kernels, whatever its new --steps
    decided = precision.settle(cfg)
    schedule.check_schedule(cfg)
    return decided


def say_precision(decided: precision.Decision | None) -> None:
    """The one line that says what `--precision auto` chose and why, from the process that prepared
    (rank 0 under a launcher whose ranks each prepare)."""
    if decided is not None and int(os.environ.get("RANK", "0")) == 0:
        print(decided.line(), flush=True)


def freeze(prepared: PreparedRun) -> Callable[[], None]:
    """Write RUN_DIR/config.yaml, once, from the process that prepared (rank 0 under a launcher).
    Returns what undoes it (the replaced file put back, or the new one removed) for a run refused later."""
    if int(os.environ.get("RANK", "0")) != 0:
        return lambda: None
    path = prepared.run_dir / rundir.CONFIG_FILE
    previous = path.read_text() if path.is_file() else None
    rundir.write_config(prepared.run_dir, prepared.cfg)

    def undo() -> None:
        if previous is None:
            path.unlink(missing_ok=True)
        else:
            write_atomic(path, previous)

    return undo


def refuse_breaking_changes(
    saved: TrainConfig, new: TrainConfig, run_dir: Path, may_change: tuple[str, ...] = RESUME_MAY_CHANGE
) -> None:
    old_flat, new_flat = config_mod.flat_dict(saved), config_mod.flat_dict(new)
    changed = [k for k in new_flat if old_flat.get(k) != new_flat[k] and k != "run_dir"]
    breaking = [k for k in changed if not k.startswith(may_change)]
    if breaking:
        verb = "resume" if may_change == RESUME_MAY_CHANGE else "fork"
        diff = ", ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat[k]!r}" for k in breaking)
        raise ConfigError(
            f"{verb} {run_dir}: these changes would break an exact continuation: {diff}; "
            f"start a new run instead (only {_grouped(may_change)} may change)"
        )


def _grouped(keys: tuple[str, ...]) -> str:
    """`parallel.tp/pp, train.steps, checkpoint`: keys of one section joined after its name once."""
    sections: dict[str, list[str]] = {}
    for key in keys:
        section, _, name = key.rstrip(".").partition(".")
        sections.setdefault(section, []).append(name)
    return ", ".join(f"{s}.{'/'.join(names)}" if all(names) else s for s, names in sections.items())


# ---------------------------------------------------------------- inputs checked before anything starts


def check_inputs(cfg: TrainConfig) -> None:
    """Cheap checks of the files a run reads, before anything is created or launched."""
    from llmtrain.data import shards, sources
    from llmtrain.data import tokenizer as toks

    for source in [cfg.data.source, *(entry.source for entry in cfg.data.mixture or [])]:
        if source and not sources.is_hub_name(source) and not shards.is_prepared_dir(source):
            files = sources.local_files(source, flag="--data")
            if all(path.stat().st_size == 0 for path in files):
                raise ConfigError(f"--data {source}: empty source (no text); point it at non-empty files")
    if cfg.data.tokenizer:
        tok = toks.load_tokenizer(cfg.data.tokenizer)
        shards.check_vocab(toks.vocab_size(tok), cfg.model.vocab_size, f"--tokenizer {cfg.data.tokenizer}")
    faults.parse(os.environ.get(faults.ENV, ""))  # the reliability tests' fault plan, checked up front


def pin_init_source(cfg: TrainConfig, run_dir: Path) -> None:
    """Check `--init-from`'s weights before any worker starts, and pin a run source to the checkpoint
    step it resolves to (config.yaml then records exactly where the run started)."""
    if cfg.train.init_from is None:
        return
    from llmtrain import export, inference, init_source  # torch: only a run that starts from weights

    source = init_source.parse(cfg.train.init_from)
    if source.kind == "hf":
        init_source.check_hf_weights(source.path, export.expected_shapes(cfg.model))
        cfg.train.init_from = str(source.path)
        return
    if source.path == run_dir.resolve():
        raise ConfigError(
            f"{init_source.FLAG} {cfg.train.init_from}: is this run's own directory; give the new run "
            "a --run-dir of its own"
        )
    run = inference.open_run(source.path, source.checkpoint)
    cfg.train.init_from = f"{source.path}:{run.step}"


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
    if not inside_launcher():
        # This command starts the processes: it knows the nodes, and without a hostfile they run here,
        # on this machine's accelerator (a GPU-only feature on a CPU machine is refused now, not in
        # every worker). Under a launcher, the engine's config checks the nodes the job found.
        here = precision.this_accelerator() if launch.hostfile is None else None
        rules.check(replace(cfg.choice(here), nodes=launch.nodes))
    if launch.hostfile is not None:
        hosts = read_hostfile(launch.hostfile)
        if launch.nodes > len(hosts):
            raise ConfigError(
                f"{flag_for('launch.nodes')}: {launch.nodes} nodes asked for but {launch.hostfile} lists "
                f"{len(hosts)}; add hosts or lower --nodes"
            )
        if cfg.world_size > 1 and not inside_launcher():  # this process will start the runner
            nodes.check(launch, hosts)
    elif launch.nodes > 1:
        raise ConfigError(f"{flag_for('launch.nodes')}: {launch.nodes} nodes need --hostfile listing them")
