"""The config tree: layering, round trip, type checking of --set, validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmtrain import config as c
from llmtrain.planning import rules
from llmtrain.presets import PRESETS


def test_defaults_take_the_preset_shape() -> None:
    cfg = c.resolve()
    assert cfg.preset == "tiny"
    assert cfg.model.hidden_size == PRESETS["tiny"]["hidden_size"]


def test_precedence_flag_over_set_over_file_over_default(tmp_path: Path) -> None:
    file = tmp_path / "run.yaml"
    file.write_text(
        yaml.safe_dump({"optim": {"lr": 0.1, "weight_decay": 0.2}, "train": {"seed": 7, "steps": 3}})
    )
    cfg = c.resolve(file, sets=["optim.lr=0.01", "train.seed=8"], flags={"optim.lr": "0.001"})
    assert cfg.optim.lr == 0.001  # flag beats --set and file
    assert cfg.train.seed == 8  # --set beats file
    assert cfg.optim.weight_decay == 0.2  # file beats default
    assert cfg.train.steps == 3
    assert cfg.optim.beta1 == 0.9  # default


def test_model_keys_override_the_preset_at_every_layer(tmp_path: Path) -> None:
    file = tmp_path / "run.yaml"
    file.write_text("preset: 125m\nmodel:\n  num_hidden_layers: 3\n")
    cfg = c.resolve(file, sets=["model.hidden_size=384"], flags={"preset": None})
    assert cfg.preset == "125m"
    assert cfg.model.num_hidden_layers == 3
    assert cfg.model.hidden_size == 384
    assert cfg.model.intermediate_size == PRESETS["125m"]["intermediate_size"]


def test_dump_and_load_round_trip(tmp_path: Path) -> None:
    cfg = c.resolve(
        sets=["model.num_hidden_layers=3", "zero.offload=cpu", "zero.stage=2"], flags={"train.tokens": "1e6"}
    )
    path = tmp_path / "config.yaml"
    path.write_text(c.dump_yaml(cfg))
    assert c.load_run_config(path) == cfg
    assert c.resolve(path) == cfg


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean optim.lr?"),
        ("train.stepz=1", "did you mean train.steps?"),
        ("train.steps=ten", "train.steps must be int or none, got 'ten'"),
        ("train.steps=2.5", "train.steps must be int or none"),
        ("optim.lr=fast", "optim.lr must be float"),
        ("train.compile=maybe", "train.compile must be bool"),
        ("zero.offload=gpu", "zero.offload must be none | cpu | nvme"),
        ("checkpoint.min_free=-5GB", "checkpoint.min_free must be a size in bytes"),
        ("checkpoint.min_free=5 furlongs", "checkpoint.min_free must be a size in bytes"),
        ("noequals", "expected section.key=value"),
    ],
)
def test_bad_set_items_are_rejected_with_the_key(item: str, message: str) -> None:
    with pytest.raises(c.ConfigError, match=message.replace("?", r"\?").replace("|", r"\|")):
        c.resolve(sets=[item])


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("50e9", 50 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5TB", 1.5e12)],
)
def test_sizes_are_read_with_their_units(text: str, size: int) -> None:
    assert c.resolve(sets=[f"checkpoint.min_free={text}"]).checkpoint.min_free == size


def test_values_parse_to_field_types() -> None:
    cfg = c.resolve(
        sets=["train.tokens=1_000_000", "train.compile=yes", "train.global_batch=none", "optim.lr=3e-4"]
    )
    assert cfg.train.tokens == 1_000_000 and cfg.train.compile is True
    assert cfg.train.global_batch is None and cfg.optim.lr == pytest.approx(3e-4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"zero.stage": "4"}, "--zero: invalid stage 4; valid values: 0, 1, 2, 3"),
        ({"launch.gpus": "0"}, "--gpus: must be at least 1"),
        ({"train.steps": "10", "train.tokens": "100"}, "--tokens: give either --steps or --tokens"),
        ({"train.seq_len": "4096"}, "--seq-len: 4096 exceeds model.max_position_embeddings=1024"),
        ({"zero.stage": "0", "zero.offload": "cpu"}, "--offload: offload cpu needs ZeRO stage 1, 2 or 3"),
        ({"zero.stage": "3", "zero.offload": "nvme"}, "--nvme-path: --offload nvme needs --nvme-path"),
        (
            {"zero.stage": "2", "zero.offload": "nvme", "zero.nvme_path": "/x"},
            "NVMe offload needs ZeRO stage 3",
        ),
        (
            {"train.micro_batch": "3", "train.global_batch": "8"},
            "--global-batch: 8 is not divisible by micro-batch 3",
        ),
        ({"preset": "8b"}, "--preset: unknown preset '8b'"),
    ],
)
def test_invalid_combinations_name_the_flag(flags: dict[str, str], message: str) -> None:
    with pytest.raises(c.ConfigError) as err:
        c.resolve(flags=flags)
    assert message in str(err.value)


def test_heads_must_divide_hidden_size() -> None:
    with pytest.raises(c.ConfigError, match="do not divide hidden_size"):
        c.resolve(sets=["model.num_attention_heads=7"])
    with pytest.raises(c.ConfigError, match="KV heads do not divide"):
        c.resolve(sets=["model.num_key_value_heads=3"])


def test_derived_numbers_are_functions_of_the_config() -> None:
    cfg = c.resolve(
        flags={
            "train.micro_batch": "2",
            "train.global_batch": "16",
            "launch.gpus": "2",
            "train.seq_len": "128",
        }
    )
    grad_accum = rules.batch_triple(cfg.train.micro_batch, cfg.train.global_batch, cfg.world_size)[2]
    assert cfg.world_size == 2 and grad_accum == 4 and cfg.tokens_per_step == 16 * 128
    cfg = c.resolve(flags={"train.tokens": "1000000", "train.micro_batch": "8", "train.seq_len": "256"})
    assert cfg.total_steps == 489  # ceil(1e6 / (8 * 256))


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(c.ConfigError, match="file not found"):
        c.resolve(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(c.ConfigError, match="not valid YAML"):
        c.resolve(bad)
    bad.write_text("optim:\n  lr: [1, 2]\n")
    with pytest.raises(c.ConfigError, match=r"optim\.lr must be float"):
        c.resolve(bad)


def test_every_key_has_help_text() -> None:
    assert all(c.key_help().values())


@pytest.mark.parametrize(
    ("flags", "compiles"),
    [
        ({}, True),  # the default run: 1000 steps, DeepSpeed, no tp/sp/pp
        ({"train.steps": c.COMPILE_MIN_STEPS}, True),
        ({"train.steps": c.COMPILE_MIN_STEPS - 1}, False),  # a short experiment starts at once
        ({"train.tokens": 1_000_000, "train.micro_batch": 8, "train.seq_len": 256}, True),  # 489 steps
        ({"parallel.tp": 2, "launch.gpus": 2}, False),
        ({"parallel.sp": 2, "launch.gpus": 2, "zero.stage": 3}, False),
        ({"parallel.pp": 2, "launch.gpus": 2, "zero.stage": 1}, False),
        ({"train.engine": "fsdp2", "zero.stage": 3}, False),
        ({"train.steps": 10, "train.compile": True}, True),  # said explicitly: always as said
        ({"train.compile": False}, False),
    ],
)
def test_blocks_compile_by_default_on_long_plain_deepspeed_runs(
    flags: dict[str, object], compiles: bool
) -> None:
    cfg = c.resolve(flags=flags)
    assert cfg.compiles is compiles


def test_a_fresh_run_pins_the_compile_decision_in_its_config(tmp_path: Path) -> None:
    """config.yaml records true/false, so a resume with another --steps keeps the run's kernels."""
    from llmtrain.run import prepare

    cfg = c.resolve(flags={"train.steps": 300, "run_dir": str(tmp_path / "run")})
    assert cfg.train.compile is None
    prepare.derive(cfg)
    assert cfg.train.compile is True
    assert yaml.safe_load(c.dump_yaml(cfg))["train"]["compile"] is True
