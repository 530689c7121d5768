"""export / eval / generate from a pipeline-parallel checkpoint: the 1-process model's weights.

One configuration trains three times through the real entry point: one process, `--gpus 2 --pp 2`
and `--gpus 8 --tp 2 --pp 2` (dp 2 x tp 2 x pp 2; ZeRO 1, fp32, one thread per process). All see the
same 8 sequences per step, so their trajectories agree to rounding. The pipeline checkpoint has no module
weights in its `mp_rank_XX` files (there XX is the stage): its weights must come from each stage's
optimizer shards, renamed from DeepSpeed's layer-indexed names to model.py's.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import exportkit
import pytest
import torch
from safetensors.torch import load_file

from llmtrain.checkpoint import consolidated_fp32_state_dict, weights_only_loads
from llmtrain.checkpoint.consolidate import model_name

STEPS = 4
TAG = f"step_{STEPS:08d}"
NUM_BLOCKS = 2  # the debug preset's
# Adam's eps 1e-6 instead of 1e-8, as in test_export_parallel: an element whose gradient is near eps
# would otherwise magnify a last-bit difference in summation order past the tolerance.
TRAIN_ARGS = [
    "--preset", "debug", "--steps", str(STEPS), "--micro-batch", "2", "--global-batch", "8",
    "--seq-len", "32", "--save-every", str(STEPS), "--log-every", "1", "--precision", "fp32",
    "--zero", "1", "--set", "optim.eps=1e-6",
]  # fmt: skip
RUNS = {
    "one": [],
    "pp2": ["--gpus", "2", "--pp", "2"],
    "dp2_tp2_pp2": ["--gpus", "8", "--tp", "2", "--pp", "2"],
}
PIPELINES = ["pp2", "dp2_tp2_pp2"]
RTOL = 1e-6
# tp splits the matmuls, so its sums run in another order: single elements differ from the one-process
# run by up to ~2e-7 after 4 steps (test_export_parallel's bound); a misplaced slice would be off by the
# weights' own scale (~1e-2).
TP_ATOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run directories, trained side by side (about 70 s on 2 otherwise idle cores)."""
    base = tmp_path_factory.mktemp("pipeline_runs")
    procs = {name: exportkit.start(base, name, [*TRAIN_ARGS, *RUNS[name]]) for name in RUNS}
    for name, proc in procs.items():
        exportkit.finish(base, name, proc)
    return {name: base / name for name in RUNS}


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference over the largest magnitude: elements near zero do not inflate it."""
    return float((ours - reference).abs().max() / reference.abs().max())


def _close(run: str, ours: torch.Tensor, reference: torch.Tensor) -> bool:
    if "tp" in run:
        return torch.allclose(ours, reference, rtol=1e-5, atol=TP_ATOL)
    return _relative_error(ours, reference) <= RTOL


@pytest.mark.slow
def test_pipeline_checkpoint_has_stage_files_not_tp_ranks(runs: dict[str, Path]) -> None:
    """What the consolidation relies on: layer files, and mp_rank files per stage holding no module."""
    ckpt = runs["pp2"] / "checkpoints" / TAG
    names = {p.name for p in ckpt.glob("*.pt")}
    assert {f"layer_{i:02d}-model_states.pt" for i in range(NUM_BLOCKS + 3)} <= names
    with weights_only_loads():
        for stage in range(2):
            model = torch.load(ckpt / f"mp_rank_{stage:02d}_model_states.pt", weights_only=True)
            assert model["module"] is None and model["param_shapes"], stage


@pytest.mark.slow
def test_a_tp_pipeline_checkpoint_names_its_tp_rank_in_each_layer_file(runs: dict[str, Path]) -> None:
    """What the consolidation of tp x pp relies on: `layer_NN-model_TT-` files, one per layer and tp rank,
    and one model file per model-parallel rank (stage x tp)."""
    names = {p.name for p in (runs["dp2_tp2_pp2"] / "checkpoints" / TAG).glob("*.pt")}
    layers = {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(NUM_BLOCKS + 3) for t in range(2)}
    assert layers <= names
    assert {f"mp_rank_{r:02d}_model_states.pt" for r in range(4)} <= names


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPELINES)
def test_consolidated_weights_equal_the_one_process_ones(runs: dict[str, Path], name: str) -> None:
    ours, reference = exportkit.consolidated(runs[name], TAG), exportkit.consolidated(runs["one"], TAG)
    assert sorted(ours) == sorted(reference)
    for key, tensor in reference.items():
        assert ours[key].dtype == torch.float32 and ours[key].shape == tensor.shape, key
        assert _close(name, ours[key], tensor), key


@pytest.mark.slow
def test_masters_match_the_layer_files_exactly(runs: dict[str, Path]) -> None:
    """At fp32 each layer file holds the live weights the optimizer's masters are: equal bit for bit
    once renamed, so no fragment is misplaced whatever the trajectories do."""
    full = exportkit.consolidated(runs["pp2"], TAG)
    ckpt = runs["pp2"] / "checkpoints" / TAG
    seen = set()
    with weights_only_loads():
        for index in range(NUM_BLOCKS + 3):
            layer = torch.load(ckpt / f"layer_{index:02d}-model_states.pt", weights_only=True)
            for local, tensor in layer.items():
                name = model_name(f"{index}.{local}", NUM_BLOCKS)
                assert torch.equal(full[name], tensor), name
                seen.add(name)
    assert seen == set(full)


@pytest.mark.slow
def test_bf16_optimizer_shards_consolidate_alike(runs: dict[str, Path], tmp_path: Path) -> None:
    """A bf16 run's shards are DeepSpeed's BF16_Optimizer's: named `bf16_zero_pp_rank_...`, with the
    same flat fp32 partitions and slice mappings but none of ZeRO's bookkeeping (no `zero_stage`).
    The fp32 run's shards rewritten so (keeping exactly a bf16 shard's keys) give the same weights."""
    bf16_keys = {"clip_grad", "base_optimizer_state", "single_partition_of_fp32_groups"}
    bf16_keys |= {"group_paddings", "partition_count", "param_slice_mappings"}
    root = tmp_path / "checkpoints"
    shutil.copytree(runs["pp2"] / "checkpoints" / TAG, root / TAG)
    with weights_only_loads():
        for shard in list((root / TAG).glob("zero_pp_rank_*_optim_states.pt")):
            state = torch.load(shard, weights_only=True)
            osd = state["optimizer_state_dict"]
            state["optimizer_state_dict"] = {key: osd[key] for key in bf16_keys}
            torch.save(state, shard.with_name(f"bf16_{shard.name}"))
            shard.unlink()
    with contextlib.redirect_stdout(io.StringIO()):
        ours = consolidated_fp32_state_dict(root, TAG)
    reference = exportkit.consolidated(runs["pp2"], TAG)
    assert sorted(ours) == sorted(reference)
    assert all(torch.equal(ours[key], tensor) for key, tensor in reference.items())


def test_pipeline_names_becomemodel_names() -> None:
    """DeepSpeed's `<layer>.<name>` (embedding 0, blocks 1..L, norm L+1, head L+2) and a tied module's
    `tied_modules.<key>.<name>` (the embedding, on the first and last stage) -> model.py's names."""
    expected = {
        "0.embed_tokens.weight": "embed_tokens.weight",
        "1.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
        "2.mlp.down_proj.weight": "layers.1.mlp.down_proj.weight",
        "3.norm.weight": "norm.weight",
        "4.lm_head.weight": "lm_head.weight",
        "tied_modules.embed.embed_tokens.weight": "embed_tokens.weight",
    }
    assert {name: model_name(name, NUM_BLOCKS) for name in expected} == expected


@pytest.mark.slow
def test_export_of_a_pipeline_run_writes_the_one_process_weights(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exported = {}
    for name in RUNS:
        exportkit.run_cli(capsys, "export", str(runs[name]), "--out", str(tmp_path / name))
        exported[name] = load_file(str(tmp_path / name / "model.safetensors"))
    for name in PIPELINES:
        assert sorted(exported[name]) == sorted(exported["one"])
        for key, tensor in exported["one"].items():
            assert _close(name, exported[name][key], tensor), (name, key)


@pytest.mark.slow
def test_eval_and_greedy_generate_match_the_one_process_run(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # The same 8 validation batches for every run (by default eval covers a run's own evaluation: its
    # eval_batches per data-parallel rank, 16 at dp 2).
    argv = ["--json", "--batches", "8"]
    evals = [json.loads(exportkit.run_cli(capsys, "eval", str(runs[name]), *argv)) for name in RUNS]
    for ours in evals[1:]:
        assert ours["batches"] == evals[0]["batches"] == 8
        assert ours["val_loss"] == pytest.approx(evals[0]["val_loss"], abs=1e-5)
    argv = ["--prompt", "The", "--temperature", "0", "--max-tokens", "24"]
    texts = [exportkit.run_cli(capsys, "generate", str(runs[name]), *argv) for name in RUNS]
    assert len(texts[0]) > len("The") + 10
    assert texts[1:] == [texts[0]] * len(PIPELINES)
