"""The trainer on both engines (DeepSpeed and FSDP2), world size 2 on CPU (gloo), through
`trainer.build_trainer`.

All scenarios run in one `run_distributed` launch of 2 fresh processes (imports cost ~20 s per launch on
2 cores); inside it every scenario builds a fresh engine and trains in its own run directory:
- `_trajectories`: ZeRO 0, 1, 2, 3 and FSDP2 (--zero 2, 3, with activation checkpointing) in fp32, and
  gradient accumulation (4 x micro-batch 2 against micro-batch 8, same global batch) on both engines,
  each logging every step;
- `_offload`: ZeRO 2 / 3 with CPU offload and ZeRO 3 with NVMe offload, FSDP2 in bf16 with and without
  CPU offload, at a higher LR;
- `_nan_skips`: a NaN loss injected on rank 1 (LLMTRAIN_FAULTS) for several stages, precisions and both
  engines, with the fp32 master weights and optimizer state snapshotted around the poisoned step;
- `_optimizer_rules`: one step per ZeRO stage and on FSDP2 with gradient clipping (Adam's first moment
  shows the gradient the optimizer received) and with a zero gradient (only weight decay moves weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trainkit

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 10
# Small and fast: the debug preset (158k parameters), short sequences, two sequences per micro-batch.
COMMON: dict[str, Any] = {
    "preset": "debug",
    "train.seq_len": 32,
    "train.micro_batch": 2,
    "train.precision": "fp32",
    "train.steps": STEPS,
    "logging.log_every": 1,
    "optim.lr": 1e-3,
    "schedule.warmup_steps": 2,
}


# ---------------------------------------------------------------- helpers that run inside the ranks


def _build(rank: int, world_size: int, run_dir: str, flags: dict[str, Any], faults: str = "") -> Any:
    return trainkit.build(rank, world_size, run_dir, {**COMMON, **flags}, faults)


def _train_all(rank: int, world_size: int, root: str, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return trainkit.train_all(rank, world_size, root, {n: {**COMMON, **f} for n, f in scenarios.items()})


FSDP2 = {"train.engine": "fsdp2"}
TRAJECTORIES = {
    **{f"zero{s}": {"zero.stage": s} for s in (0, 1, 2, 3)},
    **{f"fsdp2_zero{s}": {**FSDP2, "zero.stage": s} for s in (2, 3)},
    "fsdp2_zero3_checkpointed": {**FSDP2, "zero.stage": 3, "train.activation_checkpointing": "full"},
    # Global batch 16 at world size 2: 4 accumulation steps of 2 sequences, or 1 of 8.
    "accum4_micro2": {"zero.stage": 1, "train.micro_batch": 2, "train.global_batch": 16},
    "fsdp2_accum4_micro2": {**FSDP2, "zero.stage": 3, "train.micro_batch": 2, "train.global_batch": 16},
    "accum1_micro8": {"zero.stage": 1, "train.micro_batch": 8, "train.global_batch": 16},
}

OFFLOAD_STEPS = 15
OFFLOAD: dict[str, dict[str, Any]] = {
    "zero2_cpu": {"zero.stage": 2, "zero.offload": "cpu"},
    "zero3_cpu": {"zero.stage": 3, "zero.offload": "cpu"},
    "zero3_nvme": {"zero.stage": 3, "zero.offload": "nvme"},  # zero.nvme_path set per run
    "fsdp2_zero3_bf16": {**FSDP2, "zero.stage": 3, "train.precision": "bf16"},
    "fsdp2_zero2_cpu_bf16": {**FSDP2, "zero.stage": 2, "zero.offload": "cpu", "train.precision": "bf16"},
}


def _offload(rank: int, world_size: int, root: str) -> dict[str, Any]:
    scenarios = {}
    for name, flags in OFFLOAD.items():
        extra = {"zero.nvme_path": str(Path(root) / "nvme")} if flags.get("zero.offload") == "nvme" else {}
        scenarios[name] = {
            **flags,
            **extra,
            "train.steps": OFFLOAD_STEPS,
            "optim.lr": 3e-3,
            "train.micro_batch": 4,
        }
    return _train_all(rank, world_size, root, scenarios)


# ---- the NaN skip

NAN_STEP = 1  # 0-based optimizer step computed with a NaN loss on rank 1
NAN_CASES = [
    *[("deepspeed", 0, "fp32"), ("deepspeed", 1, "fp32"), ("deepspeed", 2, "fp32"), ("deepspeed", 3, "fp32")],
    *[("deepspeed", 0, "bf16"), ("deepspeed", 2, "bf16"), ("deepspeed", 3, "bf16")],
    *[("fsdp2", 3, "fp32"), ("fsdp2", 2, "bf16")],
]


def _as_numpy(t: Any) -> np.ndarray:
    # numpy, not torch: torch tensors cross the result queue through shared memory that dies with the worker
    return t.detach().float().cpu().numpy().copy()


def _snapshot(engine: Any) -> dict[str, np.ndarray]:
    return _fsdp2_snapshot(engine) if hasattr(engine, "model") else _deepspeed_snapshot(engine)


def _fsdp2_snapshot(engine: Any) -> dict[str, np.ndarray]:
    """FSDP2: the sharded fp32 parameters are the masters (whole: gathered, a collective; local: this
    rank's shard), and AdamW's state holds this rank's shards of the moments."""
    out: dict[str, np.ndarray] = {}
    for i, (name, p) in enumerate(engine.model.named_parameters()):
        out[f"master/{name}"] = _as_numpy(p.full_tensor())
        out[f"local_master/{i}"] = _as_numpy(p.to_local())
    for i, state in enumerate(engine.optimizer.state.values()):
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"state/{i}/{key}"] = _as_numpy(local)
    return out


def _deepspeed_snapshot(engine: Any) -> dict[str, np.ndarray]:
    """Every parameter's fp32 master value, gathered whole (a collective under ZeRO), and this rank's own
    partition of the optimizer state (Adam moments and step counters; all ranks together hold all of it).

    The state is read from the base optimizer itself: DeepSpeed 0.19's safe_get_full_optimizer_state
    finds no state for fp32 ZeRO-1/2 (its fragments are linked to other tensors than the state's keys).
    """
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, np.ndarray] = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        # Stage 0 in fp32: no separate master copy; the module's parameter is the master.
        out[f"master/{name}"] = _as_numpy(master if master is not None else p)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer DeepSpeed steps
    # What it updates: this rank's fp32 masters (flat partitions under ZeRO; fp32 copies under stage-0 bf16).
    # ZeRO-3 hands its flat partitions to the torch optimizer only for the duration of a step.
    tensors = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [
        p for group in base.param_groups for p in group["params"]
    ]
    out.update({f"local_master/{i}": _as_numpy(p) for i, p in enumerate(tensors)})
    for i, state in enumerate(base.state.values()):
        for key, value in state.items():
            out[f"state/{i}/{key}"] = _as_numpy(value) if hasattr(value, "detach") else np.array(value)
    return out


def _snapshot_around_steps(trainer: Any, faulty_step: int = NAN_STEP) -> list[dict[str, np.ndarray]]:
    """Wrap the trainer's real step: snapshot before every step, and after the faulty one."""
    snaps: list[dict[str, np.ndarray]] = []
    step = trainer.train_step

    def snapshotting_step(batches: Any) -> Any:
        snaps.append(_snapshot(trainer.engine))
        result = step(batches)
        if trainer.counters.step == faulty_step:
            snaps.append(_snapshot(trainer.engine))
        return result

    trainer.train_step = snapshotting_step
    return snaps


def _nan_skips(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per case: the snapshot at steps 0, NAN_STEP and after it; the skip counts; rank 0's records."""
    from llmtrain.train.metrics import METRICS_FILE, read_metrics

    out: dict[str, Any] = {}
    for engine, stage, precision in NAN_CASES:
        name = f"{engine}_zero{stage}_{precision}"
        run_dir = str(Path(root) / name)
        flags = {
            "train.engine": engine,
            "zero.stage": stage,
            "train.precision": precision,
            "train.steps": NAN_STEP + 1,
            "schedule.warmup_steps": 0,
        }
        trainer = _build(rank, world_size, run_dir, flags, faults=f"nan_loss@1:{NAN_STEP}")
        snaps = _snapshot_around_steps(trainer)
        trainer.train()
        unchanged = [k for k in snaps[1] if np.array_equal(snaps[1][k], snaps[2][k])]
        changed = [k for k in snaps[1] if not np.array_equal(snaps[1][k], snaps[2][k])]
        local_masters = [k for k in snaps[0] if k.startswith("local_master/")]
        first_step_moved = [k for k in local_masters if not np.array_equal(snaps[0][k], snaps[1][k])]
        out[name] = {
            "keys": sorted(snaps[1]),
            "changed_by_nan_step": changed,
            "unchanged": len(unchanged),
            "masters_moved_by_step_0": len(first_step_moved),
            "local_masters": len(local_masters),
            "masters": sum(k.startswith("master/") for k in snaps[1]),
            "skipped_total": trainer.guard.skipped_total,
            "records": read_metrics(Path(run_dir) / METRICS_FILE) if rank == 0 else None,
        }
    return out


# ---- a finite grad-norm spike (rank 0's gradients x 1000 at one step, its loss unchanged)

SPIKE_STEP = 5  # 0-based; five accepted steps before it fill the guard's history
SPIKE_FLAGS = {
    "zero.stage": 3,
    "train.steps": SPIKE_STEP + 1,
    "schedule.warmup_steps": 0,
    "stability.min_history": 3,
}


def _grad_spikes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per engine: whether the spiked step changed the state, the guard's counts, rank 0's records."""
    from llmtrain.train.metrics import METRICS_FILE, read_metrics

    out: dict[str, Any] = {}
    for engine in ("deepspeed", "fsdp2"):
        run_dir = str(Path(root) / engine)
        flags = {**SPIKE_FLAGS, "train.engine": engine}
        trainer = _build(rank, world_size, run_dir, flags, faults=f"grad_spike@0:{SPIKE_STEP}")
        snaps = _snapshot_around_steps(trainer, SPIKE_STEP)
        trainer.train()
        before, after = snaps[SPIKE_STEP], snaps[SPIKE_STEP + 1]
        out[engine] = {
            "changed_by_spike": [k for k in before if not np.array_equal(before[k], after[k])],
            "skipped_total": trainer.guard.skipped_total,
            "spikes_total": trainer.guard.spikes_total,
            "records": read_metrics(Path(run_dir) / METRICS_FILE) if rank == 0 else None,
        }
    return out


# ---- gradient clipping and weight-decay groups, seen in the optimizer's own state

RULE_CASES = [("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3), ("fsdp2", 3)]
RULE_FLAGS = {"train.steps": 1, "schedule.warmup_steps": 0, "optim.lr": 1e-2, "optim.weight_decay": 0.1}
TINY_CLIP = 1e-3  # far below the debug model's first gradient norm (~1)


def _first_moment_sq(snap: dict[str, np.ndarray]) -> float:
    """Sum of squares of this rank's Adam first moments (a share of the whole under ZeRO 1-3 / FSDP2)."""
    return float(sum(np.sum(v.astype(np.float64) ** 2) for k, v in snap.items() if k.endswith("/exp_avg")))


def _zero_gradient(trainer: Any) -> None:
    """The real loss times zero: every gradient exactly zero, so AdamW's step moves weights by decay only."""
    forward = trainer.engine.forward
    trainer.engine.forward = lambda batch: forward(batch) * 0.0


def _optimizer_rules(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per case: after one clipped step, this rank's share of |m|^2 and the logged (pre-clip) grad norm;
    the same unclipped; and the masters before and after one step with a zero gradient."""
    from llmtrain.train.metrics import METRICS_FILE, read_metrics

    out: dict[str, Any] = {}
    for engine, stage in RULE_CASES:
        case = f"{engine}_zero{stage}"
        flags = {**RULE_FLAGS, "train.engine": engine, "zero.stage": stage}
        result: dict[str, Any] = {}
        for clip in (TINY_CLIP, 0.0):
            run_dir = Path(root) / f"{case}_clip{clip}"
            trainer = _build(rank, world_size, str(run_dir), {**flags, "optim.grad_clip": clip})
            trainer.train()
            snap = _snapshot(trainer.engine)
            result[f"clip{clip}"] = {
                "m_sq": _first_moment_sq(snap),
                "grad_norm": read_metrics(run_dir / METRICS_FILE)[0]["grad_norm"] if rank == 0 else None,
            }
        trainer = _build(rank, world_size, str(Path(root) / f"{case}_zero_grad"), flags)
        _zero_gradient(trainer)
        snaps = _snapshot_around_steps(trainer, faulty_step=0)
        trainer.train()
        masters = {
            k.removeprefix("master/"): (snaps[0][k], snaps[1][k]) for k in snaps[0] if k.startswith("master/")
        }
        result["zero_grad"] = masters if rank == 0 else None
        out[case] = result
    return out


def _diverged(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A run the guard stops (NaN on rank 1 at steps 0 and 1, two skips allowed in a row): what it raised
    on this rank, and whether the loader's prefetch thread still runs afterwards (one left running into
    interpreter exit aborts the process)."""
    import threading

    from llmtrain.data.dataset import THREAD_NAME
    from llmtrain.errors import RunFailure

    flags = {"train.steps": 4, "stability.max_consecutive_skips": 2}
    trainer = _build(rank, world_size, str(Path(root) / "diverged"), flags, faults="nan_loss@1:0,1")
    raised = ""
    try:
        trainer.train()
    except RunFailure as exc:
        raised = type(exc).__name__
    prefetching = [t.name for t in threading.enumerate() if t.name == THREAD_NAME]
    return {"raised": raised, "prefetch_threads": prefetching}


def _all_groups(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {
        "diverged": _diverged(rank, world_size, root),
        "trajectories": _train_all(rank, world_size, str(Path(root) / "trajectories"), TRAJECTORIES),
        "offload": _offload(rank, world_size, str(Path(root) / "offload")),
        "nan": _nan_skips(rank, world_size, str(Path(root) / "nan")),
        "spikes": _grad_spikes(rank, world_size, str(Path(root) / "spikes")),
        "rules": _optimizer_rules(rank, world_size, str(Path(root) / "rules")),
    }


# ---------------------------------------------------------------- fixtures: one launch for all groups


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every group in one launch of 2 fresh processes (a launch costs ~20 s of imports on 2 cores)."""
    from dist import run_distributed

    return run_distributed(_all_groups, WORLD, str(tmp_path_factory.mktemp("train")), timeout=900)


@pytest.fixture(scope="module")
def trajectories(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return ranks[0]["trajectories"]


@pytest.fixture(scope="module")
def offload(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return ranks[0]["offload"]


@pytest.fixture(scope="module")
def nan_skips(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [per_rank["nan"] for per_rank in ranks]


@pytest.fixture(scope="module")
def spikes(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [per_rank["spikes"] for per_rank in ranks]


@pytest.fixture(scope="module")
def optimizer_rules(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [per_rank["rules"] for per_rank in ranks]


# ---------------------------------------------------------------- tests


def _rel_diff(a: list[float | None], b: list[float | None]) -> float:
    x, y = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.max(np.abs(x - y) / np.abs(y)))


# Measured on this machine (fp32, 6 steps, world size 2, LR 1e-3): ZeRO 1 and 2 differ from stage 0 by a
# relative 3.8e-8 (one last-place float32 difference in one step), ZeRO 3 not at all; 4 x micro-batch 2
# against micro-batch 8 by 1.1e-7 (the loss summed in another order). The tolerance leaves 10x room over
# that. A real bug (a missing all-reduce, a double-counted micro-batch, a wrong LR) shows much larger:
# one step here moves the loss by ~1e-2, and two different data orders differ by >1e-3 (asserted below).
REL_TOL = 1e-6


@pytest.mark.parametrize(
    "name", ["zero1", "zero2", "zero3", "fsdp2_zero2", "fsdp2_zero3", "fsdp2_zero3_checkpointed"]
)
def test_zero_stages_and_fsdp2_give_the_same_loss_trajectory(trajectories: dict[str, Any], name: str) -> None:
    """Every ZeRO stage, and FSDP2 (both run exact AdamW in fp32), follow ZeRO 0's losses."""
    reference = trajectories["zero0"]["losses"]
    assert len(reference) == STEPS and all(loss is not None for loss in reference)
    assert reference[-1] < reference[0]  # it trains at all
    losses = trajectories[name]["losses"]
    assert len(losses) == STEPS
    assert _rel_diff(losses, reference) < REL_TOL, (name, losses, reference)


@pytest.mark.parametrize("accumulated_run", ["accum4_micro2", "fsdp2_accum4_micro2"])
def test_gradient_accumulation_matches_one_big_micro_batch(
    trajectories: dict[str, Any], accumulated_run: str
) -> None:
    """On both engines: DeepSpeed's accumulation, and FSDP2's (gradient sync on the last micro-batch only)."""
    accumulated = trajectories[accumulated_run]["losses"]
    single = trajectories["accum1_micro8"]["losses"]
    assert len(accumulated) == len(single) == STEPS
    assert _rel_diff(accumulated, single) < REL_TOL, (accumulated, single)
    # Not the same run as the 4-sequence global batch above: different data per step.
    assert _rel_diff(accumulated, trajectories["zero1"]["losses"]) > 1e-3


@pytest.mark.parametrize("name", list(OFFLOAD))
def test_offload_and_fsdp2_bf16_train_and_the_loss_falls(offload: dict[str, Any], name: str) -> None:
    losses = offload[name]["losses"]
    assert len(losses) == OFFLOAD_STEPS and all(loss is not None for loss in losses)
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    # 15 steps at LR 3e-3 take the debug model from ~6.25 (ln 512) to below 5.9.
    assert last < first - 0.3, losses


def test_a_run_that_fails_stops_its_prefetch_thread_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    assert [r["diverged"] for r in ranks] == [{"raised": "TrainingDiverged", "prefetch_threads": []}] * WORLD


@pytest.mark.parametrize(("engine", "stage", "precision"), NAN_CASES)
def test_nan_loss_is_skipped_on_every_rank_with_state_bitwise_unchanged(
    nan_skips: list[dict[str, Any]], engine: str, stage: int, precision: str
) -> None:
    name = f"{engine}_zero{stage}_{precision}"
    for rank, per_rank in enumerate(nan_skips):
        case = per_rank[name]
        keys = case["keys"]
        # The snapshot holds what it claims: masters, and Adam's moments and step count on this rank.
        state_keys = {k.rsplit("/", 1)[1] for k in keys if k.startswith("state/")}
        assert case["masters"] > 0 and state_keys == {"step", "exp_avg", "exp_avg_sq"}, keys
        # A normal step moves every fp32 master tensor (so the comparison below can see a change) ...
        assert case["local_masters"] > 0, keys
        assert case["masters_moved_by_step_0"] == case["local_masters"], (rank, case)
        # ... the poisoned one (NaN on rank 1 only) leaves everything bitwise as it was, on both ranks.
        assert case["changed_by_nan_step"] == [], (rank, case["changed_by_nan_step"])
        assert case["unchanged"] == len(keys)
        assert case["skipped_total"] == 1
    records = nan_skips[0][name]["records"]
    assert [(r["step"], r["skipped"]) for r in records] == [(1, 0), (2, 1)]
    assert records[0]["loss"] is not None and records[1]["loss"] is None  # NaN is written as null


def test_a_grad_norm_spike_is_skipped_before_the_update_on_fsdp2_and_reported_on_deepspeed(
    spikes: list[dict[str, Any]],
) -> None:
    """FSDP2 knows the global grad norm before its optimizer steps, so the guard's policy `skip` holds
    for a grad-norm spike too: state bitwise unchanged on every rank. DeepSpeed computes the norm inside
    its step: the spike is counted and reported, the (clipped) update applied."""
    for per_rank in spikes:
        fsdp2, deepspeed = per_rank["fsdp2"], per_rank["deepspeed"]
        assert fsdp2["changed_by_spike"] == [] and fsdp2["skipped_total"] == 1 and fsdp2["spikes_total"] == 1
        assert deepspeed["changed_by_spike"] and deepspeed["skipped_total"] == 0
        assert deepspeed["spikes_total"] == 1
    for engine, skipped in (("fsdp2", 1), ("deepspeed", 0)):
        last = spikes[0][engine]["records"][-1]
        assert (last["step"], last["skipped"], last["spikes"]) == (SPIKE_STEP + 1, skipped, 1), engine
        assert last["grad_norm"] > 100 * spikes[0][engine]["records"][-2]["grad_norm"], engine


def _first_step_gradient_norm(per_rank: list[dict[str, Any]], stage: int, key: str) -> float:
    """|g| of the gradient the optimizer stepped with: Adam's first moment after one step is (1 - beta1) g;
    ZeRO 1-3 and FSDP2 hold a share of it per rank, ZeRO 0 all of it on every rank."""
    from llmtrain.config import OptimConfig

    shares = [r[key]["m_sq"] for r in per_rank]
    m_sq = shares[0] if stage == 0 else sum(shares)
    return float(np.sqrt(m_sq)) / (1 - OptimConfig().beta1)


@pytest.mark.parametrize(("engine", "stage"), RULE_CASES, ids=[f"{e}_zero{s}" for e, s in RULE_CASES])
def test_gradient_clipping_caps_the_norm_the_optimizer_steps_with(
    optimizer_rules: list[dict[str, Any]], engine: str, stage: int
) -> None:
    per_rank = [r[f"{engine}_zero{stage}"] for r in optimizer_rules]
    clipped, unclipped = f"clip{TINY_CLIP}", "clip0.0"
    logged = per_rank[0][clipped]["grad_norm"]
    assert logged > 100 * TINY_CLIP, (
        "the first gradient must be far above the clip for the test to mean anything"
    )
    assert per_rank[0][unclipped]["grad_norm"] == pytest.approx(logged, rel=1e-5)  # same data, same gradient
    # Unclipped, the optimizer steps with the whole gradient (the measure is right) ...
    assert _first_step_gradient_norm(per_rank, stage, unclipped) == pytest.approx(logged, rel=1e-4)
    # ... clipped, with the gradient scaled to the clip, while the log keeps the norm before clipping.
    assert _first_step_gradient_norm(per_rank, stage, clipped) == pytest.approx(TINY_CLIP, rel=1e-4)


@pytest.mark.parametrize(("engine", "stage"), RULE_CASES, ids=[f"{e}_zero{s}" for e, s in RULE_CASES])
def test_weight_decay_shrinks_matrices_only(
    optimizer_rules: list[dict[str, Any]], engine: str, stage: int
) -> None:
    """A step with a zero gradient: AdamW moves a weight by decay alone, p * (1 - lr * wd); norms and the
    embedding (no decay) stay bitwise as they were."""
    masters = optimizer_rules[0][f"{engine}_zero{stage}"]["zero_grad"]
    shrink = np.float32(1 - RULE_FLAGS["optim.lr"] * RULE_FLAGS["optim.weight_decay"])
    exempt = [name for name in masters if "norm" in name or name.startswith("embed_tokens")]
    decayed = [name for name in masters if name not in exempt]
    assert any("norm" in n for n in exempt) and "embed_tokens.weight" in exempt, sorted(masters)
    assert any("mlp" in n for n in decayed) and any("attn" in n for n in decayed), sorted(masters)
    for name in exempt:
        before, after = masters[name]
        assert np.array_equal(before, after), f"{name}: moved by a zero-gradient step (decayed?)"
    for name in decayed:
        before, after = masters[name]
        assert not np.array_equal(before, after), f"{name}: not decayed"
        np.testing.assert_allclose(after, before * shrink, rtol=1e-6, atol=0, err_msg=name)
