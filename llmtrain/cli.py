"""The `llmtrain` command line. Thin: parse, build the config, call one function.

The train flags are derived from the config tree (flags.FLAG_KEYS): each flag's help is its field's
help and its value is parsed by config.coerce, so a flag and `--set` can never disagree. Known errors
become one line `error: ...` with exit code 2 (bad input) or 1 (failure during a run); the traceback
appears only with `--debug`.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from llmtrain import __version__
from llmtrain import config as config_mod
from llmtrain.config import ConfigError
from llmtrain.errors import EXIT_BAD_INPUT, EXIT_RUN_FAILURE, BadInput, RunFailure
from llmtrain.flags import FLAG_KEYS, REPEATABLE_FLAGS
from llmtrain.fsutil import check_output_file

app = typer.Typer(
    name="llmtrain",
    help="Train Llama-style language models with DeepSpeed, from one CPU to a GPU cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(f"llmtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    _state["debug"] = debug
    if debug:
        os.environ["LLMTRAIN_DEBUG"] = "1"  # inherited by the workers a launcher starts


# ---------------------------------------------------------------- train flags, derived from the tree


def _flag_param(flag: str, key: str) -> inspect.Parameter:
    tp = config_mod.all_keys()[key]
    help_text = config_mod.key_help()[key]
    name = flag.lstrip("-").replace("-", "_")
    if config_mod.base_type(tp) is bool:
        option = typer.Option(f"{flag}/--no-{flag[2:]}", help=help_text, show_default=False)
        annotation: Any = Annotated[bool | None, option]
    elif flag in REPEATABLE_FLAGS:
        metavar = config_mod.type_name(tp).replace(" or none", "").upper().replace(" ", "")
        help_text += REPEATABLE_FLAGS[flag]
        option = typer.Option(flag, help=help_text, metavar=metavar, show_default=False)
        annotation = Annotated[list[str] | None, option]
    else:
        metavar = config_mod.type_name(tp).replace(" or none", "").upper().replace(" ", "")
        option = typer.Option(flag, help=help_text, metavar=metavar, show_default=False)
        annotation = Annotated[str | None, option]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def _common_params() -> list[inspect.Parameter]:
    config_file = Annotated[
        Path | None,
        typer.Option("--config", help="YAML config file (sections as in `llmtrain config --list-keys`)."),
    ]
    sets = Annotated[
        list[str] | None,
        typer.Option("--set", help="Override any key: --set section.key=value (repeatable)."),
    ]
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("config_file", kw, default=None, annotation=config_file),
        inspect.Parameter("set_", kw, default=None, annotation=sets),
    ]


def with_train_flags(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add `--config`, `--set` and every first-class train flag; call `func(cfg_args, **rest)`.

    `cfg_args` is a dict for config.resolve: config_file, sets, flags (key -> raw string).
    """
    return _with_flags(func, tuple(FLAG_KEYS))


def with_flags(*flags: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like with_train_flags, with only the first-class flags that matter to the verb."""
    return lambda func: _with_flags(func, flags)


def _with_flags(func: Callable[..., Any], wanted: tuple[str, ...]) -> Callable[..., Any]:
    # Evaluate the verb's own (string, postponed) annotations: a preset __signature__ is taken as is, so
    # typer would otherwise never see their Annotated[..., typer.Option(...)] names and help.
    hints = typing.get_type_hints(func, include_extras=True)
    own = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(func).parameters.values()
    ][1:]
    taken = {p.name for p in own}  # e.g. resume's RUN_DIR argument replaces --run-dir
    flag_params = [p for p in (_flag_param(flag, FLAG_KEYS[flag]) for flag in wanted) if p.name not in taken]
    names = {p.name: FLAG_KEYS[f"--{p.name.replace('_', '-')}"] for p in flag_params}

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        flags = {names[n]: kwargs.pop(n) for n in list(kwargs) if n in names}
        flags = {key: None if value == [] else value for key, value in flags.items()}  # unused, repeatable
        cfg_args = {
            "config_file": kwargs.pop("config_file"),
            "sets": kwargs.pop("set_") or [],
            "flags": flags,
        }
        return func(cfg_args, **kwargs)

    wrapper.__signature__ = inspect.Signature(own + _common_params() + flag_params)  # type: ignore[attr-defined]
    return wrapper


def resolve_config(cfg_args: dict[str, Any]) -> config_mod.TrainConfig:
    return config_mod.resolve(cfg_args["config_file"], cfg_args["sets"], cfg_args["flags"])


# ---------------------------------------------------------------- verbs


@app.command("config")
@with_train_flags
def config_cmd(
    cfg_args: dict[str, Any],
    out: Annotated[Path | None, typer.Option("--out", help="Write the JSON here instead of stdout.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", help="World size to derive the batch triple for (default --gpus x --nodes)."
        ),
    ] = None,
    resolved: Annotated[
        bool, typer.Option("--resolved", help="Print the resolved llmtrain YAML instead.")
    ] = False,
    list_keys: Annotated[
        bool, typer.Option("--list-keys", help="List every config key with its help.")
    ] = False,
) -> None:
    """Print the DeepSpeed JSON config the flags produce (what `train` would hand to DeepSpeed), or
    under --engine fsdp2 the FSDP2 plan (units, policies, optimizer, batch)."""
    if list_keys:
        _print_keys()
        return
    if out is not None:
        check_output_file(out, "--out", force)
    cfg = resolve_config(cfg_args)
    if resolved:
        _emit(config_mod.dump_yaml(cfg), out)
        return
    world = world_size if world_size is not None else cfg.world_size
    if world < 1:
        raise ConfigError(f"--world-size: must be at least 1, got {world}")
    settings = _engine_settings(cfg, world)
    _emit(json.dumps(settings, indent=2) + "\n", out)
    if cfg.train.engine != "fsdp2":
        _describe_layout(cfg, world, settings)


def _engine_settings(cfg: config_mod.TrainConfig, world: int) -> dict[str, Any]:
    """What `train` would build its engine from: FSDP2's plan, or DeepSpeed's config dict."""
    if cfg.train.engine == "fsdp2":
        from llmtrain.planning import fsdp2_plan

        return fsdp2_plan.build(cfg, world)
    from llmtrain.parallel.accelerator import select_accelerator
    from llmtrain.planning import dsconfig

    return dsconfig.build(cfg, world, accelerator=select_accelerator())


def _describe_layout(cfg: config_mod.TrainConfig, world: int, ds: dict[str, Any]) -> None:
    """The tp/sp/pp layout and a pipeline's bubble, on stderr: stdout stays the JSON alone."""
    from llmtrain.planning.stages import bubble_fraction

    layout = cfg.layout(world)
    if layout.model_parallel > 1:
        typer.echo(f"layout: {layout.describe()} over {world} processes; {layout.groups()}", err=True)
    if layout.pp > 1:
        m = ds["gradient_accumulation_steps"]
        typer.echo(
            f"pipeline: {m} micro-batch(es) per step through {layout.pp} stages ({cfg.parallel.pp_schedule}), "
            f"bubble {bubble_fraction(layout.pp, m):.0%} of each step (more micro-batches: raise --global-batch)",
            err=True,
        )


def _print_keys() -> None:
    keys, helps = config_mod.all_keys(), config_mod.key_help()
    for key in keys:
        flag = config_mod.flag_for(key)
        via = f" ({flag})" if not flag.startswith("--set") else ""
        print(
            f"{key}{via}: {config_mod.type_name(keys[key])} = {config_mod.get(config_mod.TrainConfig(), key)!r}"
        )
        print(f"    {helps[key]}")


def _emit(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
        return
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"--out {out}: cannot write it ({exc.strerror}); pass a path in an existing, writable directory"
        ) from None
    print(f"wrote {out}", file=sys.stderr)


def _size_option(flag: str, help_text: str) -> Any:
    return typer.Option(flag, help=help_text, metavar="SIZE", show_default=False)


def _shape_option(flag: str, help_text: str) -> Any:
    return typer.Option(flag, help=f"Raw model shape: {help_text}.", show_default=False)


# What a run's memory and speed depend on: the flags estimate-memory and plan take from train's.
SIZING_FLAGS = (
    "--preset",
    "--engine",
    "--zero",
    "--offload",
    "--nvme-path",
    "--shard-within-node",
    "--quantize-weights",
    "--quantize-grads",
    "--tp",
    "--sp",
    "--pp",
    "--dp-shard",
    "--pp-schedule",
    "--pp-partition",
    "--precision",
    "--micro-batch",
    "--global-batch",
    "--seq-len",
    "--activation-checkpointing",
    "--partition-activations",
    "--cpu-checkpointing",
    "--gpus",
    "--nodes",
)


@app.command("estimate-memory")
@with_flags(*SIZING_FLAGS)
def estimate_memory_cmd(
    cfg_args: dict[str, Any],
    params: Annotated[
        str | None,
        typer.Option(
            "--params", help="Parameter count, e.g. 7e9 (alone: model states only).", show_default=False
        ),
    ] = None,
    hidden_size: Annotated[int | None, _shape_option("--hidden-size", "model width")] = None,
    layers: Annotated[int | None, _shape_option("--layers", "transformer blocks")] = None,
    heads: Annotated[int | None, _shape_option("--heads", "query heads")] = None,
    kv_heads: Annotated[int | None, _shape_option("--kv-heads", "key/value heads (default --heads)")] = None,
    intermediate_size: Annotated[
        int | None, _shape_option("--intermediate-size", "SwiGLU width (default 8/3 x hidden)")
    ] = None,
    vocab_size: Annotated[int | None, _shape_option("--vocab-size", "vocabulary (default 32000)")] = None,
    gpu_memory: Annotated[
        str | None, _size_option("--gpu-memory", "Memory per GPU (80GB, 24GiB): verdict + what fits.")
    ] = None,
    cpu_memory: Annotated[str | None, _size_option("--cpu-memory", "CPU memory per node (512GB).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the numbers (bytes) as JSON.")] = False,
) -> None:
    """Per-GPU and per-node memory of a configuration, term by term, and which configurations fit."""
    from llmtrain.planning import memory

    shape = {
        "--hidden-size": hidden_size,
        "--layers": layers,
        "--heads": heads,
        "--kv-heads": kv_heads,
        "--intermediate-size": intermediate_size,
        "--vocab-size": vocab_size,
    }
    gpu_bytes = memory.parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    cpu_bytes = memory.parse_size(cpu_memory, "--cpu-memory") if cpu_memory is not None else None
    setup = memory.resolve_setup(
        cfg_args["config_file"], cfg_args["sets"], cfg_args["flags"], params=params, shape=shape
    )
    doc = memory.report(memory.estimate(setup), gpu_bytes, cpu_bytes)
    if json_out:
        print(json.dumps(doc, indent=2))
    else:
        memory.render(doc)


@app.command("plan")
@with_flags(*SIZING_FLAGS, "--init-from")
def plan_cmd(
    cfg_args: dict[str, Any],
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", help="A built-in device and its 8-GPU node: a100-40gb, a100-80gb, h100, h200."),
    ] = None,
    cluster_file: Annotated[
        Path | None,
        typer.Option("--cluster", help="A YAML file describing your cluster (base: h100, nodes: 4, ...)."),
    ] = None,
    calibrate: Annotated[
        Path | None,
        typer.Option(
            "--calibrate",
            metavar="FILE",
            help="Measure this machine instead (matmuls, memory, all-reduce, CPU Adam; --gpus processes side "
            "by side) and write it as a cluster file for --cluster.",
        ),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="How many layouts to print.", min=1)] = 5,
    confirm: Annotated[
        int,
        typer.Option(
            "--confirm",
            metavar="K",
            min=0,
            help="Run the first K layouts here for --confirm-steps steps each and print measured beside "
            "predicted step time.",
        ),
    ] = 0,
    confirm_steps: Annotated[
        int,
        typer.Option("--confirm-steps", min=3, help="Steps of each --confirm run (the first 2 not timed)."),
    ] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="Print the rows, term by term, as JSON.")] = False,
) -> None:
    """Which layout, and how fast: every layout that fits, ranked by predicted tokens/s. Flags such as
    --zero or --tp pin that part of the layout; --gpus and --nodes default to the cluster's."""
    from llmtrain.planning import hardware, plan, report
    from llmtrain.units import human

    if calibrate is not None:
        if gpu is not None or cluster_file is not None:
            raise ConfigError("--calibrate: measures this machine; give it without --gpu and --cluster")
        _calibrate(calibrate, cfg_args["flags"].get("launch.gpus"))
        return
    if (gpu is None) == (cluster_file is None):
        raise ConfigError("--gpu: give a built-in device (--gpu h100) or --cluster FILE, one of them")
    cluster = hardware.load_cluster(cluster_file) if cluster_file else hardware.builtin_cluster(str(gpu))
    setup, cluster, pinned = _plan_request(cfg_args, cluster)
    rows = plan.plan(setup, cluster, pinned)
    if not rows:
        raise ConfigError(
            f"no layout fits {setup.world_size} x {cluster.device.name} "
            f"({human(cluster.device.memory_bytes)} each); smallest change that fits: "
            f"{plan.smallest_change(setup, cluster, pinned)}"
        )
    doc = report.document(rows, cluster, max(top, confirm), cfg_args)
    if confirm:
        from llmtrain.run.confirm import confirm as run_layouts

        measured = run_layouts(doc["rows"][:confirm], confirm_steps, setup.cfg.tokens_per_step)
        report.add_measured(doc, [m.step_seconds for m in measured], [m.peak_memory_bytes for m in measured])
    if json_out:
        print(json.dumps(doc, indent=2))
        return
    c = setup.cfg
    model = c.preset if c.train.init_from is None else c.train.init_from
    report.render(
        doc,
        f"{model}: global batch {c.global_batch} x {c.train.seq_len} tokens, {setup.precision}, "
        f"{c.launch.gpus} x {cluster.device.name} per node x {c.launch.nodes} node(s)",
    )
    if confirm:
        report.render_confirmed(doc)


def _plan_request(cfg_args: dict[str, Any], cluster: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(Setup, the cluster at the request's node count, the layout keys the user pinned). The request
    as a config: the cluster's node size and count unless given, and one sample per micro-batch unless
    pinned (any global batch resolves; the plan chooses the micro-batch)."""
    from llmtrain.planning import memory, plan

    given = {key for key, value in cfg_args["flags"].items() if value is not None}
    given |= set(config_mod.parse_set(cfg_args["sets"]))
    defaults = {
        "launch.gpus": cluster.devices_per_node,
        "launch.nodes": cluster.nodes,
        "train.micro_batch": 1,
        # Searched unless pinned; a stage every engine runs, so `--engine fsdp2` alone plans.
        "zero.stage": 3,
    }
    flags = {key: value for key, value in cfg_args["flags"].items() if value is not None}
    request = {**cfg_args, "flags": {**{k: str(v) for k, v in defaults.items() if k not in given}, **flags}}
    setup = memory.setup_from_config(resolve_config(request))
    cluster = cluster.with_size(nodes=setup.cfg.launch.nodes)
    plan.check_request(setup, cluster)
    return setup, cluster, {key: config_mod.get(setup.cfg, key) for key in plan.LAYOUT_KEYS if key in given}


def _calibrate(path: Path, gpus: str | None) -> None:
    """Measure this machine in --gpus processes (default: its CUDA devices, else its cores) and write
    the cluster file."""
    from llmtrain import calibrate, rundir
    from llmtrain.parallel.accelerator import select_accelerator
    from llmtrain.parallel.distributed import usable_cores

    check_output_file(path, "--calibrate", force=False)
    accelerator = select_accelerator()
    devices = int(gpus) if gpus else _local_devices(accelerator)
    if devices < 1:
        raise ConfigError(f"--gpus: must be at least 1, got {devices}")
    ranks = calibrate.measure(devices, ("fp32", "bf16"))
    facts = rundir.machine_facts()
    name = _device_name(accelerator, facts)
    cores = 0 if accelerator == "cuda" else usable_cores()
    doc = calibrate.cluster_document(ranks, devices, name, calibrate.memory_per_rank(devices), cores)
    calibrate.write_cluster(path, doc, f"{name}, {devices} process(es), commit {facts['git_sha']}")
    peaks = ", ".join(f"{p} {v / 1e9:,.1f} GFLOP/s" for p, v in doc["device"]["peak_flops"].items())
    print(
        f"wrote {path}: {devices} x {name}: {peaks}, memory {doc['device']['memory_bandwidth'] / 1e9:.1f} GB/s, "
        f"all-reduce {doc['intra_node_bandwidth'] / 1e9:.2f} GB/s, CPU Adam {doc['cpu_adam_rate'] / 1e6:.0f}M params/s"
    )
    print(f"plan with it: llmtrain plan --cluster {path} --preset ... --precision ...")


def _local_devices(accelerator: str) -> int:
    import torch

    return torch.cuda.device_count() if accelerator == "cuda" else (os.cpu_count() or 1)


def _device_name(accelerator: str, facts: dict[str, Any]) -> str:
    if accelerator == "cuda":
        import torch

        return str(torch.cuda.get_device_name(0))
    return f"{facts['cpu_model'] or 'CPU'} (a process's share)"


def _lock_wait_option(default: str) -> Any:
    help_text = f"Seconds to wait for another llmtrain process using the run directory to end ({default})."
    return typer.Option("--lock-wait", help=help_text, metavar="SECONDS", show_default=False)


@app.command("train")
@with_train_flags
def train_cmd(
    cfg_args: dict[str, Any],
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume", help="`auto`: resume when the run directory holds a checkpoint, else start."
        ),
    ] = None,
    lock_wait: Annotated[float | None, _lock_wait_option("default 0; 120 with --resume auto")] = None,
    sbatch: Annotated[
        Path | None,
        typer.Option(
            "--sbatch",
            metavar="FILE",
            help="Write the Slurm batch script for this run (--nodes x --gpus tasks, requeued on "
            "preemption, saved before the time limit, resumed with --resume auto) instead of training.",
        ),
    ] = None,
) -> None:
    """Train a model: DeepSpeed config from the flags, Llama model, checkpoints, LR schedule."""
    from llmtrain import rundir
    from llmtrain.run import lock

    if resume not in (None, "auto"):
        raise ConfigError(
            f"--resume: only `auto` is accepted, got {resume!r}; to resume a run use `llmtrain resume RUN_DIR`"
        )
    if sbatch is not None:
        _write_sbatch(cfg_args, sbatch)
        return
    _join_job(cfg_args["flags"])
    resume_auto = resume == "auto"
    wait_s = lock.wait_seconds(lock_wait, resume_auto)
    cfg = resolve_config(cfg_args)
    run_dir = rundir.train_run_dir(cfg)
    # The lock before anything is written and before --resume auto decides; torch is imported after it.
    with lock.hold(run_dir, f"--run-dir {run_dir}", wait_s, create=True) as held:
        from llmtrain.run import launch, prepare

        code = held.note(launch.start(prepare.prepare_train(cfg, resume_auto, made_dir=held.made_dir)))
    _exit_with(code)


def _join_job(flags: dict[str, Any]) -> None:
    """Under srun, this task's rank variables (run.slurm), before the lock. A rank of a job trains: its
    stop requests are kept from now on (train.stopping), through the lock, the imports and the start."""
    from llmtrain.parallel import node
    from llmtrain.run import slurm
    from llmtrain.train import stopping

    slurm.adopt_step(flags)
    if node.inside_launcher():
        stopping.listen()


def _write_sbatch(cfg_args: dict[str, Any], path: Path) -> None:
    from llmtrain import rundir
    from llmtrain.fsutil import write_atomic
    from llmtrain.run import nodes, slurm

    slurm.check_script_path(path)
    cfg = resolve_config(cfg_args)
    slurm.check_job_launch(cfg.launch)
    run_dir = rundir.train_run_dir(cfg).resolve()
    # The job's nodes, not this login node, have the GPUs: asked for unless DS_ACCELERATOR=cpu says not.
    gpus = os.environ.get("DS_ACCELERATOR") != "cpu"
    script = slurm.batch_script(
        slurm.train_arguments(cfg_args, run_dir, _state["debug"]),
        nodes=cfg.launch.nodes,
        tasks_per_node=cfg.launch.gpus,
        gpus=gpus,
        run_dir=run_dir,
        output=path.resolve().with_name(f"{path.stem}-%j.out"),
        env=nodes.forwarded_environment(dict(os.environ), []),
    )
    write_atomic(path, script)
    path.chmod(0o755)
    print(
        f"wrote {path}: {slurm.job_shape(cfg.launch.nodes, cfg.launch.gpus)}, requeued on preemption, "
        f"saved {slurm.SIGNAL_BEFORE_LIMIT_S} s before the time limit, into {run_dir}"
    )
    if gpus:
        print(f"each task has a GPU of its own (#SBATCH --gpus-per-node={cfg.launch.gpus})")
    print(f"submit it with: sbatch {path}  (add --time, --partition, --account as your cluster asks)")


@app.command("resume")
@with_train_flags
def resume_cmd(
    cfg_args: dict[str, Any],
    run_dir: Annotated[Path, typer.Argument(help="The run directory to continue.", show_default=False)],
    strict: Annotated[
        bool, typer.Option("--strict", help="Refuse a corrupt checkpoint instead of falling back.")
    ] = False,
    lock_wait: Annotated[float | None, _lock_wait_option("default 0")] = None,
) -> None:
    """Continue a run exactly where its last complete checkpoint stopped (same data, LR, loss curve).

    --config, --set and flags change the saved config where that keeps the continuation exact (run
    length, cadences, logging, launch) or re-partitions the checkpoint (--gpus, --nodes, --tp, --pp); any
    other change is refused."""
    from llmtrain.run import lock

    _join_job(cfg_args["flags"])
    if strict:
        cfg_args["sets"] = [*cfg_args["sets"], "checkpoint.strict=true"]
    wait_s = lock.wait_seconds(lock_wait, resume_auto=False)
    with lock.hold(run_dir, f"resume {run_dir}", wait_s, create=False) as held:
        from llmtrain.run import launch, prepare

        changes = prepare.ConfigChanges(cfg_args["config_file"], cfg_args["sets"], cfg_args["flags"])
        code = held.note(launch.start(prepare.prepare_resume(run_dir, changes)))
    _exit_with(code)


@app.command("fork")
@with_train_flags
def fork_cmd(
    cfg_args: dict[str, Any],
    parent: Annotated[
        Path, typer.Argument(help="The run to fork (only read).", metavar="RUN_DIR", show_default=False)
    ],
    step: Annotated[
        str,
        typer.Option(
            "--step", help="The checkpoint to start from: its step number or tag.", show_default=False
        ),
    ],
    lock_wait: Annotated[float | None, _lock_wait_option("default 0")] = None,
) -> None:
    """Start a new run (--run-dir NEW) from RUN_DIR's checkpoint at --step with its whole state:
    weights, optimizer, data position, counters. The config may change what a fork is for (the
    schedule, e.g. a WSD cooldown from here: --steps N+K --set schedule.decay_steps=K, and the run's
    length) and what a resume may change; RUN_DIR is left as it is."""
    from llmtrain.run import lock

    _join_job(cfg_args["flags"])
    new_dir = cfg_args["flags"].pop("run_dir", None)
    if new_dir is None:
        raise ConfigError(f"fork {parent}: give the new run's directory with --run-dir NEW")
    new_dir = Path(new_dir)
    wait_s = lock.wait_seconds(lock_wait, resume_auto=False)
    with lock.hold(new_dir, f"--run-dir {new_dir}", wait_s, create=True) as held:
        from llmtrain.run import fork, launch, prepare

        changes = prepare.ConfigChanges(cfg_args["config_file"], cfg_args["sets"], cfg_args["flags"])
        prepared = fork.prepare_fork(parent, step, new_dir, changes)  # refusals come before any write
        try:
            code = held.note(launch.start(prepared))
        except BadInput:
            fork.discard(new_dir, made=held.made_dir)
            raise
        if code == EXIT_BAD_INPUT:  # the workers refused it and said why
            fork.discard(new_dir, made=held.made_dir)
    _exit_with(code)


@app.command("worker", hidden=True)
def worker_cmd(
    run_dir: Annotated[Path, typer.Argument(help="The prepared run directory.")],
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")] = False,
    launch_env: Annotated[
        Path | None, typer.Option("--launch-env", help="The launch's environment (a hostfile launch).")
    ] = None,
) -> None:
    """One worker of a run prepared by `train` or `resume` (started by DeepSpeed's launcher)."""
    from llmtrain.train import stopping

    stopping.listen()  # a stop request while the worker starts is kept (train.stopping)
    if launch_env is not None:
        from llmtrain.run import nodes

        nodes.adopt_launch_environment(launch_env)  # before anything imports torch or DeepSpeed
    from llmtrain import rundir
    from llmtrain.run import launch

    _exit_with(launch.train_here(rundir.load_saved_config(run_dir), run_dir, resume))


def _exit_with(code: int) -> None:
    if code:
        raise typer.Exit(code)


# ---------------------------------------------------------------- using a run: generate, eval, export, runs, plot

_SOURCE_HELP_EVAL = (
    "A text source (as for prepare-data) or a prepared directory, read with the run's tokenizer."
)
_RUN_DIR_ARG = typer.Argument(
    help="A run directory (holds config.yaml and checkpoints/).", metavar="RUN_DIR", show_default=False
)
_CHECKPOINT_OPT = typer.Option(
    "--checkpoint",
    "--step",
    help="Checkpoint tag (step_00000100) or step number; default the latest complete one.",
    show_default=False,
)


@app.command("generate")
def generate_cmd(
    run_dir: Annotated[Path, _RUN_DIR_ARG],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.", show_default=False)],
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most new tokens to sample.")] = 100,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Sampling temperature; 0 = greedy (most likely token).")
    ] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler.")] = 0,
    checkpoint: Annotated[str | None, _CHECKPOINT_OPT] = None,
) -> None:
    """Sample a continuation of --prompt from a run's checkpoint (single process, any ZeRO stage)."""
    from llmtrain.inference import check_sampling, generate_text

    check_sampling(max_tokens, temperature, top_k)
    text = generate_text(
        run_dir,
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        checkpoint=checkpoint,
    )
    print(text)


@app.command("eval")
def eval_cmd(
    run_dir: Annotated[Path, _RUN_DIR_ARG],
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help=f"{_SOURCE_HELP_EVAL} Default: the run's validation split.",
            show_default=False,
        ),
    ] = None,
    batches: Annotated[
        int | None,
        typer.Option(
            "--batches",
            help="Micro-batches to evaluate; default those of training-time evaluation (or all of --data).",
            show_default=False,
        ),
    ] = None,
    checkpoint: Annotated[str | None, _CHECKPOINT_OPT] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.")] = False,
) -> None:
    """Loss and perplexity of a run's checkpoint on its validation split or on another source."""
    from llmtrain.inference import evaluate_run

    result = evaluate_run(run_dir, data=data, batches=batches, checkpoint=checkpoint)
    if json_out:
        print(json.dumps(result))
        return
    print(
        f"{result['checkpoint']} on {result['data']} ({result['split']} split): val_loss {result['val_loss']:.4f} "
        f"val_ppl {result['val_ppl']:.2f} over {result['tokens']:,} tokens"
    )


@app.command("export")
def export_cmd(
    run_dir: Annotated[Path, _RUN_DIR_ARG],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the Hugging Face model.", show_default=False)
    ],
    checkpoint: Annotated[str | None, _CHECKPOINT_OPT] = None,
) -> None:
    """Write a Hugging Face model directory (model.safetensors, config.json, tokenizer) from a checkpoint."""
    from llmtrain.inference import export_run

    print(f"exported {export_run(run_dir, out, checkpoint)}")


@app.command("runs")
def runs_cmd(
    directory: Annotated[
        Path, typer.Argument(help="A directory of runs, or one run directory to list its checkpoints.")
    ] = Path("runs"),
    json_out: Annotated[bool, typer.Option("--json", help="Print the listing as JSON.")] = False,
) -> None:
    """List runs (steps, latest checkpoint, losses), or one run's checkpoints (size, verified)."""
    from llmtrain import runs

    doc = runs.listing(directory)
    if json_out:
        print(json.dumps(doc, indent=2))
    else:
        runs.render(doc)


@app.command("plot")
def plot_cmd(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="One or more run directories, drawn together.", metavar="RUN_DIR", show_default=False
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="The PNG to write; default RUN_DIR/curves.png for one run, curves.png here for several.",
            show_default=False,
        ),
    ] = None,
    x: Annotated[
        str | None, typer.Option("--x", help="The x axis: step (default) or tokens (cumulative).")
    ] = None,
    text: Annotated[
        bool, typer.Option("--text", help="No PNG: print each run's loss as a sparkline and its numbers.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
) -> None:
    """Loss curves of runs from their metrics.jsonl: loss (and validation loss), learning rate, gradient
    norm and tokens/s, one colour per run."""
    from llmtrain.train import plot

    if text:
        for flag, given in (("--out", out is not None), ("--x", x is not None), ("--force", force)):
            if given:
                raise ConfigError(f"{flag}: --text prints and draws no PNG; drop {flag} or --text")
        print(plot.text_report(run_dirs))
        return
    print(f"wrote {plot.plot_runs(run_dirs, out, x or 'step', force)}")


# ---------------------------------------------------------------- data verbs

tokenizer_app = typer.Typer(help="Train tokenizers.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")
_SOURCE_HELP = "Text source: file, directory, glob, save_to_disk directory or Hugging Face Hub dataset name."


@tokenizer_app.command("train")
def tokenizer_train_cmd(
    source: Annotated[str, typer.Argument(help=_SOURCE_HELP)],
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Tokens in the vocabulary.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write tokenizer.json.")],
    text_field: Annotated[str, typer.Option("--text-field", help="Field holding the text.")] = "text",
    hub_config: Annotated[str | None, typer.Option("--hub-config", help="Hub dataset config.")] = None,
    streaming: Annotated[bool, typer.Option("--streaming", help="Stream a Hub dataset.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
) -> None:
    """Train a byte-level BPE tokenizer (special tokens <|endoftext|> and <|pad|>) on a source."""
    from llmtrain.data.tokenizer import train_tokenizer_from_source

    check_output_file(out, "--out", force)

    print(
        train_tokenizer_from_source(
            source, vocab_size, out, text_field=text_field, hub_config=hub_config, streaming=streaming
        )
    )


@app.command("prepare-data")
def prepare_data_cmd(
    source: Annotated[str, typer.Argument(help=_SOURCE_HELP)],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", help="tokenizer.json or a Hugging Face tokenizer directory.")
    ],
    out: Annotated[str, typer.Option("--out", help="Directory for the token shards and manifest.json.")],
    text_field: Annotated[str, typer.Option("--text-field", help="Field holding the text.")] = "text",
    val_fraction: Annotated[
        float, typer.Option("--val-fraction", help="Fraction of documents held out.")
    ] = 0.02,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the train/validation split.")] = 1234,
    num_proc: Annotated[int, typer.Option("--num-proc", help="Tokenization processes.")] = 2,
    dtype: Annotated[str, typer.Option("--dtype", help="Token dtype: auto, uint16 or uint32.")] = "auto",
    hub_config: Annotated[str | None, typer.Option("--hub-config", help="Hub dataset config.")] = None,
    streaming: Annotated[bool, typer.Option("--streaming", help="Stream a Hub dataset.")] = False,
) -> None:
    """Tokenize a source into memory-mapped token shards plus manifest.json (then `train --data DIR`)."""
    from llmtrain.data.prepare import prepare_data, summary

    if num_proc < 1:
        raise ConfigError(f"--num-proc {num_proc}: must be at least 1")
    manifest = prepare_data(
        source,
        tokenizer,
        out,
        text_field=text_field,
        hub_config=hub_config,
        streaming=streaming,
        val_fraction=val_fraction,
        split_seed=seed,
        num_proc=num_proc,
        dtype=dtype,
    )
    print(summary(out, manifest))


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Console entry point: runs the app and turns known errors into one line and an exit code."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="llmtrain", standalone_mode=False)
        return int(result) if isinstance(result, int) else 0
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # typer's usage errors (it vendors click: no `click` import here)
        return _fail(exc, EXIT_BAD_INPUT, _usage_message(exc))
    except BadInput as exc:
        return _fail(exc, EXIT_BAD_INPUT, str(exc))
    except RunFailure as exc:
        return _fail(exc, EXIT_RUN_FAILURE, str(exc))
    except KeyboardInterrupt as exc:
        return _fail(exc, 130, "interrupted")


def _usage_message(exc: typer.TyperException) -> str:
    message = exc.format_message().replace("\n", " ")
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        message += f"; see `{ctx.command_path} --help`"
    return message


def _fail(exc: BaseException, code: int, message: str) -> int:
    if _state["debug"] or "--debug" in sys.argv:
        import traceback

        traceback.print_exception(exc)
    # One write call: print() writes the text and its newline separately, and under `python -u` (as
    # DeepSpeed starts the workers) every rank's stderr is one pipe, so two ranks' lines could interleave
    # as "error: ... error: ...\n\n" (seen in the failed-save test).
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return code


def run() -> None:
    sys.exit(main())
