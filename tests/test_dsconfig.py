"""DeepSpeed config generation: the reference files, the batch triple, and DeepSpeed accepting them;
`config` printing them (and, under --engine fsdp2, FSDP2's plan instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist import run_distributed

from llmtrain import config as c
from llmtrain.planning import dsconfig, rules

REPO = Path(__file__).resolve().parent.parent
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def test_reference_files_match_the_code() -> None:
    generated = dsconfig.reference_configs()
    assert sorted(p.stem for p in DS_CONFIGS) == sorted(generated)
    for path in DS_CONFIGS:
        assert json.loads(path.read_text()) == generated[path.stem], (
            f"{path.name} drifted: run `make ds-configs`"
        )


def test_stage3_cpu_offload_offloads_optimizer_and_parameters() -> None:
    ds = json.loads((REPO / "ds_configs" / "zero3_offload_cpu.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    ds2 = json.loads((REPO / "ds_configs" / "zero2_offload_cpu.json").read_text())
    assert "offload_param" not in ds2["zero_optimization"]  # stage 2 has no parameter partitions


def test_batch_triple_is_consistent() -> None:
    cfg = c.resolve(flags={"train.micro_batch": "2", "train.global_batch": "16"})
    for world, expected in ((2, (16, 2, 4)), (4, (16, 2, 2))):
        ds = dsconfig.build(cfg, world)
        triple = (
            ds["train_batch_size"],
            ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"],
        )
        assert triple == rules.batch_triple(2, 16, world) == expected
    with pytest.raises(c.ConfigError, match="not divisible by micro-batch 2 x data-parallel size 3"):
        dsconfig.build(cfg, 3)
    assert rules.batch_triple(4, None, 3) == (12, 4, 1)


def test_bucket_sizes_scale_with_the_model() -> None:
    small = dsconfig.build(c.resolve(flags={"preset": "debug", "zero.stage": "3"}), 1)["zero_optimization"]
    big = dsconfig.build(c.resolve(flags={"preset": "7b", "zero.stage": "3"}), 1)["zero_optimization"]
    # DeepSpeed's default reduce bucket is 5e8 elements (1 GB in bf16) whatever the model size.
    assert small["reduce_bucket_size"] == dsconfig.MIN_BUCKET_ELEMENTS
    assert big["reduce_bucket_size"] == 4096 * 4096
    assert big["stage3_param_persistence_threshold"] == 10 * 4096


def test_precision_sections() -> None:
    bf16 = dsconfig.build(c.resolve(flags={"train.precision": "bf16", "zero.stage": "2"}), 1)
    assert bf16["bf16"]["enabled"] and bf16["data_types"]["grad_accum_dtype"] == "fp32"
    fp32 = dsconfig.build(c.resolve(flags={"train.precision": "fp32"}), 1)
    assert "bf16" not in fp32 and "fp16" not in fp32
    fp16 = dsconfig.build(c.resolve(flags={"train.precision": "fp16"}), 1, accelerator="cuda")
    assert fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    with pytest.raises(c.ConfigError, match="fp16 needs a CUDA GPU"):
        dsconfig.build(c.resolve(flags={"train.precision": "fp16"}), 1, accelerator="cpu")


def _initialize_with(ds: dict, nvme_dir: str) -> dict:
    import deepspeed
    import torch

    if (
        "offload_param" in ds["zero_optimization"]
        and ds["zero_optimization"]["offload_param"]["device"] == "nvme"
    ):
        ds["zero_optimization"]["offload_param"]["nvme_path"] = nvme_dir
        ds["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme_dir
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds
    )
    x = torch.randn(ds["train_micro_batch_size_per_gpu"], 16, dtype=torch.bfloat16)
    for _ in range(ds["gradient_accumulation_steps"]):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    result = {
        "stage": engine.zero_optimization_stage(),
        "steps": engine.global_steps,
        "optimizer": type(optimizer).__name__,
    }
    engine.destroy()  # the next configuration builds its engine in this process
    return result


def _initialize_each(rank: int, world_size: int, configs: dict[str, dict], root: str) -> dict[str, dict]:
    """Each reference config through deepspeed.initialize and one optimizer step, one after another in
    one process: a process per config would spend most of its time importing DeepSpeed."""
    results = {}
    for name, ds in configs.items():
        nvme_dir = Path(root) / name
        nvme_dir.mkdir()
        results[name] = _initialize_with(ds, str(nvme_dir))
    return results


@pytest.fixture(scope="module")
def accepted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    configs = {path.stem: json.loads(path.read_text()) for path in DS_CONFIGS}
    root = tmp_path_factory.mktemp("accepted")
    [results] = run_distributed(_initialize_each, 1, configs, str(root), timeout=900)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.stem)
def test_deepspeed_accepts_reference_config_on_cpu(path: Path, accepted: dict[str, dict]) -> None:
    ds = json.loads(path.read_text())
    result = accepted[path.stem]
    assert result["stage"] == ds["zero_optimization"]["stage"]
    assert result["steps"] == 1  # one optimizer step after gradient_accumulation_steps micro-steps


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmtrain", *args], capture_output=True, text=True, timeout=120
    )


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI's entry function in this process, for what needs no process of its own (a subprocess
    would spend its time importing): exit code, stdout and stderr as `_cli` gives them."""
    from llmtrain.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["llmtrain", *args], code, out, err)


def test_config_command_prints_stage3_cpu_offload_json() -> None:
    out = _cli("config", "--zero", "3", "--offload", "cpu")
    assert out.returncode == 0, out.stderr
    ds = json.loads(out.stdout)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_config_command_shows_the_tensor_parallel_layout(capsys: pytest.CaptureFixture[str]) -> None:
    out = _in_process(capsys, "config", "--preset", "debug", "--gpus", "4", "--tp", "2", "--micro-batch", "2")
    assert out.returncode == 0, out.stderr
    ds = json.loads(out.stdout)  # stdout is the JSON alone
    assert "tensor_parallel" not in ds  # llmtrain's own layers split the model, not DeepSpeed's AutoTP
    # DeepSpeed counts the batch over data-parallel ranks: 2 per rank x dp 2, not x 4 processes.
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (4, 1)
    assert (
        "layout: dp 2 x tp 2 over 4 processes; tp groups [0, 1] [2, 3]; dp groups [0, 2] [1, 3]" in out.stderr
    )


def test_the_tp_split_covers_the_projections_and_the_vocabulary_and_nothing_else() -> None:
    from llmtrain.model import build_model
    from llmtrain.planning.partition import WHOLE, tp_split_dim

    names = [n for n, _ in build_model(c.resolve(flags={"preset": "debug"}).model, "meta").named_parameters()]
    split = {n.split(".")[-2]: tp_split_dim(n) for n in names if tp_split_dim(n) is not None}
    assert split == {
        "q_proj": 0,
        "k_proj": 0,
        "v_proj": 0,
        "gate_proj": 0,
        "up_proj": 0,
        "o_proj": 1,
        "down_proj": 1,
        "embed_tokens": 0,  # token rows: the vocab-parallel embedding and output layer
        "lm_head": 0,
    }
    assert [n for n in names if tp_split_dim(n) is None] == [
        n for n in names if n.split(".")[-2] in ("input_layernorm", "post_attention_layernorm", "norm")
    ]
    # The universal checkpoint's "taken once" patterns come from partition.WHOLE: the same three.
    assert sorted(WHOLE) == ["input_layernorm", "norm", "post_attention_layernorm"]


def test_zero3_with_sp_reduces_by_all_reduce_in_buckets_holding_the_largest_parameter() -> None:
    cfg = c.resolve(flags={"preset": "debug", "launch.gpus": 2, "parallel.sp": 2, "zero.stage": 3})
    zero = dsconfig.build(cfg, 2)["zero_optimization"]
    assert zero["reduce_scatter"] is False
    assert zero["reduce_bucket_size"] >= cfg.model.vocab_size * cfg.model.hidden_size


def _zero_plus(flags: dict, world_size: int, **build: object) -> dict:
    cfg = c.resolve(flags={"preset": "debug", "zero.stage": 3, **flags})
    return dsconfig.build(cfg, world_size, **build)["zero_optimization"]  # type: ignore[arg-type]


def test_hpz_partitions_within_the_nodes_the_job_found() -> None:
    hpz = {"zero.shard_within_node": True, "launch.gpus": 8, "launch.nodes": 2}
    assert _zero_plus(hpz, 16)["zero_hpz_partition_size"] == 8  # --gpus: processes per node
    # A running job's own count wins (an srun step's tasks, which --gpus does not give).
    assert _zero_plus(hpz, 16, ranks_per_node=4)["zero_hpz_partition_size"] == 4
    assert "zero_hpz_partition_size" not in _zero_plus({"launch.gpus": 8, "launch.nodes": 2}, 16)
    with pytest.raises(c.ConfigError, match=r"--shard-within-node: with one node ZeRO 3 already gathers"):
        _zero_plus(hpz, 16, ranks_per_node=16)
    with pytest.raises(c.ConfigError, match=r"--shard-within-node: 16 ranks in nodes of 1: hpZ partitions"):
        _zero_plus(hpz, 16, ranks_per_node=1)


def test_qwz_and_qgz_are_written_for_cuda_and_refused_on_a_cpu() -> None:
    both = {"zero.quantize_weights": True, "zero.quantize_grads": True, "launch.gpus": 8, "launch.nodes": 2}
    zero = _zero_plus(both, 16, accelerator="cuda")
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"]) == (True, True)
    with pytest.raises(
        c.ConfigError, match=r"--quantize-weights: needs a CUDA GPU \(this machine runs cpu\)"
    ):
        _zero_plus(both, 16, accelerator="cpu")
    with pytest.raises(c.ConfigError, match=r"--quantize-grads: with one node it would do nothing"):
        _zero_plus({"zero.quantize_grads": True, "launch.gpus": 8}, 8, accelerator="cuda")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--zero", "4"], "--zero: invalid stage 4; valid values: 0, 1, 2, 3"),
        (["--zero", "0", "--offload", "cpu"], "--offload"),
        (["--zero", "3", "--offload", "nvme"], "--nvme-path"),
        (["--micro-batch", "3", "--global-batch", "8"], "--global-batch"),
        (["--precision", "fp16"], "--precision: fp16 needs a CUDA GPU"),
        (["--precision", "fp8"], "--precision"),
        (["--gpus", "0"], "--gpus"),
        (["--set", "zero.stagee=1"], "did you mean zero.stage?"),
        (["--preset", "huge"], "--preset: unknown preset 'huge'"),
    ],
)
def test_config_command_rejects_bad_input_with_one_line(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _in_process(capsys, "config", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_config_command_under_fsdp2_prints_the_fsdp2_plan_not_a_deepspeed_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fsdp2 = ["--engine", "fsdp2", "--zero", "2", "--offload", "cpu", "--gpus", "2"]
    # bf16 named: the default, auto, is fp32 on a CPU without native bf16.
    out = _in_process(capsys, "config", "--preset", "debug", *fsdp2, "--precision", "bf16")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert "zero_optimization" not in plan and plan["engine"] == "fsdp2"
    units = plan["fully_shard"]
    assert units["units"] == ["layers.0", "layers.1", "root"]  # the debug preset's two blocks, then the root
    assert (units["reshard_after_forward"], units["offload_policy"]) == (False, "cpu")
    assert units["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    # The default global batch: one micro-batch of 8 per data-parallel rank.
    assert (plan["train_batch_size"], plan["gradient_accumulation_steps"]) == (16, 1)
    assert plan["mesh"] == {"replicate": 1, "shard": 2, "tp": 1}  # one node: sharded over all its ranks
    two_nodes = _in_process(capsys, "config", "--preset", "debug", *fsdp2, "--nodes", "2")
    assert json.loads(two_nodes.stdout)["mesh"] == {
        "replicate": 2,
        "shard": 2,
        "tp": 1,
    }  # HSDP: a node's ranks shard
