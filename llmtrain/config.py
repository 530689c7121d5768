"""One typed configuration tree for everything a run needs.

Layers, lowest first: field defaults < the preset's model shape < `--config FILE` < `--set key=value`
< first-class flags. `resolve()` applies them and validates once; every error is a `ConfigError`
whose message names the flag (or key) and how to fix it. Derived numbers (world size, gradient
accumulation, tokens per step, total steps) are functions below, never fields a user could contradict.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from llmtrain import init_source
from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for
from llmtrain.planning import rules
from llmtrain.planning.layout import Layout, check_shape, fsdp_mesh
from llmtrain.presets import DEFAULT_PRESET, PRESETS
from llmtrain.units import parse_bytes


def _f(default: Any, help: str) -> Any:
    """A dataclass field whose help text becomes the `--set` documentation."""
    return field(default=default, metadata={"help": help})


# auto: bf16 where the GPU or CPU computes it natively, else fp32; llmtrain.precision decides it when a
# run is prepared, and config.yaml records the concrete value.
Precision = Literal["auto", "bf16", "fp16", "fp32"]
Offload = Literal["none", "cpu", "nvme"]
Checkpointing = Literal["none", "full", "selective"]
PipeSchedule = Literal["1f1b", "gpipe"]
PipePartition = Literal["parameters", "blocks"]
EngineName = Literal["deepspeed", "fsdp2"]
RopeScaling = Literal["none", "linear", "llama3"]
# A byte count, written as bytes or with a unit (50e9, 500MB, 2GiB); stored as an int.
ByteSize = typing.NewType("ByteSize", int)
# Runs this long compile their blocks by default (TrainConfig.compiles): torch.compile's warm-up is paid
# back within the first few dozen steps, and a short experiment starts at once.
COMPILE_MIN_STEPS = 200


@dataclass
class ModelConfig:
    """Model shape, with Hugging Face LlamaConfig names. Filled from the preset, then overridden."""

    vocab_size: int = _f(8192, "vocabulary size (at least the tokenizer's)")
    hidden_size: int = _f(256, "model width")
    intermediate_size: int = _f(704, "SwiGLU MLP width")
    num_hidden_layers: int = _f(8, "number of transformer blocks")
    num_attention_heads: int = _f(8, "query heads")
    num_key_value_heads: int = _f(4, "key/value heads (grouped-query attention); equal to heads for MHA")
    head_dim: int | None = _f(None, "width of one attention head; none = hidden_size / num_attention_heads")
    max_position_embeddings: int = _f(1024, "longest sequence the model is built for")
    rope_theta: float = _f(10000.0, "rotary embedding base")
    # Hugging Face's `rope_scaling` dict, one key each (the config tree holds scalars).
    rope_scaling_type: RopeScaling = _f(
        "none", "RoPE frequency scaling: none, linear (positions / factor) or llama3 (Llama 3.1's)"
    )
    rope_scaling_factor: float = _f(1.0, "linear and llama3 scaling: the context extension factor")
    rope_scaling_low_freq_factor: float = _f(1.0, "llama3 scaling: low_freq_factor")
    rope_scaling_high_freq_factor: float = _f(4.0, "llama3 scaling: high_freq_factor")
    rope_scaling_original_max_position_embeddings: int = _f(
        8192, "llama3 scaling: the context length the model was first trained with"
    )
    rms_norm_eps: float = _f(1e-5, "RMSNorm epsilon")
    tie_word_embeddings: bool = _f(False, "share the input embedding with the output projection")
    initializer_range: float = _f(0.02, "std of the normal initialisation")

    @property
    def head_width(self) -> int:
        """The width of one attention head: `head_dim` when set, else hidden_size / heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


@dataclass
class MixtureSource:
    """One source of a data mixture and its weight (its share of the training samples, normalised)."""

    source: str
    weight: float


@dataclass
class DataConfig:
    source: str | None = _f(
        None, "text source: file, directory, glob, save_to_disk dir or hub name; none = built-in corpus"
    )
    mixture: list[MixtureSource] | None = _f(
        None,
        "weighted sources instead of one: in YAML a list of {source: ..., weight: ...}, or "
        "--data SOURCE:WEIGHT repeated; weights are normalised (not settable with --set)",
    )
    text_field: str = _f("text", "field holding the text in JSONL / Parquet / CSV / datasets")
    hub_config: str | None = _f(None, "configuration name of a hub dataset")
    streaming: bool = _f(False, "stream a hub dataset instead of downloading it whole")
    tokenizer: str | None = _f(None, "tokenizer.json or a local Hugging Face tokenizer directory")
    cache_dir: str | None = _f(None, "where prepared token shards go (default ~/.cache/llmtrain/data)")
    val_fraction: float = _f(0.02, "fraction of documents held out for validation")
    split_seed: int = _f(1234, "seed of the train/validation split")
    document_masking: bool = _f(False, "attention does not cross document boundaries")
    num_proc: int = _f(2, "tokenization processes")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "peak learning rate")
    weight_decay: float = _f(0.1, "AdamW weight decay on weight matrices (not norms or embeddings)")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 disables")


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "wsd", "linear", "constant"] = _f("cosine", "learning-rate schedule")
    warmup_steps: int | None = _f(None, "linear warmup steps; none = min(100, a tenth of the run)")
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of the peak (cosine, linear, wsd)")
    decay_fraction: float = _f(0.2, "wsd: fraction of the run spent in the final decay")
    decay_steps: int | None = _f(
        None, "wsd: updates in the final decay, ending at the last step (instead of decay_fraction)"
    )
    decay_shape: Literal["linear", "cosine", "sqrt"] = _f("linear", "wsd: shape of the final decay")


@dataclass
class TrainSection:
    steps: int | None = _f(None, "optimizer steps to train (or give --tokens)")
    tokens: int | None = _f(None, "tokens to train; converted to steps")
    micro_batch: int = _f(8, "sequences per process per forward pass")
    global_batch: int | None = _f(None, "sequences per optimizer step; default micro_batch x world size")
    seq_len: int = _f(256, "tokens per training sequence")
    precision: Precision = _f(
        "auto",
        "auto (bf16 on a GPU or CPU that computes it natively, else fp32; decided and recorded when the run "
        "starts), bf16, fp16 (GPU only) or fp32",
    )
    seed: int = _f(0, "seed for initialisation, data order and dropout-free sampling")
    init_from: str | None = _f(
        None,
        "start from these weights (fresh optimizer and schedule): a Hugging Face Llama directory, or a run "
        "directory (RUN_DIR or RUN_DIR:STEP); the model shape and tokenizer come with them",
    )
    engine: EngineName = _f(
        "deepspeed", "training engine: DeepSpeed (ZeRO 0-3, tp/sp/pp) or PyTorch FSDP2 (--zero 2 or 3, tp)"
    )
    activation_checkpointing: Checkpointing = _f("none", "recompute activations in backward")
    checkpoint_every_k: int = _f(2, "selective checkpointing: every k-th block")
    partition_activations: bool = _f(
        False,
        "with activation checkpointing under tp: each tp rank keeps 1/tp of every checkpointed block's "
        "input, all-gathered for the recompute (DeepSpeed's activation checkpointing)",
    )
    cpu_checkpointing: bool = _f(
        False,
        "with activation checkpointing: keep the checkpointed blocks' inputs in host memory until their "
        "recompute (DeepSpeed's activation checkpointing)",
    )
    compile: bool | None = _f(
        None,
        "torch.compile each transformer block; none = on for DeepSpeed runs of "
        f"{COMPILE_MIN_STEPS}+ steps without tp, sp or pp (decided when the run starts)",
    )
    eval_every: int | None = _f(None, "evaluate on the validation split every N steps")
    eval_batches: int = _f(8, "validation batches per evaluation")


@dataclass
class ZeroConfig:
    stage: int = _f(1, "ZeRO stage 0-3")
    offload: Offload = _f("none", "offload optimizer states (and stage-3 parameters) to cpu or nvme")
    nvme_path: str | None = _f(None, "directory for NVMe offload")
    overlap_comm: bool = _f(True, "overlap gradient reduction with backward")
    reduce_bucket_size: int | None = _f(None, "elements per reduce bucket; none = hidden_size^2")
    allgather_bucket_size: int | None = _f(None, "elements per allgather bucket (stages 1-2)")
    prefetch_bucket_size: int | None = _f(None, "stage 3 prefetch elements; none = 0.9 * hidden_size^2")
    param_persistence_threshold: int | None = _f(None, "stage 3: keep smaller params; none = 10*hidden")
    max_live_parameters: int | None = _f(None, "stage 3 live parameter limit (elements)")
    shard_within_node: bool = _f(
        False,
        "ZeRO 3 on several nodes (ZeRO++ hpZ): a second copy of the weights sharded within each node, so "
        "backward gathers them inside the node; costs weights x dtype / ranks per node per rank",
    )
    quantize_weights: bool = _f(False, "ZeRO 3 (ZeRO++ qwZ): gather the weights in int8 (CUDA GPUs)")
    quantize_grads: bool = _f(
        False, "ZeRO 3 on several nodes (ZeRO++ qgZ): reduce gradients across nodes in int4 (CUDA GPUs)"
    )


@dataclass
class ParallelConfig:
    """The model-parallel degrees; data parallelism takes the rest of the world
    (dp = world / (tp * sp * pp))."""

    tp: int = _f(1, "tensor-parallel degree: attention heads and MLP columns split over this many ranks")
    sp: int = _f(
        1, "sequence-parallel degree (Ulysses): each rank holds seq_len / sp tokens of every sequence"
    )
    pp: int = _f(1, "pipeline-parallel degree: consecutive blocks in this many stages, one per rank")
    dp_shard: int | None = _f(
        None,
        "FSDP2: shard over groups of this many data-parallel ranks and replicate across the groups "
        "(HSDP); none = the ranks of one node when the run spans several nodes, else all of them",
    )
    pp_schedule: PipeSchedule = _f(
        "1f1b",
        "pipeline schedule: 1f1b (one forward, one backward) or gpipe (all forwards, then all backwards)",
    )
    pp_partition: PipePartition = _f(
        "parameters", "how blocks are split into stages: balanced by parameters, or the same number of blocks"
    )


@dataclass
class CheckpointSection:
    save_every: int | None = _f(None, "save every N steps")
    save_every_minutes: float | None = _f(None, "save every N minutes of wall time")
    keep: int | None = _f(3, "keep the last N complete checkpoints; none keeps all")
    keep_every: int | None = _f(None, "also keep every checkpoint whose step is a multiple of M")
    strict: bool = _f(False, "resume refuses a corrupt checkpoint instead of falling back")
    on_save_failure: Literal["continue", "stop"] = _f(
        "continue", "after a failed save: warn and retry, or stop"
    )
    min_free: ByteSize = _f(
        ByteSize(0),
        "space to keep free on the checkpoint filesystem (e.g. 50GB); a save that would not is refused",
    )


@dataclass
class LoggingConfig:
    log_every: int = _f(10, "write metrics every N steps")
    wandb: Literal["off", "offline", "online"] = _f("off", "Weights & Biases logging")
    wandb_project: str = _f("llmtrain", "wandb project")
    run_name: str | None = _f(None, "run name; default derived from the run directory")
    peak_flops: float | None = _f(None, "peak FLOP/s of one device for MFU; none = the known GPUs' bf16 peak")
    profile: str | None = _f(
        None,
        "START:STEPS: torch.profiler trace of optimizer steps START..START+STEPS-1 (1-based, as the "
        "progress lines number them) into RUN_DIR/profile/",
    )


@dataclass
class StabilityConfig:
    policy: Literal["warn", "skip"] = _f("skip", "what a loss or grad-norm spike does")
    loss_spike_std: float = _f(6.0, "a loss this many std above the window mean is a spike")
    grad_spike_std: float = _f(6.0, "a grad norm this many std above the window mean is a spike")
    window: int = _f(50, "steps in the running window")
    min_history: int = _f(20, "steps of history before spikes are judged")
    max_consecutive_skips: int = _f(5, "stop the run after this many skipped steps in a row")


@dataclass
class LaunchConfig:
    gpus: int = _f(1, "processes per node (GPUs, or gloo processes on a CPU machine)")
    nodes: int = _f(1, "number of nodes")
    hostfile: str | None = _f(None, "DeepSpeed hostfile: one `host slots=N` line per node")
    launcher: Literal["pdsh", "openmpi", "mvapich", "slurm", "impi", "mpich"] = _f(
        "pdsh", "DeepSpeed multi-node runner"
    )
    master_addr: str | None = _f(None, "address of rank 0 for multi-node runs (default: the first host)")
    launcher_args: str | None = _f(None, "extra arguments for the runner (pdsh, mpirun), as one string")
    forward_env: str | None = _f(
        None,
        "more environment variables for the workers on every node, comma-separated (names that look "
        "like secrets, e.g. WANDB_API_KEY, go only when named here)",
    )
    master_port: int | None = _f(
        None, "port of rank 0; none = 29500, or a free port on one node when 29500 is taken"
    )
    collective_timeout_s: float = _f(600.0, "abort when a collective waits longer than this")


@dataclass
class TrainConfig:
    preset: str = _f(DEFAULT_PRESET, "named model size; model.* keys override its values")
    run_dir: str | None = _f(None, "run directory; default runs/<readable-name>")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainSection = field(default_factory=TrainSection)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    # ---- derived numbers: functions, never fields ----
    @property
    def world_size(self) -> int:
        return self.launch.gpus * self.launch.nodes

    def layout(self, world_size: int | None = None) -> Layout:
        """The run's layout over `world_size` processes (default: the ones it launches)."""
        p = self.parallel
        return Layout(world_size or self.world_size, p.tp, p.sp, p.pp)

    def choice(self, accelerator: str | None = None) -> rules.Choice:
        """This config's point of the layout space, for rules.check."""
        z, p = self.zero, self.parallel
        t = self.train
        zero_plus = rules.ZeroPlus(z.shard_within_node, z.quantize_weights, z.quantize_grads)
        return rules.Choice(
            z.stage, z.offload, t.precision, accelerator, p.tp, p.sp, p.pp, t.engine, zero_plus,
            dp_shard=p.dp_shard,
        )  # fmt: skip

    @property
    def data_parallel(self) -> int:
        """Ranks that see distinct samples: tp and sp ranks of one group share theirs, and one
        pipeline's stages pass the same samples along."""
        return max(1, self.layout().dp)

    @property
    def global_batch(self) -> int:
        return self.train.global_batch or self.train.micro_batch * self.data_parallel

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.train.seq_len

    @property
    def warmup_steps(self) -> int:
        if self.schedule.warmup_steps is not None:
            return self.schedule.warmup_steps
        return min(100, self.total_steps // 10)

    @property
    def compiles(self) -> bool:
        """Whether the blocks are compiled: train.compile, or where it is unset, the default: on where
        torch.compile is tested to train exactly (DeepSpeed without tp, sp or pp: the collectives inside
        a tp/sp block and the pipeline's stage modules are not) and pays back its warm-up (about a minute
        on a CPU; the README's measured throughput is with this default)."""
        if self.train.compile is not None:
            return self.train.compile
        lay = self.parallel
        plain = self.train.engine == "deepspeed" and lay.tp == lay.sp == lay.pp == 1
        return plain and self.total_steps >= COMPILE_MIN_STEPS

    @property
    def total_steps(self) -> int:
        if self.train.tokens is not None:
            return max(1, -(-self.train.tokens // self.tokens_per_step))
        return self.train.steps if self.train.steps is not None else DEFAULT_STEPS


DEFAULT_STEPS = 1000

# ---------------------------------------------------------------- key paths and types


# The key tables below are fixed by the dataclasses: built once per process. Every flag of the CLI asks
# for them while `llmtrain.cli` is imported, and rebuilding them each time (get_type_hints over every
# section) cost seconds on each start of every `llmtrain` process, workers included.
@functools.cache
def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(TrainConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }


def all_keys() -> dict[str, Any]:
    """Every settable dotted key with its type annotation."""
    return dict(_all_keys())


@functools.cache
def _all_keys() -> dict[str, Any]:
    keys: dict[str, Any] = {}
    top_hints = typing.get_type_hints(TrainConfig)
    sections = _section_types()
    for f in dataclasses.fields(TrainConfig):
        if f.name in sections:
            hints = typing.get_type_hints(sections[f.name])
            for sub in dataclasses.fields(sections[f.name]):
                keys[f"{f.name}.{sub.name}"] = hints[sub.name]
        else:
            keys[f.name] = top_hints[f.name]
    return keys


def key_help() -> dict[str, str]:
    """Help text of every key, from the field metadata."""
    return dict(_key_help())


@functools.cache
def _key_help() -> dict[str, str]:
    out: dict[str, str] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in _section_types():
            for sub in dataclasses.fields(_section_types()[f.name]):
                out[f"{f.name}.{sub.name}"] = sub.metadata.get("help", "")
        else:
            out[f.name] = f.metadata.get("help", "")
    return out


def _check_key(key: str) -> Any:
    keys = all_keys()
    if key not in keys:
        close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else "; see `llmtrain config --list-keys`"
        raise ConfigError(f"unknown config key {key!r}{hint}")
    return keys[key]


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def base_type(tp: Any) -> Any:
    if _is_optional(tp):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def type_name(tp: Any) -> str:
    base = base_type(tp)
    if get_origin(base) is Literal:
        name = " | ".join(str(a) for a in get_args(base))
    elif get_origin(base) is list:
        name = "a list of {source, weight}"
    elif base is ByteSize:
        name = "a size in bytes (e.g. 50e9, 500MB, 2GiB)"
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} or none" if _is_optional(tp) else name


def coerce(key: str, value: Any, where: str) -> Any:
    """Parse a string (from --set or a flag) or check a YAML value against the key's type."""
    tp = _check_key(key)
    base = base_type(tp)
    if get_origin(base) is Literal and str(value).strip() in map(str, get_args(base)):
        return _coerce_to(base, value)  # a choice may itself be spelled "none"
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        if _is_optional(tp):
            return None
        raise ConfigError(f"{where}: {key} needs a value of type {type_name(tp)}")
    if get_origin(base) is list and isinstance(value, str):
        raise ConfigError(
            f"{where}: {key} is a list: write it in the --config YAML (data: {{mixture: [{{source: a.jsonl, "
            "weight: 0.7}, ...]}) or repeat --data SOURCE:WEIGHT"
        )
    try:
        return _coerce_to(base, value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} must be {type_name(tp)}, got {value!r}") from None


def _coerce_to(base: Any, value: Any) -> Any:
    if get_origin(base) is list:
        return _mixture(value)
    if base is ByteSize:
        if isinstance(value, bool):
            raise ValueError(value)
        return parse_bytes(value)
    if get_origin(base) is Literal:
        allowed = get_args(base)
        for option in allowed:
            if str(option) == str(value).strip():
                return option
        raise ValueError(value)
    if base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(value)
    if base is int:
        if isinstance(value, bool):
            raise ValueError(value)
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        # Accept 1e6 and 1_000_000 for token and step counts.
        text = str(value).strip().replace("_", "")
        number = float(text) if ("e" in text.lower() or "." in text) else int(text)
        if isinstance(number, float) and not number.is_integer():
            raise ValueError(value)
        return int(number)
    if base is float:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(str(value).strip().replace("_", ""))
    if base is str:
        if isinstance(value, (dict, list)):
            raise ValueError(value)
        return str(value)
    raise TypeError(base)


def _mixture(value: Any) -> list[MixtureSource]:
    """data.mixture from YAML (a list of {source, weight} mappings) or from `--data` (MixtureSource items)."""
    if not isinstance(value, list):
        raise ValueError(value)
    entries = []
    for item in value:
        if isinstance(item, MixtureSource):
            item = dataclasses.asdict(item)
        if not isinstance(item, dict) or set(item) != {"source", "weight"}:
            raise ValueError(value)
        weight, source = item["weight"], item["source"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not isinstance(source, str):
            raise ValueError(value)
        entries.append(MixtureSource(item["source"], float(weight)))
    return entries


def data_flag(values: list[str]) -> dict[str, Any]:
    """`--data` as typed (repeatable): one SOURCE sets data.source; SOURCE:WEIGHT items set data.mixture."""
    parsed = [_source_and_weight(text) for text in values]
    if len(parsed) == 1 and parsed[0][1] is None:
        return {"data.source": parsed[0][0]}
    unweighted = [source for source, weight in parsed if weight is None]
    if unweighted:
        raise ConfigError(
            f"--data {unweighted[0]}: every source of a mixture needs a weight; write --data SOURCE:WEIGHT "
            "(e.g. --data a.jsonl:0.7 --data docs/:0.3)"
        )
    entries = [MixtureSource(source, weight) for source, weight in parsed if weight is not None]
    return {"data.mixture": entries}


def _source_and_weight(text: str) -> tuple[str, float | None]:
    """`a.jsonl:0.7` -> (a.jsonl, 0.7); a path without a trailing `:NUMBER` (or one that exists as
    typed) is a source without a weight."""
    source, colon, tail = text.rpartition(":")
    if not colon or Path(text).expanduser().exists() or "/" in tail:
        return text, None
    try:
        weight = float(tail)
    except ValueError:
        raise ConfigError(
            f"--data {text}: {tail!r} is not a weight; write SOURCE:WEIGHT with a positive number "
            "(e.g. --data a.jsonl:0.7)"
        ) from None
    if not source:
        raise ConfigError(f"--data {text}: no source before the weight; write SOURCE:WEIGHT")
    return source, weight


# ---------------------------------------------------------------- layering


def _set(cfg: TrainConfig, key: str, value: Any) -> None:
    obj: Any = cfg
    *parents, last = key.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def get(cfg: TrainConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file as flat dotted keys (type-checked later, when applied)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found; pass an existing YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML{line}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections, got {type(data).__name__}")
    return _flatten(data)


def parse_set(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set optim.lr=1e-3")
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out


def apply_preset(cfg: TrainConfig, name: str, where: str = "--preset") -> None:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{where}: unknown preset {name!r}{hint}; choose one of {', '.join(PRESETS)}")
    cfg.preset = name
    cfg.model = ModelConfig(**PRESETS[name])


def resolve(
    config_file: str | Path | None = None,
    sets: list[str] | None = None,
    flags: dict[str, Any] | None = None,
    base: TrainConfig | None = None,
) -> TrainConfig:
    """Build and validate a TrainConfig: defaults < preset < `base` < file < --set < flags.

    `base` is a run's saved config when `resume` applies changes to it.
    """
    set_values = parse_set(sets or [])
    flag_values = {k: v for k, v in (flags or {}).items() if v is not None}
    if isinstance(flag_values.get("data.source"), list):  # --data, repeatable
        flag_values.update(data_flag(flag_values.pop("data.source")))
    for key in flag_values:
        _check_key(key)
    layers = [
        (flat_dict(base) if base is not None else {}, "the run's config"),
        (load_yaml(config_file) if config_file else {}, f"--config {config_file}"),
        (set_values, "--set"),
    ]
    cfg = TrainConfig()
    preset, where = DEFAULT_PRESET, "preset"
    for layer, name in [*layers, (flag_values, "--preset")]:
        if "preset" in layer:
            preset, where = str(layer["preset"]), name
    apply_preset(cfg, preset, where)
    source_model = _init_from_layer(cfg, [layer for layer, _ in layers[1:]] + [flag_values], base)
    for layer, name in layers:
        for key, value in layer.items():
            if key != "preset":
                _set(cfg, key, coerce(key, value, name))
    for key, value in flag_values.items():
        if key != "preset":
            _set(cfg, key, coerce(key, value, flag_for(key)))
    if source_model is not None:
        _check_init_shape(cfg, source_model)
    validate(cfg)
    return cfg


def _init_from_layer(
    cfg: TrainConfig, layers: list[dict[str, Any]], base: TrainConfig | None
) -> dict[str, Any] | None:
    """With `train.init_from` given (not inherited from a saved run: a resume's weights are its
    checkpoint's), the source's model section replaces the preset's, and its tokenizer is the default.
    Returns the source's model keys, which the user's layers may then change only where the weights
    allow (_check_init_shape)."""
    given = [layer for layer in layers if layer.get("train.init_from") is not None]
    if base is not None or not given:
        return None
    source = init_source.parse(str(given[-1]["train.init_from"]))
    if any("preset" in layer for layer in layers):
        raise ConfigError(
            f"--preset: the model shape comes from {init_source.FLAG} {source.path}; drop --preset"
        )
    model = init_source.model_keys(source)
    for key, value in model.items():
        _set(cfg, f"model.{key}", coerce(f"model.{key}", value, f"{init_source.FLAG} {source.path}"))
    tokenizer = init_source.tokenizer_path(source)
    if tokenizer is not None:
        cfg.data.tokenizer = str(tokenizer)
    return model


def _check_init_shape(cfg: TrainConfig, source_model: dict[str, Any]) -> None:
    """The weights' shape is the source's: a user's model key that would change it is refused (the
    context length, RoPE and initialisation keys may change: they do not shape a tensor)."""
    for key in init_source.SHAPE_KEYS:
        wanted, got = source_model.get(key, getattr(ModelConfig(), key)), getattr(cfg.model, key)
        if wanted != got:
            raise ConfigError(
                f"{flag_for('model.' + key)}: {got!r}, but the weights of {init_source.FLAG} "
                f"{cfg.train.init_from} have {key}={wanted!r}; drop it (the shape comes with the weights)"
            )


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flat_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Every key of `cfg` as dotted key -> value."""
    return _flatten(to_dict(cfg))


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(data: dict[str, Any], where: str = "config") -> TrainConfig:
    """Rebuild a config from `to_dict` output (e.g. a run's config.yaml), validated."""
    flat = _flatten(data)
    cfg = TrainConfig()
    apply_preset(cfg, str(flat.get("preset", DEFAULT_PRESET)), where)
    for key, value in flat.items():
        if key != "preset":
            _set(cfg, key, coerce(key, value, where))
    validate(cfg)
    return cfg


def load_run_config(path: str | Path) -> TrainConfig:
    """A run's saved config.yaml; a damaged one is bad input naming the file."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{path}: unreadable run config ({type(exc).__name__}); restore it, or start a new run"
        ) from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"{path}: not a run config (a {type(data).__name__}); restore it, or start a new run"
        )
    return from_dict(data or {}, where=str(path))


# ---------------------------------------------------------------- validation


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{flag_for(key)}: {message}")


def validate(cfg: TrainConfig) -> None:
    """Every check that does not need the hardware; what needs the accelerator is checked again by
    dsconfig.build with it (rules.RULES holds both)."""
    _validate_model(cfg.model)
    _validate_train(cfg)
    _validate_zero(cfg)
    _validate_other(cfg)


def _validate_model(m: ModelConfig) -> None:
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ):
        _require(getattr(m, key) > 0, f"model.{key}", f"must be positive, got {getattr(m, key)}")
    _require(
        m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0,
        "model.num_attention_heads",
        f"{m.num_attention_heads} heads do not divide hidden_size {m.hidden_size}; "
        "change one, or set model.head_dim",
    )
    _require(m.head_dim is None or m.head_dim > 0, "model.head_dim", f"must be positive, got {m.head_dim}")
    _require(
        m.num_attention_heads % m.num_key_value_heads == 0,
        "model.num_key_value_heads",
        f"{m.num_key_value_heads} KV heads do not divide {m.num_attention_heads} attention heads",
    )
    _require(m.head_width % 2 == 0, "model.head_dim", f"head dim {m.head_width} must be even for RoPE")
    _require(m.rope_theta > 0, "model.rope_theta", "must be positive")
    _require(m.rope_scaling_factor > 0, "model.rope_scaling_factor", "must be positive")
    if m.rope_scaling_type == "llama3":
        _require(
            m.rope_scaling_high_freq_factor > m.rope_scaling_low_freq_factor > 0,
            "model.rope_scaling_high_freq_factor",
            "llama3 RoPE scaling needs high_freq_factor > low_freq_factor > 0",
        )
        _require(
            m.rope_scaling_original_max_position_embeddings > 0,
            "model.rope_scaling_original_max_position_embeddings",
            "must be positive",
        )
    _require(m.rms_norm_eps > 0, "model.rms_norm_eps", "must be positive")


def _validate_train(cfg: TrainConfig) -> None:
    t = cfg.train
    _require(t.micro_batch > 0, "train.micro_batch", f"must be positive, got {t.micro_batch}")
    _require(t.seq_len > 0, "train.seq_len", f"must be positive, got {t.seq_len}")
    _require(
        t.seq_len <= cfg.model.max_position_embeddings,
        "train.seq_len",
        f"{t.seq_len} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}; "
        "lower --seq-len or --set model.max_position_embeddings",
    )
    _require(
        not (t.steps is not None and t.tokens is not None),
        "train.tokens",
        "give either --steps or --tokens, not both",
    )
    _require(t.steps is None or t.steps > 0, "train.steps", f"must be positive, got {t.steps}")
    _require(t.tokens is None or t.tokens > 0, "train.tokens", f"must be positive, got {t.tokens}")
    _require(t.checkpoint_every_k > 0, "train.checkpoint_every_k", "must be positive")
    _validate_checkpointed_activations(cfg)
    _require(t.eval_every is None or t.eval_every > 0, "train.eval_every", "must be positive")
    _require(t.eval_batches > 0, "train.eval_batches", "must be positive")
    _require(cfg.launch.gpus > 0, "launch.gpus", f"must be at least 1, got {cfg.launch.gpus}")
    _require(cfg.launch.nodes > 0, "launch.nodes", f"must be at least 1, got {cfg.launch.nodes}")
    _require(
        cfg.launch.launcher != "slurm",
        "launch.launcher",
        "slurm: DeepSpeed's Slurm runner drops `-m llmtrain` and cannot start the workers; inside an "
        "allocation run `srun llmtrain train ...` (one task per GPU), or have `llmtrain train ... --sbatch "
        "FILE` write the job script",
    )
    if t.global_batch is not None:
        _require(t.global_batch > 0, "train.global_batch", f"must be positive, got {t.global_batch}")
    check_layout(cfg, cfg.layout())
    rules.batch_triple(t.micro_batch, t.global_batch, cfg.data_parallel)
    o = cfg.optim
    _require(o.lr > 0, "optim.lr", f"must be positive, got {o.lr}")
    _require(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1", "betas must be in [0, 1)")
    _require(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
    s = cfg.schedule
    _require(s.warmup_steps is None or s.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0")
    _require(0 <= s.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]")
    _require(0 < s.decay_fraction <= 1, "schedule.decay_fraction", "must be in (0, 1]")
    _require(s.decay_steps is None or s.decay_steps >= 1, "schedule.decay_steps", "must be at least 1")


def check_layout(cfg: TrainConfig, layout: Layout) -> None:
    """`layout` against the config's model shape and sequence length (planning.layout.check_shape), and
    under FSDP2 its shard group and tensor-parallel split."""
    m = cfg.model
    check_shape(
        layout,
        heads=m.num_attention_heads,
        kv_heads=m.num_key_value_heads,
        mlp_width=m.intermediate_size,
        vocab=m.vocab_size,
        seq_len=cfg.train.seq_len,
        layers=m.num_hidden_layers,
    )
    if cfg.train.engine == "fsdp2":
        fsdp_mesh(layout, cfg.parallel.dp_shard, cfg.launch.gpus)
        # ColwiseParallel splits k and v by rows: more tp ranks than key/value heads would split a head.
        _require(
            layout.tp <= m.num_key_value_heads,
            "parallel.tp",
            f"tp {layout.tp} with --engine fsdp2 is more than the {m.num_key_value_heads} key/value heads, "
            "which FSDP2's tensor parallelism splits whole: use a divisor of them, or --engine deepspeed "
            "(which replicates key/value heads)",
        )


def _validate_checkpointed_activations(cfg: TrainConfig) -> None:
    """Where DeepSpeed's activation checkpointing keeps the checkpointed blocks' inputs: it applies to
    blocks that are checkpointed, partitions them over a tp group, and runs in the DeepSpeed engine."""
    t = cfg.train
    for key, on in (
        ("train.partition_activations", t.partition_activations),
        ("train.cpu_checkpointing", t.cpu_checkpointing),
    ):
        if not on:
            continue
        _require(
            t.activation_checkpointing != "none",
            key,
            "applies to checkpointed blocks; add --activation-checkpointing full (or selective)",
        )
        _require(
            t.engine == "deepspeed",
            key,
            "is DeepSpeed's activation checkpointing; use --engine deepspeed",
        )
    _require(
        not t.partition_activations or cfg.parallel.tp > 1,
        "train.partition_activations",
        "splits each checkpointed input over the tensor-parallel ranks; add --tp 2 (or more), or use "
        "--cpu-checkpointing",
    )


def _validate_zero(cfg: TrainConfig) -> None:
    z = cfg.zero
    _require(z.stage in (0, 1, 2, 3), "zero.stage", f"invalid stage {z.stage}; valid values: 0, 1, 2, 3")
    rules.check(cfg.choice())
    _require(
        not (z.offload == "nvme" and not z.nvme_path),
        "zero.nvme_path",
        "--offload nvme needs --nvme-path DIR on a fast local disk",
    )
    for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters"):
        value = getattr(z, key)
        _require(value is None or value > 0, f"zero.{key}", f"must be positive, got {value}")


_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _validate_other(cfg: TrainConfig) -> None:
    c = cfg.checkpoint
    _require(c.save_every is None or c.save_every > 0, "checkpoint.save_every", "must be positive")
    _require(
        c.save_every_minutes is None or c.save_every_minutes > 0,
        "checkpoint.save_every_minutes",
        "must be positive",
    )
    _require(c.keep is None or c.keep > 0, "checkpoint.keep", "must be at least 1 (or none to keep all)")
    _require(c.keep_every is None or c.keep_every > 0, "checkpoint.keep_every", "must be positive")
    _require(cfg.logging.log_every > 0, "logging.log_every", "must be positive")
    peak = cfg.logging.peak_flops
    _require(peak is None or peak > 0, "logging.peak_flops", f"must be positive, got {peak}")
    name = cfg.logging.run_name
    _require(
        name is None or (_PLAIN_NAME.fullmatch(name) is not None and name not in (".", "..")),
        "logging.run_name",
        f"{name!r} is not a plain name; use letters, digits, '.', '_' and '-' only (no path)",
    )
    _validate_profile(cfg)
    st = cfg.stability
    _require(st.window > 1, "stability.window", "must be at least 2")
    _require(st.max_consecutive_skips > 0, "stability.max_consecutive_skips", "must be positive")
    _require(cfg.launch.collective_timeout_s > 0, "launch.collective_timeout_s", "must be positive")
    _require(0 <= cfg.data.val_fraction < 1, "data.val_fraction", "must be in [0, 1)")
    _require(cfg.data.num_proc > 0, "data.num_proc", "must be positive")
    _validate_mixture(cfg.data)


def _validate_mixture(data: DataConfig) -> None:
    if data.mixture is None:
        return
    if data.source is not None:
        raise ConfigError(
            f"--data {data.source}: a run reads one source (--data SOURCE) or a mixture (--data SOURCE:WEIGHT "
            "repeated, or data.mixture), not both; drop one of them"
        )
    if not data.mixture:
        raise ConfigError("data.mixture: the list is empty; give at least one {source, weight}")
    for entry in data.mixture:
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            raise ConfigError(
                f"--data {entry.source}:{entry.weight:g}: a weight must be a positive number; "
                "weights are relative (normalised to sum to 1)"
            )


_PROFILE_WINDOW = re.compile(r"(\d+):(\d+)")


def profile_window(text: str) -> range:
    """`logging.profile`'s START:STEPS as the optimizer step numbers it covers (1-based, as printed)."""
    match = _PROFILE_WINDOW.fullmatch(text.strip())
    if match is None:
        raise ConfigError(
            f"{flag_for('logging.profile')}: expected START:STEPS (e.g. 5:2 profiles steps 5 and 6), got {text!r}"
        )
    start, steps = int(match[1]), int(match[2])
    _require(start >= 1, "logging.profile", f"START counts steps from 1, got {text!r}; e.g. 5:2")
    _require(steps >= 1, "logging.profile", f"STEPS must be at least 1, got {text!r}; e.g. 5:2")
    return range(start, start + steps)


def _validate_profile(cfg: TrainConfig) -> None:
    if cfg.logging.profile is None:
        return
    window = profile_window(cfg.logging.profile)
    _require(
        window[-1] <= cfg.total_steps,
        "logging.profile",
        f"{cfg.logging.profile} profiles steps {window.start}-{window[-1]}, past the run's last step "
        f"{cfg.total_steps}; give START:STEPS within the run",
    )
