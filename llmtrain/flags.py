"""The first-class command-line flags and the config keys they set, so an error names what the user
typed: `--zero` for zero.stage, `--set zero.overlap_comm` for a key without a flag of its own."""

from __future__ import annotations

# First-class CLI flags and the keys they set, so errors can name what the user typed.
FLAG_KEYS: dict[str, str] = {
    "--preset": "preset",
    "--run-dir": "run_dir",
    "--data": "data.source",
    "--tokenizer": "data.tokenizer",
    "--text-field": "data.text_field",
    "--engine": "train.engine",
    "--zero": "zero.stage",
    "--offload": "zero.offload",
    "--nvme-path": "zero.nvme_path",
    "--shard-within-node": "zero.shard_within_node",
    "--quantize-weights": "zero.quantize_weights",
    "--quantize-grads": "zero.quantize_grads",
    "--tp": "parallel.tp",
    "--sp": "parallel.sp",
    "--pp": "parallel.pp",
    "--dp-shard": "parallel.dp_shard",
    "--pp-schedule": "parallel.pp_schedule",
    "--pp-partition": "parallel.pp_partition",
    "--precision": "train.precision",
    "--micro-batch": "train.micro_batch",
    "--global-batch": "train.global_batch",
    "--seq-len": "train.seq_len",
    "--steps": "train.steps",
    "--tokens": "train.tokens",
    "--seed": "train.seed",
    "--init-from": "train.init_from",
    "--activation-checkpointing": "train.activation_checkpointing",
    "--partition-activations": "train.partition_activations",
    "--cpu-checkpointing": "train.cpu_checkpointing",
    "--compile": "train.compile",
    "--eval-every": "train.eval_every",
    "--lr": "optim.lr",
    "--schedule": "schedule.name",
    "--warmup-steps": "schedule.warmup_steps",
    "--save-every": "checkpoint.save_every",
    "--save-every-minutes": "checkpoint.save_every_minutes",
    "--keep": "checkpoint.keep",
    "--keep-every": "checkpoint.keep_every",
    "--log-every": "logging.log_every",
    "--wandb": "logging.wandb",
    "--profile": "logging.profile",
    "--gpus": "launch.gpus",
    "--nodes": "launch.nodes",
    "--hostfile": "launch.hostfile",
    "--launcher": "launch.launcher",
    "--master-addr": "launch.master_addr",
    "--master-port": "launch.master_port",
    "--launcher-args": "launch.launcher_args",
    "--forward-env": "launch.forward_env",
    "--collective-timeout": "launch.collective_timeout_s",
}
_KEY_FLAGS = {key: flag for flag, key in FLAG_KEYS.items()}
# Flags that may be given more than once, with what their help adds about repeating them. `--data`
# repeated as SOURCE:WEIGHT sets data.mixture instead (config.data_flag).
REPEATABLE_FLAGS: dict[str, str] = {
    "--data": "; repeat as --data SOURCE:WEIGHT (--data a.jsonl:0.7 --data docs/:0.3) for a weighted mixture",
}


def flag_for(key: str) -> str:
    """How to name a key in an error: its flag when it has one, else `--set key`."""
    return _KEY_FLAGS.get(key, f"--set {key}")
