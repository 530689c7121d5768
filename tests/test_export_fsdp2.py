"""export / eval / generate / runs from FSDP2 checkpoints (torch.distributed.checkpoint): the weights a
DeepSpeed run of the same configuration ends with.

One configuration trains through the real entry point on DeepSpeed (one process, ZeRO 1) and on FSDP2
(`--gpus 2 --zero 3`); both run exact AdamW in fp32 with one thread per process, so they differ only in
summation order. A third run, FSDP2 with tied embeddings on one process, checks that the tie survives
the distributed checkpoint (one tensor saved, the output layer rebuilt from it).
"""

from __future__ import annotations

import json
from pathlib import Path

import exportkit
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 4
TAG = f"step_{STEPS:08d}"
# Adam's eps 1e-6, as in test_export_parallel: an element whose gradient is near eps would magnify a
# last-bit difference in summation order past the tolerance.
TRAIN_ARGS = [
    "--preset", "debug", "--steps", str(STEPS), "--micro-batch", "2", "--global-batch", "4",
    "--seq-len", "32", "--save-every", str(STEPS), "--log-every", "1", "--precision", "fp32",
    "--set", "optim.eps=1e-6",
]  # fmt: skip
TIED = ["--set", "model.tie_word_embeddings=true"]
RUNS = {
    "deepspeed": ["--zero", "1"],
    "fsdp2": ["--engine", "fsdp2", "--zero", "3", "--gpus", "2"],
    "fsdp2_tied": ["--engine", "fsdp2", "--zero", "3", *TIED],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three run directories: the one-process runs side by side, then the 2-process one alone (its
    ranks busy-wait in collectives and would starve another job on 2 cores)."""
    base = tmp_path_factory.mktemp("fsdp2_runs")
    singles = {
        name: exportkit.start(base, name, [*TRAIN_ARGS, *RUNS[name]]) for name in ("deepspeed", "fsdp2_tied")
    }
    for name, proc in singles.items():
        exportkit.finish(base, name, proc)
    exportkit.finish(base, "fsdp2", exportkit.start(base, "fsdp2", [*TRAIN_ARGS, *RUNS["fsdp2"]]))
    return {name: base / name for name in RUNS}


def test_the_checkpoint_is_a_distributed_checkpoint_with_a_shard_per_rank(runs: dict[str, Path]) -> None:
    names = {p.name for p in (runs["fsdp2"] / "checkpoints" / TAG).iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"} <= names
    manifest = json.loads((runs["fsdp2"] / "checkpoints" / TAG / "manifest.json").read_text())
    assert (manifest["engine"], manifest["zero_stage"], manifest["world_size"]) == ("fsdp2", 3, 2)
    assert not manifest["partitioned"]  # another world size loads it directly: no conversion
    plan = json.loads((runs["fsdp2"] / "fsdp2_plan.json").read_text())  # what the engine was built with
    assert plan["fully_shard"]["reshard_after_forward"] and not (runs["fsdp2"] / "ds_config.json").exists()


def test_consolidated_weights_equal_deepspeeds(runs: dict[str, Path]) -> None:
    ours, reference = (
        exportkit.consolidated(runs["fsdp2"], TAG),
        exportkit.consolidated(runs["deepspeed"], TAG),
    )
    assert sorted(ours) == sorted(reference)
    for key, tensor in reference.items():
        assert ours[key].dtype == torch.float32 and ours[key].shape == tensor.shape, key
        assert np.allclose(ours[key].numpy(), tensor.numpy(), rtol=1e-5, atol=1e-7), key


def test_export_writes_the_consolidated_weights_under_hugging_face_names(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    exportkit.run_cli(capsys, "export", str(runs["fsdp2"]), "--out", str(out))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported, weights = load_file(str(out / "model.safetensors")), exportkit.consolidated(runs["fsdp2"], TAG)
    assert len(exported) == len(weights)
    for key, tensor in weights.items():
        hf_key = key if key == "lm_head.weight" else f"model.{key}"
        assert torch.equal(exported[hf_key], tensor), key


def test_tied_embeddings_are_saved_once_and_exported_tied(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = exportkit.consolidated(runs["fsdp2_tied"], TAG)
    assert "embed_tokens.weight" in weights and "lm_head.weight" not in weights
    out = tmp_path / "tied"
    exportkit.run_cli(capsys, "export", str(runs["fsdp2_tied"]), "--out", str(out))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert torch.equal(
        load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"], weights["embed_tokens.weight"]
    )


def test_eval_generate_and_runs_read_fsdp2_checkpoints(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # The same batches for both (by default eval covers eval_batches per data-parallel rank: 1 vs 2).
    argv = ["--batches", "8", "--json"]
    evals = [
        json.loads(exportkit.run_cli(capsys, "eval", str(runs[r]), *argv)) for r in ("deepspeed", "fsdp2")
    ]
    assert evals[0]["batches"] == evals[1]["batches"] == 8
    assert evals[1]["val_loss"] == pytest.approx(evals[0]["val_loss"], abs=1e-5)
    argv = ["--prompt", "The", "--temperature", "0", "--max-tokens", "24"]
    texts = [exportkit.run_cli(capsys, "generate", str(runs[r]), *argv) for r in ("deepspeed", "fsdp2")]
    assert len(texts[0]) > len("The") + 10 and texts[1] == texts[0]
    listing = exportkit.run_cli(capsys, "runs", str(runs["fsdp2"]))
    assert "fsdp2 3 / 2" in listing
