"""Tensor and sequence parallelism on the real DeepSpeed engine (CPU, gloo, fp32).

- Trajectories: 10 steps of tp 2 and sp 2 on 2 processes, and of dp 2 x tp 2, dp 2 x sp 2 and
  tp 2 x sp 2 on 4, each with ZeRO 1 and ZeRO 3 (tp 2 also with ZeRO 2, sp also with document masking),
  give the losses of one process on the same global batch, to a relative 1e-5 (tp with the
  vocab-parallel embedding and loss); tp 2 (ZeRO 1 and 3), dp 2 x tp 2 (ZeRO 3), sp 2 and tp 2 x sp 2 (ZeRO 1) in bf16 those
  of one bf16 process to 1e-3. One launch per world size: the scenarios build their engines in turn.
- DeepSpeed's activation checkpointing at tp 2 (block inputs partitioned over the tp ranks, in host
  memory, both) follows the same run through torch's checkpoint to 1e-5; partitioned, each block keeps
  exactly 1/tp of its input, as the estimator counts it.
- A NaN loss on one rank skips that update on every rank of a tp or an sp group.
- Through the command line: `train --gpus 2 --tp 2` (and --sp 2) follows a one-process `train` to 1e-5;
  SIGKILL mid-run and `resume` give every step's loss, lr and grad norm bitwise equal to the
  uninterrupted run's. (Resuming on another data-parallel size: test_pipeline's 3D test.)
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trainkit
from dist import run_distributed
from runkit import (
    assert_resumed_bitwise,
    kill_after_a_checkpoint,
    last_logged_step,
    losses,
    resume_args,
    run_ok,
    train_args,
)

pytestmark = pytest.mark.slow

STEPS = 10
COMMON: dict[str, Any] = {
    "preset": "debug",  # 4 heads, 2 key/value heads, MLP width 176: all divisible by 2
    "train.seq_len": 32,
    "train.micro_batch": 2,
    "train.precision": "fp32",
    "train.steps": STEPS,
    "logging.log_every": 1,
    "optim.lr": 1e-3,
    "schedule.warmup_steps": 2,
}
WORDS = [
    "the",
    "a",
    "model",
    "trains",
    "on",
    "short",
    "documents",
    "of",
    "words",
    "and",
    "every",
    "rank",
    "keeps",
    "its",
    "slice",
    "of",
    "each",
]


def _short_documents(path: Path) -> Path:
    """Documents of 3-12 words: most 32-token windows span several, so document masking matters."""
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 13))) for _ in range(600)]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


# One process; the global batch of the runs compared with each (dp 1: 2 sequences, dp 2: 4).
REFERENCES: dict[str, dict[str, Any]] = {
    "batch2": {},
    "batch2_docs": {"data.document_masking": True},
    "batch2_docs_unmasked": {},
    "batch4": {"train.global_batch": 4},
    "batch2_bf16": {"train.precision": "bf16"},
    "batch4_bf16": {"train.global_batch": 4, "train.precision": "bf16"},
    "batch2_mha": {"model.num_key_value_heads": 4},  # 4 key/value heads: tp 2 x sp 2 splits them
    "batch2_mha_bf16": {"model.num_key_value_heads": 4, "train.precision": "bf16"},
}
TP2_SP2 = {"parallel.tp": 2, "parallel.sp": 2, "model.num_key_value_heads": 4}
FSDP2 = {"train.engine": "fsdp2"}
TWO: dict[str, tuple[str, dict[str, Any]]] = {
    "sp2_zero1": ("batch2", {"parallel.sp": 2, "zero.stage": 1}),
    "sp2_zero3": ("batch2", {"parallel.sp": 2, "zero.stage": 3}),
    "sp2_zero1_docs": ("batch2_docs", {"parallel.sp": 2, "zero.stage": 1, "data.document_masking": True}),
    "tp2_zero1": ("batch2", {"parallel.tp": 2, "zero.stage": 1}),
    "tp2_zero2": ("batch2", {"parallel.tp": 2, "zero.stage": 2}),
    "tp2_zero3": ("batch2", {"parallel.tp": 2, "zero.stage": 3}),
    "tp2_zero1_bf16": ("batch2_bf16", {"parallel.tp": 2, "zero.stage": 1, "train.precision": "bf16"}),
    "tp2_zero3_bf16": ("batch2_bf16", {"parallel.tp": 2, "zero.stage": 3, "train.precision": "bf16"}),
    "sp2_zero1_bf16": ("batch2_bf16", {"parallel.sp": 2, "zero.stage": 1, "train.precision": "bf16"}),
    # FSDP2 with DTensor tp (parallel.dtensor_tp): torch's column/row-wise styles, llmtrain's vocab-parallel loss
    "fsdp2_tp2_zero3": ("batch2", {**FSDP2, "parallel.tp": 2, "zero.stage": 3}),
    "fsdp2_tp2_zero2_bf16": (
        "batch2_bf16",
        {**FSDP2, "parallel.tp": 2, "zero.stage": 2, "train.precision": "bf16"},
    ),
}
FOUR: dict[str, tuple[str, dict[str, Any]]] = {
    "dp2_sp2_zero1": ("batch4", {"parallel.sp": 2, "zero.stage": 1}),
    "dp2_sp2_zero3": ("batch4", {"parallel.sp": 2, "zero.stage": 3}),
    "dp2_tp2_zero1": ("batch4", {"parallel.tp": 2, "zero.stage": 1}),
    "dp2_tp2_zero3": ("batch4", {"parallel.tp": 2, "zero.stage": 3}),
    "dp2_tp2_zero3_bf16": ("batch4_bf16", {"parallel.tp": 2, "zero.stage": 3, "train.precision": "bf16"}),
    "tp2_sp2_zero1": ("batch2_mha", {**TP2_SP2, "zero.stage": 1}),
    "tp2_sp2_zero3": ("batch2_mha", {**TP2_SP2, "zero.stage": 3}),
    "tp2_sp2_zero1_bf16": ("batch2_mha_bf16", {**TP2_SP2, "zero.stage": 1, "train.precision": "bf16"}),
    # tp 4 over 2 key/value heads: each held by two ranks (planning.partition's rule)
    "tp4_zero1": ("batch2", {"parallel.tp": 4, "zero.stage": 1}),
    "tp4_zero3": ("batch2", {"parallel.tp": 4, "zero.stage": 3}),
    "fsdp2_dp2_tp2_zero3": ("batch4", {**FSDP2, "parallel.tp": 2, "zero.stage": 3}),
    # HSDP x tp: a replicate x shard x tp mesh of 2 x 1 x 2
    "fsdp2_hsdp2_tp2_zero3": ("batch4", {**FSDP2, "parallel.tp": 2, "parallel.dp_shard": 1, "zero.stage": 3}),
}

# DeepSpeed's activation checkpointing at tp 2 against the same run recomputed through torch's checkpoint:
# block inputs partitioned over the tp ranks, in host memory, and both.
RECOMPUTED: dict[str, Any] = {"parallel.tp": 2, "zero.stage": 1, "train.activation_checkpointing": "full"}
CHECKPOINTED: dict[str, dict[str, Any]] = {
    "tp2_full": RECOMPUTED,
    "tp2_full_partitioned": {**RECOMPUTED, "train.partition_activations": True},
    "tp2_full_cpu": {**RECOMPUTED, "train.cpu_checkpointing": True},
    "tp2_full_partitioned_cpu": {
        **RECOMPUTED,
        "train.partition_activations": True,
        "train.cpu_checkpointing": True,
    },
}

# A NaN loss on rank 1 only, at step 2 (0-based 1), in 4-step runs at world size 2.
NAN_FAULT, NAN_STEPS = "nan_loss@1:1", 4


def _train(rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = trainkit.train_all(rank, world_size, root, {n: {**COMMON, **f} for n, f in scenarios.items()})
    return {name: run["losses"] for name, run in out.items()}


def _nan_skips(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each axis at world size 2 with rank 1's loss poisoned once: rank 0 returns the logged records."""
    from llmtrain.train.metrics import METRICS_FILE, read_metrics

    out = {}
    for axis in ("sp", "tp"):
        run_dir = str(Path(root) / f"nan_{axis}")
        flags = {**COMMON, f"parallel.{axis}": 2, "zero.stage": 1, "train.steps": NAN_STEPS}
        trainkit.build(rank, world_size, run_dir, flags, faults=NAN_FAULT).train()
        out[axis] = (
            [r for r in read_metrics(Path(run_dir) / METRICS_FILE) if "loss" in r] if rank == 0 else None
        )
    return out


def _checkpointed_inputs(rank: int, world_size: int, root: str) -> list[list[int]]:
    """What each checkpointed block of the partitioned tp 2 run keeps for its recompute after one
    forward: the element counts of the inputs DeepSpeed's checkpoint nodes in the autograd graph hold
    back (the partitions of the inputs it emptied in place)."""
    import torch

    flags = {**COMMON, **CHECKPOINTED["tp2_full_partitioned"]}
    trainer = trainkit.build(rank, world_size, str(Path(root) / "saved_inputs"), flags)
    ids = torch.randint(0, 100, (COMMON["train.micro_batch"], COMMON["train.seq_len"]))
    loss = trainer.engine.module(input_ids=ids, labels=ids)
    nodes, todo = [], [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in nodes:
            continue
        nodes.append(node)
        todo += [parent for parent, _ in node.next_functions]
    saved = [
        [
            t.saved_data.numel()
            for t in node.deepspeed_saved_tensors
            if getattr(t, "saved_data", None) is not None
        ]
        for node in nodes
        if type(node).__name__ == "CheckpointFunctionBackward"
    ]
    loss.backward()
    return saved


def _train_and_skip(
    rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    return {
        **_train(rank, world_size, root, scenarios),
        "nan_skips": _nan_skips(rank, world_size, root),
        "saved_inputs": _checkpointed_inputs(rank, world_size, root),
    }


def _launch(root: Path, world_size: int, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    docs = str(root / "short_docs.jsonl")
    scenarios = {n: {**f, "data.source": docs} if "docs" in n else f for n, f in scenarios.items()}
    fn = _train_and_skip if world_size == 2 else _train
    return run_distributed(fn, world_size, str(root / f"ws{world_size}"), scenarios, timeout=900)[0]


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("parallel")
    _short_documents(root / "short_docs.jsonl")
    out = _launch(root, 1, REFERENCES)
    out.update(_launch(root, 2, {**{name: flags for name, (_, flags) in TWO.items()}, **CHECKPOINTED}))
    out.update(_launch(root, 4, {name: flags for name, (_, flags) in FOUR.items()}))
    return out


def _rel_diff(a: list[float], b: list[float]) -> float:
    x, y = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.max(np.abs(x - y) / np.abs(y)))


# A relative 1e-5 is far below what a real fault moves: one optimizer step changes the loss here by
# ~1e-2, and a missing gradient all-reduce, a wrong loss normalisation or another rank's samples by more.
REL_TOL = 1e-5
# bf16 rounds every matmul's output to 8 bits of mantissa, and tp changes which partial sums are rounded.
REL_TOL_BF16 = 1e-3


@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_parallel_run_follows_the_one_process_trajectory(
    trajectories: dict[str, list[float]], name: str
) -> None:
    reference_name = {**TWO, **FOUR}[name][0]
    reference, got = trajectories[reference_name], trajectories[name]
    assert len(reference) == len(got) == STEPS
    assert reference[-1] < reference[0]  # it trains at all
    tolerance = REL_TOL_BF16 if name.endswith("bf16") else REL_TOL
    assert _rel_diff(got, reference) < tolerance, (name, got, reference)


@pytest.mark.parametrize("name", [n for n in CHECKPOINTED if n != "tp2_full"])
def test_deepspeed_activation_checkpointing_follows_torchs(trajectories: dict[str, Any], name: str) -> None:
    """Partitioned over the tp ranks and all-gathered for the recompute, or held in host memory: the
    same losses as the blocks recomputed from torch's checkpoint."""
    reference, got = trajectories["tp2_full"], trajectories[name]
    assert len(got) == STEPS and _rel_diff(got, reference) < REL_TOL, (name, got, reference)


def test_partitioned_activations_keep_one_tp_share_of_each_block_input(trajectories: dict[str, Any]) -> None:
    """Each checkpointed block keeps 1/tp of its input (micro-batch x seq_len x hidden), as the
    estimator's checkpointed_input_bytes counts it."""
    from llmtrain.config import resolve
    from llmtrain.planning import memory
    from llmtrain.planning.memory import activations

    cfg = resolve(flags={**COMMON, **CHECKPOINTED["tp2_full_partitioned"], "launch.gpus": 2})
    share = COMMON["train.micro_batch"] * COMMON["train.seq_len"] * cfg.model.hidden_size // 2
    assert trajectories["saved_inputs"] == [[share]] * cfg.model.num_hidden_layers
    setup = memory.setup_from_config(cfg, None, shape_known=True)
    assert activations.checkpointed_input_bytes(setup) == 4 * share * cfg.model.num_hidden_layers  # fp32


@pytest.mark.parametrize("axis", ["tp", "sp"])
def test_a_nan_loss_on_one_rank_skips_the_update_on_every_rank(
    trajectories: dict[str, Any], axis: str
) -> None:
    """The stability guard's agreement holds across tp and sp groups: rank 1's NaN (under sp, its share
    of the loss) reaches every rank, all skip step 2 together, and training goes on finite."""
    records = trajectories["nan_skips"][axis]
    assert [r["step"] for r in records] == list(range(1, NAN_STEPS + 1))
    assert records[1]["loss"] is None and records[1]["skipped"] == 1  # metrics.jsonl writes NaN as null
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 1)
    assert records[-1]["skipped"] == 1


def test_the_references_differ_where_the_data_does(trajectories: dict[str, list[float]]) -> None:
    """The comparisons above can fail: another global batch, or document masking, moves the losses."""
    assert _rel_diff(trajectories["batch4"], trajectories["batch2"]) > 1e-3
    assert _rel_diff(trajectories["batch2_docs"], trajectories["batch2_docs_unmasked"]) > 1e-4


# ---------------------------------------------------------------- SIGKILL and resume, through the CLI

KILL_STEPS, SAVE_EVERY = 12, 4
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """`llmtrain train` on one process with the flags of the runs below: their global batch."""
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    run_ok(train_args(run_dir, KILL_STEPS, SAVE_EVERY, gpus=1), run_dir.parent / "run.log", TIMEOUT_S)
    return losses(run_dir)


@pytest.mark.parametrize("axis", ["tp", "sp"])
def test_sigkill_then_resume_is_bitwise_exact(
    tmp_path: Path, axis: str, one_process: dict[int, float]
) -> None:
    layout = [f"--{axis}", "2"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run_ok(train_args(reference, KILL_STEPS, SAVE_EVERY, *layout), tmp_path / "reference.log", TIMEOUT_S)
    # `llmtrain train --gpus 2 --tp 2` (or --sp 2) itself follows the one-process run.
    steps = sorted(one_process)
    assert _rel_diff([losses(reference)[s] for s in steps], [one_process[s] for s in steps]) < REL_TOL
    # The run directory keeps the layout and every group of its mesh by rank.
    environment = json.loads((reference / "environment.json").read_text())
    assert environment["layout"] == f"dp 1 x {axis} 2"
    mesh = environment["mesh"]
    split = {"tp": "tensor", "sp": "sequence"}[axis]
    assert mesh[split] == mesh["model" if axis == "tp" else "zero"] == [[0, 1]]
    assert mesh["data"] == mesh["pipeline"] == [[0], [1]]

    args = train_args(killed, KILL_STEPS, SAVE_EVERY, *layout)
    kill_after_a_checkpoint(args, killed, tmp_path / "killed.log", SAVE_EVERY, TIMEOUT_S)
    assert last_logged_step(killed) < KILL_STEPS, "the run ended before the kill"

    run_ok(resume_args(killed), tmp_path / "resume.log", TIMEOUT_S)
    assert_resumed_bitwise(reference, killed, KILL_STEPS)


def test_fsdp2_tp2_follows_one_process_and_resumes_at_tp1(
    tmp_path: Path, one_process: dict[int, float]
) -> None:
    """`train --gpus 2 --tp 2 --engine fsdp2` follows the one-process run; its checkpoint at step 4,
    resumed on one process without tp, continues within 1e-5: DCP holds each tp-split weight as one
    tensor and slices it for the new layout, no conversion. ~40 s."""
    run_dir = tmp_path / "fsdp2_tp2"
    fsdp2 = ["--engine", "fsdp2", "--zero", "3", "--tp", "2"]
    run_ok(train_args(run_dir, KILL_STEPS, SAVE_EVERY, *fsdp2), tmp_path / "train.log", TIMEOUT_S)
    steps = sorted(one_process)
    assert _rel_diff([losses(run_dir)[s] for s in steps], [one_process[s] for s in steps]) < REL_TOL
    root = run_dir / "checkpoints"
    for later in [d for d in root.glob("step_*") if int(d.name.removeprefix("step_")) > SAVE_EVERY]:
        shutil.rmtree(later)
    (root / "latest").write_text(f"step_{SAVE_EVERY:08d}\n")
    run_ok(resume_args(run_dir, "--gpus", "1", "--tp", "1"), tmp_path / "resume.log", TIMEOUT_S)
    assert json.loads((run_dir / "fsdp2_plan.json").read_text())["mesh"] == {
        "replicate": 1,
        "shard": 1,
        "tp": 1,
    }
    resumed = losses(run_dir)
    assert sorted(resumed) == steps
    assert _rel_diff([resumed[s] for s in steps], [one_process[s] for s in steps]) < REL_TOL
