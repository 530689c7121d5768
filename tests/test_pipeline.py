"""Pipeline parallelism on DeepSpeed's pipeline engine (CPU, gloo, ZeRO 1).

- Trajectories (fp32, 10 steps): pp 2 on 2 processes under 1F1B and GPipe, with untied and tied
  embeddings and with document masking, and dp 2 x pp 2 and tp 2 x pp 2 (llmtrain's tensor-parallel
  layers inside each stage, 1F1B and GPipe) on 4, and dp 2 x tp 2 x pp 2 on 8, give the losses of one
  process on the same global batch to a relative 1e-5; GPipe's equal 1F1B's bitwise (same
  accumulation order).
- bf16 with ZeRO 1 trains under pp 2, tp 2 x pp 2 and dp 2 x tp 2 x pp 2, following one bf16 process to 1e-3.
- A NaN loss on the first stage (which computes no loss itself) skips that update on every rank.
- Through the command line: SIGKILL mid-run and `resume` under `--pp 2` give every step's loss, lr and
  grad norm bitwise equal to the uninterrupted run's; under dp 2 x tp 2 x pp 2 the steps logged before
  the kill are recomputed bit for bit, and the checkpoint resumes on 4 processes with or without tp and
  pp, following the 8-process run to 1e-5.
- Each stage starts from exactly the weights of a one-process build (init_stage_weights).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trainkit
from dist import run_distributed
from runkit import (
    assert_recomputed_bitwise,
    assert_resumed_bitwise,
    kill_after_a_checkpoint,
    last_logged_step,
    latest,
    losses,
    metrics,
    resume_args,
    run_ok,
    shm_buffers,
    train_args,
)
from test_parallel import REL_TOL, _rel_diff, _short_documents

pytestmark = pytest.mark.slow

STEPS = 10
COMMON: dict[str, Any] = {
    "preset": "debug",
    "model.num_hidden_layers": 4,  # two blocks a stage, so partitioning is exercised
    "train.seq_len": 32,
    "train.micro_batch": 2,
    "train.global_batch": 8,  # m = 4 micro-batches per pipeline at dp 1, 2 at dp 2
    "train.precision": "fp32",
    "train.steps": STEPS,
    "logging.log_every": 1,
    "optim.lr": 1e-3,
    "schedule.warmup_steps": 2,
    "zero.stage": 1,
}
TIED = {"model.tie_word_embeddings": True}
DOCS = {"data.document_masking": True}
PP2 = {"parallel.pp": 2}
BF16 = {"train.precision": "bf16", "train.steps": 6}
REFERENCES: dict[str, dict[str, Any]] = {
    "batch8": {},
    "batch8_tied": TIED,
    "batch8_docs": DOCS,
    "batch8_bf16": BF16,
}
TWO: dict[str, tuple[str, dict[str, Any]]] = {
    "pp2_1f1b": ("batch8", PP2),
    "pp2_gpipe": ("batch8", {**PP2, "parallel.pp_schedule": "gpipe"}),
    "pp2_blocks": ("batch8", {**PP2, "parallel.pp_partition": "blocks"}),
    "pp2_tied": ("batch8_tied", {**PP2, **TIED}),
    "pp2_docs": ("batch8_docs", {**PP2, **DOCS}),
}
TP2 = {"parallel.tp": 2}
FOUR: dict[str, tuple[str, dict[str, Any]]] = {
    "dp2_pp2": ("batch8", PP2),
    "tp2_pp2": ("batch8", {**PP2, **TP2}),
    "tp2_pp2_gpipe": ("batch8", {**PP2, **TP2, "parallel.pp_schedule": "gpipe"}),
}
# 3D: data x tensor x pipeline parallelism in one run (about 40 s on 2 cores for 8 processes), then the
# estimator's calibration at the same layout (about 15 s more).
EIGHT: dict[str, tuple[str, dict[str, Any]]] = {"dp2_tp2_pp2": ("batch8", {**PP2, **TP2})}

# Rank 0 is the first stage: it has no loss of its own, yet its poisoned share must skip the step.
NAN_FAULT, NAN_STEPS = "nan_loss@0:1", 4


def _with_data(root: Path, scenarios: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    docs = str(root / "short_docs.jsonl")
    return {
        n: {**COMMON, **f, **({"data.source": docs} if "docs" in n else {})} for n, f in scenarios.items()
    }


def _train_two(rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from llmtrain.train.metrics import METRICS_FILE, read_metrics

    out = {n: run["losses"] for n, run in trainkit.train_all(rank, world_size, root, scenarios).items()}
    nan_dir = str(Path(root) / "nan")
    trainkit.build(rank, world_size, nan_dir, {**COMMON, **PP2, "train.steps": NAN_STEPS}, NAN_FAULT).train()
    out["nan"] = [r for r in read_metrics(Path(nan_dir) / METRICS_FILE) if "loss" in r] if rank == 0 else None
    return out


def _train(rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {n: run["losses"] for n, run in trainkit.train_all(rank, world_size, root, scenarios).items()}


def _calibration_config(precision: str) -> Any:
    from llmtrain.config import resolve

    return resolve(flags={**COMMON, **PP2, **TP2, "train.precision": precision, "launch.gpus": 8})


def _train_and_measure(
    rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The 3D trajectories, then each precision's dp 2 x tp 2 x pp 2 engine's model-state bytes as its
    second reduction starts (test_memory_calibration's measurement): (stage, bytes) of every rank."""
    import torch
    import torch.distributed as dist
    from test_memory_calibration import _held_before_second_reduction

    from llmtrain.engine import pipeline
    from llmtrain.planning import dsconfig

    out = _train(rank, world_size, root, scenarios)
    for precision in ("bf16", "fp32"):
        cfg = _calibration_config(precision)
        ds = dsconfig.build(cfg, world_size, "cpu")
        engine = pipeline.build_engine(cfg, ds, torch.device("cpu"), world_size).ds
        stage = engine.stage_id
        held: list[Any] = [None] * world_size
        dist.all_gather_object(held, (stage, _held_before_second_reduction(engine)))
        out[f"held_{precision}"] = held
    return out


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipeline")
    _short_documents(root / "short_docs.jsonl")

    def launch(fn: Any, world_size: int, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = run_distributed(
            fn, world_size, str(root / f"ws{world_size}"), _with_data(root, scenarios), timeout=900
        )[0]
        return out

    out = launch(_train, 1, REFERENCES)
    out.update(launch(_train_two, 2, {**{n: f for n, (_, f) in TWO.items()}, "pp2_bf16": {**PP2, **BF16}}))
    out.update(
        launch(_train, 4, {**{n: f for n, (_, f) in FOUR.items()}, "tp2_pp2_bf16": {**PP2, **TP2, **BF16}})
    )
    out.update(
        launch(
            _train_and_measure,
            8,
            {**{n: f for n, (_, f) in EIGHT.items()}, "dp2_tp2_pp2_bf16": {**PP2, **TP2, **BF16}},
        )
    )
    return out


@pytest.mark.parametrize("name", [*TWO, *FOUR, *EIGHT])
def test_pipeline_run_follows_the_one_process_trajectory(trajectories: dict[str, Any], name: str) -> None:
    reference_name = {**TWO, **FOUR, **EIGHT}[name][0]
    reference, got = trajectories[reference_name], trajectories[name]
    assert len(reference) == len(got) == STEPS
    assert reference[-1] < reference[0]  # it trains at all
    assert _rel_diff(got, reference) < REL_TOL, (name, got, reference)


# Every term is exact up to DeepSpeed's alignment padding: bf16 (BF16_Optimizer) and fp32
# (DeepSpeedZeroOptimizer, whose per-parameter shape records on the meta device hold no memory).
CALIBRATION_TOLERANCE = 0.01


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_3d_estimate_matches_every_ranks_engine(trajectories: dict[str, Any], precision: str) -> None:
    """estimate-memory's per-stage model states for dp 2 x tp 2 x pp 2 (vocab-parallel embedding and
    output layer, ZeRO 1 over the data group) against the state bytes each of the 8 ranks' engines holds."""
    from llmtrain.planning import memory

    report = memory.estimate(memory.setup_from_config(_calibration_config(precision))).to_dict()
    per_stage = [stage["model_states_bytes"] for stage in report["pipeline"]["per_stage"]]
    held = trajectories[f"held_{precision}"]
    assert sorted(stage for stage, _ in held) == [0, 0, 0, 0, 1, 1, 1, 1]
    errors = [(per_stage[stage] - measured) / measured for stage, measured in held]
    print(precision, [f"{e:+.3%}" for e in errors])
    assert max(abs(e) for e in errors) <= CALIBRATION_TOLERANCE, errors


def test_gpipe_and_1f1b_give_the_same_updates(trajectories: dict[str, Any]) -> None:
    assert trajectories["pp2_gpipe"] == trajectories["pp2_1f1b"]
    assert trajectories["tp2_pp2_gpipe"] == trajectories["tp2_pp2"]


def test_the_references_differ_where_the_model_or_data_does(trajectories: dict[str, Any]) -> None:
    """The comparisons above can fail: tied embeddings or document masking move the losses."""
    assert _rel_diff(trajectories["batch8_tied"], trajectories["batch8"]) > 1e-3
    assert _rel_diff(trajectories["batch8_docs"], trajectories["batch8"]) > 1e-4


@pytest.mark.parametrize("name", ["pp2_bf16", "tp2_pp2_bf16", "dp2_tp2_pp2_bf16"])
def test_bf16_zero1_pipeline_trains(trajectories: dict[str, Any], name: str) -> None:
    got = trajectories[name]
    assert len(got) == BF16["train.steps"] and all(math.isfinite(x) for x in got)
    assert got[-1] < got[0]
    # The one-process bf16 run's losses, up to bf16 rounding of the pipeline's own summation order.
    assert _rel_diff(got, trajectories["batch8_bf16"]) < 1e-3


def test_a_nan_loss_on_the_first_stage_skips_the_update_on_every_rank(trajectories: dict[str, Any]) -> None:
    records = trajectories["nan"]
    assert [r["step"] for r in records] == list(range(1, NAN_STEPS + 1))
    assert records[1]["loss"] is None and records[1]["skipped"] == 1  # metrics.jsonl writes NaN as null
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 1)
    # The skipped step changed nothing: step 3 trains from step 1's weights, so its loss is finite and
    # the run's final skip count is one.
    assert records[-1]["skipped"] == 1


# ---------------------------------------------------------------- the stages' initial weights


def _stage_weights(rank: int, world_size: int, root: str, flags: dict[str, Any]) -> dict[str, Any]:
    """Every stage's parameters by model.py names, gathered on rank 0 (as numpy arrays: torch tensors
    would cross the result queue as shared memory that is gone once the worker exits)."""
    import torch.distributed as dist

    from llmtrain.engine import pipeline

    trainer = trainkit.build(rank, world_size, root, flags)
    local = {n: p.detach().numpy().copy() for n, p in pipeline.named_parameters(trainer.engine.module)}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    return {n: t for part in gathered for n, t in part.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_every_stage_starts_from_the_one_process_weights(tmp_path: Path, tied: bool) -> None:
    import torch

    from llmtrain.config import resolve
    from llmtrain.model import build_model

    flags = {**COMMON, **PP2, **(TIED if tied else {})}
    got = run_distributed(_stage_weights, 2, str(tmp_path / "run"), flags, timeout=300)[0]
    cfg = resolve(flags={**flags, "launch.gpus": 2})
    expected = build_model(cfg.model, seed=cfg.train.seed).state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(torch.from_numpy(got[name]), tensor), name


# ---------------------------------------------------------------- SIGKILL and resume, through the CLI

KILL_STEPS, SAVE_EVERY = 12, 4
TIMEOUT_S = 300
PIPELINE = ["--pp", "2", "--global-batch", "4", "--set", "model.num_hidden_layers=4"]


def test_sigkill_then_resume_is_bitwise_exact_under_pp(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference_args = train_args(reference, KILL_STEPS, SAVE_EVERY, *PIPELINE)
    run_ok(reference_args, tmp_path / "reference.log", TIMEOUT_S)
    # A finished run leaves none of DeepSpeed's 69 MB shared-memory all-reduce buffers behind.
    assert shm_buffers(reference_args) == []
    args = train_args(killed, KILL_STEPS, SAVE_EVERY, *PIPELINE)
    kill_after_a_checkpoint(args, killed, tmp_path / "killed.log", SAVE_EVERY, TIMEOUT_S)
    assert last_logged_step(killed) < KILL_STEPS, "the run ended before the kill"

    run_ok(resume_args(killed), tmp_path / "resume.log", TIMEOUT_S)
    assert_resumed_bitwise(reference, killed, KILL_STEPS)
    assert np.isfinite(list(losses(killed).values())).all()


def test_sigkill_then_resume_is_bitwise_exact_in_3d(tmp_path: Path) -> None:
    """dp 2 x tp 2 x pp 2 on 8 processes: DeepSpeed's per-layer, per-tp-rank files and the optimizer
    shards of each data rank restore every rank's slices (the steps logged before the kill are recomputed
    bit for bit). Then the same checkpoint, converted once to the universal format (tp slices merged by the
    split the checkpoint records, the pipeline's names made the model's), resumes on two other layouts of
    4 processes: a node lost (tp 2 x pp 2 at dp 1) and neither tp nor pp (dp 4). Both follow the resumed
    8-process run within 1e-5. About two and a half minutes on 2 cores."""
    layout = ["--pp", "2", "--tp", "2", "--global-batch", "8", "--set", "model.num_hidden_layers=4"]
    killed = tmp_path / "killed"
    args = train_args(killed, KILL_STEPS, SAVE_EVERY, *layout, gpus=8)
    kill_after_a_checkpoint(args, killed, tmp_path / "killed.log", SAVE_EVERY, TIMEOUT_S)
    assert last_logged_step(killed) < KILL_STEPS, "the run ended before the kill"
    before_kill, checkpoint = metrics(killed), latest(killed)
    assert checkpoint is not None
    node_lost = shutil.copytree(killed, tmp_path / "node_lost")
    relaid = shutil.copytree(killed, tmp_path / "relaid")
    run_ok(resume_args(killed), tmp_path / "resume.log", TIMEOUT_S)
    assert_recomputed_bitwise(before_kill, checkpoint, killed, KILL_STEPS)

    run_ok(resume_args(node_lost, "--gpus", "4"), tmp_path / "node_lost.log", TIMEOUT_S)
    _assert_continues(killed, node_lost)
    run_ok(resume_args(relaid, "--gpus", "4", "--tp", "1", "--pp", "1"), tmp_path / "relaid.log", TIMEOUT_S)
    _assert_continues(killed, relaid)


def _resumed_from(run_dir: Path) -> int:
    """The step of the one checkpoint `run_dir` resumed from on another layout (converted once)."""
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith("_universal"))
    assert len(saved) == 1, saved
    return int(saved[0].split("_")[1])


def _assert_continues(reference: Path, resumed: Path) -> None:
    ref, got = losses(reference), losses(resumed)
    steps = range(_resumed_from(resumed) + 1, KILL_STEPS + 1)
    assert _rel_diff([got[s] for s in steps], [ref[s] for s in steps]) < REL_TOL
