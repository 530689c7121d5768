"""Checkpoint library: real DeepSpeed engines on CPU, world size 2 over gloo (tests/dist.py).

Distributed scenarios are grouped into few process launches (each costs ~10 s of imports on 2 cores):
- `_round_trips`: ZeRO 0-3 save -> fresh engine -> load; parameters, optimizer state, next loss, client
  state and RNG identical. ZeRO-3 also feeds the 2 -> 1 universal test.
- `_failures`: a save that fails for real on rank 1 (RLIMIT_FSIZE: the kernel refuses the write, root or
  not), then recovery, keep-pruning; the checkpoints it leaves feed the corruption and safety tests.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from runkit import Payload

from llmtrain import checkpoint as ckpt
from llmtrain.checkpoint import CheckpointError
from llmtrain.planning.layout import Layout

SEQ = 16
# (directory, ZeRO stage, precision): bf16 (what --precision auto picks on a GPU or a bf16 CPU); stage 0
# also in fp32, where the module itself holds the fp32 weights.
ROUND_TRIPS = [(f"zero{s}", s, "bf16") for s in (0, 1, 2, 3)] + [("zero0_fp32", 0, "fp32")]
NAMES = [name for name, _, _ in ROUND_TRIPS]


# ---------------------------------------------------------------- helpers that run inside the ranks


def _engine(stage: int, seed: int, extra: dict[str, Any] | None = None, precision: str = "bf16") -> Any:
    import deepspeed

    from llmtrain.config import resolve
    from llmtrain.model import build_model
    from llmtrain.planning import dsconfig

    cfg = resolve(
        flags={"preset": "debug", "zero.stage": stage, "train.micro_batch": 2, "train.precision": precision}
    )
    ds = dsconfig.build(cfg, world_size=int(os.environ["WORLD_SIZE"]))
    ds.update(extra or {})
    model = build_model(cfg.model, seed=seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def _train_step(engine: Any, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 512, (2, SEQ + 1), generator=g)
    loss = engine(ids[:, :-1], labels=ids[:, 1:])
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def _full_fp32(engine: Any) -> dict[str, np.ndarray]:
    """Every parameter's fp32 master value, gathered (a collective under ZeRO 1-3: all ranks call).

    As numpy: torch tensors cross the result queue through shared memory that dies with the worker.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if engine.zero_optimization() else p.detach()
        out[name] = full.detach().float().cpu().numpy().copy()
    return out


def _tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _local_optimizer_state(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partition and Adam moments, in a fixed order."""
    opt = engine.optimizer
    masters = [p.detach() for p in engine.module.parameters()]
    for attr in (
        "fp32_partitioned_groups_flat",  # ZeRO-3
        "single_partition_of_fp32_groups",  # ZeRO-1/2
        "fp32_groups_flat_partition",  # ZeRO-1 bf16 (BF16_Optimizer)
        "fp32_groups_flat",  # stage 0 bf16
    ):
        if hasattr(opt, attr):
            masters = list(getattr(opt, attr))
            break
    base = getattr(opt, "optimizer", opt)
    moments = [v for st in base.state.values() for _, v in sorted(st.items()) if torch.is_tensor(v)]
    return [t.detach().cpu().clone() for t in masters + moments]


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1).item())


def _wrapped(engine: Any) -> Any:
    """The raw DeepSpeed engine behind llmtrain's engine interface, which the checkpoint package drives."""
    from llmtrain.engine.ds_engine import DeepSpeedEngine

    return DeepSpeedEngine(engine, torch.device("cpu"), Layout(engine.world_size))


def _save(engine: Any, root: Path, step: int, rank: int, ws: int, **kw: Any) -> ckpt.SaveResult:
    client = {"step": step, "tokens": step * 64, "sampler": {"epoch": 0, "index": step * 4 + rank}}
    return ckpt.save(
        _wrapped(engine), root, step, client, rank, ws, keep=kw.get("keep"), keep_every=kw.get("keep_every")
    )


def _round_trips(rank: int, ws: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, stage, precision in ROUND_TRIPS:
        random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)
        where = Path(root) / name
        a = _engine(stage, seed=1, precision=precision)
        for step in (1, 2):
            _train_step(a, step, rank)
        result = _save(a, where, 2, rank, ws)
        assert result.ok, result.error
        after_save = _draw()
        saved_state = _local_optimizer_state(a)
        saved_weights = _full_fp32(a)
        next_loss = _train_step(a, 3, rank)

        b = _engine(stage, seed=2, precision=precision)
        state = ckpt.load(_wrapped(b), where, result.tag)
        ckpt.restore_rng(state.pop(ckpt.RNG_KEY))
        restored = _local_optimizer_state(b)
        out[name] = {
            "client": state,
            "rng_equal": _draw() == after_save,
            "state_equal": len(restored) == len(saved_state)
            and all(torch.equal(x, y) for x, y in zip(restored, saved_state, strict=True)),
            "next_loss": (next_loss, _train_step(b, 3, rank)),
            "weights": saved_weights,
        }
    return out


def _failures(rank: int, ws: int, root: str) -> dict[str, Any]:
    where = Path(root)
    engine = _engine(2, seed=1)
    results: dict[str, Any] = {}
    _train_step(engine, 1, rank)
    full_on_rank_1 = 2**62 if rank == 1 else 0  # min_free above any disk's free space: rank 1's is "full"
    no_room = ckpt.SpaceRule(full_on_rank_1, ckpt.SizeEstimate(1000, "a guess"))
    results["no_room"] = ckpt.save(_wrapped(engine), where, 1, {}, rank, ws, None, None, space=no_room)
    results["left_by_no_room"] = sorted(p.name for p in where.iterdir())
    results["first"] = _save(engine, where, 1, rank, ws, keep=2)
    _train_step(engine, 2, rank)
    with _file_size_limit(1024 if rank == 1 else None):
        results["failed"] = _save(engine, where, 2, rank, ws, keep=2)
    results["latest_after_failure"] = ckpt.read_latest(where)
    for step in (3, 4):
        _train_step(engine, step, rank)
        results[f"step{step}"] = _save(engine, where, step, rank, ws, keep=2)
    results["weights"] = _full_fp32(engine)
    return results


class _file_size_limit:
    """RLIMIT_FSIZE for this process: writes past `limit` bytes fail with EFBIG, as a full disk would."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit

    def __enter__(self) -> None:
        if self.limit is not None:
            self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
            self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))

    def __exit__(self, *exc: object) -> None:
        if self.limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)
            signal.signal(signal.SIGXFSZ, self.handler)


def _universal_load(rank: int, ws: int, root: str, stage: int, tag: str) -> dict[str, Any]:
    where = Path(root)
    info = next(i for i in ckpt.list_complete(where) if i.tag == tag)
    assert ckpt.needs_universal(info, Layout(ws))
    universal = ckpt.convert_to_universal(where, tag)
    again = ckpt.convert_to_universal(where, tag)  # a second call reuses the first conversion
    engine = _engine(stage, seed=7, extra={"checkpoint": {"load_universal": True}})
    state = ckpt.load(_wrapped(engine), where, universal.name)
    return {
        "weights": _full_fp32(engine),
        "client": state,
        "same_dir": universal == again,
        "problems": ckpt.verify(universal),
        "loss": _train_step(engine, 5, rank),
    }


# ---------------------------------------------------------------- fixtures: one launch each, shared


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from dist import run_distributed

    root = tmp_path_factory.mktemp("roundtrip")
    return root, run_distributed(_round_trips, 2, str(root), timeout=600)


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from dist import run_distributed

    root = tmp_path_factory.mktemp("failures")
    return root, run_distributed(_failures, 2, str(root), timeout=600)


def _copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpts"
    shutil.copytree(root, dst, symlinks=True)
    return dst


# ---------------------------------------------------------------- save + load


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_restores_weights_optimizer_client_state_and_rng(round_trips, name):
    root, results = round_trips
    stage = next(s for n, s, _ in ROUND_TRIPS if n == name)
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["state_equal"], f"rank {rank}: master weights / Adam moments differ after load"
        assert r["next_loss"][0] == r["next_loss"][1], f"rank {rank}: the step after resume differs"
        assert r["rng_equal"]
        assert r["client"] == {"step": 2, "tokens": 128, "sampler": {"epoch": 0, "index": 8 + rank}}
    where = root / name
    assert ckpt.read_latest(where) == "step_00000002"
    assert ckpt.verify(where / "step_00000002") == []
    manifest = json.loads((where / "step_00000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == stage and manifest["step"] == 2
    names = {f["path"] for f in manifest["files"]}
    assert {"llmtrain_state_rank0.json", "llmtrain_state_rank1.json"} <= names
    assert not (where / ".incoming" / "step_00000002").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n != "zero0"])
def test_consolidated_fp32_equals_engine_weights(round_trips, name):
    root, results = round_trips
    expected = _tensors(results[0][name]["weights"])
    got = ckpt.consolidated_fp32_state_dict(root / name, "step_00000002")
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_consolidated_fp32_of_bf16_stage0_is_the_master_copy(round_trips):
    root, results = round_trips
    bf16_params = _tensors(results[0]["zero0"]["weights"])  # the module's bf16 values, upcast
    got = ckpt.consolidated_fp32_state_dict(root / "zero0", "step_00000002")
    assert set(got) == set(bf16_params)
    for key, tensor in bf16_params.items():
        assert torch.equal(got[key].bfloat16(), tensor.bfloat16()), key  # rounds to the module's value
    assert any(not torch.equal(got[k], bf16_params[k]) for k in got)  # ... but keeps fp32 digits


def test_load_refuses_what_deepspeed_would_silently_skip(tmp_path):
    (tmp_path / "step_00000005").mkdir()
    with pytest.raises(CheckpointError, match="step_00000007"):
        ckpt.load(object(), tmp_path, "step_00000007")


# ---------------------------------------------------------------- failure on one rank, prune


@pytest.mark.slow
def test_failed_save_on_one_rank_is_reported_everywhere_and_keeps_previous(failures):
    root, results = failures
    for rank, r in enumerate(results):
        assert r["first"].ok
        failed = r["failed"]
        assert not failed.ok, f"rank {rank} thought the save worked"
        assert "rank 1" in failed.error and "step_00000002" in failed.error
        assert "rank 0:" not in failed.error  # only the rank that failed is blamed
        assert r["latest_after_failure"] == "step_00000001"
        assert results[0]["failed"].error == failed.error  # the same verdict on every rank
    assert not (root / "step_00000002").exists()
    assert not (root / ".incoming" / "step_00000002").exists()


@pytest.mark.slow
def test_saves_after_a_failure_succeed_and_keep_prunes(failures):
    root, results = failures
    for r in results:
        assert r["step3"].ok and r["step4"].ok
        assert r["step4"].pruned == ["step_00000001"]
    assert [i.step for i in ckpt.list_complete(root)] == [3, 4]
    assert ckpt.read_latest(root) == "step_00000004"
    assert ckpt.verify(root / "step_00000004") == []


@pytest.mark.parametrize(
    ("steps", "keep", "keep_every", "protected", "deleted"),
    [
        ([1, 2, 3, 4, 5], 2, None, set(), [1, 2, 3]),
        ([10, 20, 30, 40, 50], 2, 20, set(), [10, 30]),
        ([1, 2, 3], 0, None, set(), [1, 2]),  # keep 0 still keeps the newest
        ([1, 2, 3], None, None, set(), []),  # keep None keeps all
        ([1, 2, 3, 4], 1, None, {2}, [1, 3]),  # `latest` may name an older one
        ([], 3, None, set(), []),
    ],
)
def test_plan_prune(steps, keep, keep_every, protected, deleted):
    assert ckpt.plan_prune(steps, keep, keep_every, protected) == deleted


# ---------------------------------------------------------------- corruption and fallback


def _shard(ckpt_dir: Path) -> Path:
    (shard,) = ckpt_dir.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")  # bf16_ prefix in bf16
    return shard


@pytest.mark.slow
def test_truncated_shard_is_named_and_resume_falls_back(failures, tmp_path):
    root = _copy(failures[0], tmp_path)
    shard = _shard(root / "step_00000004")
    shard.write_bytes(shard.read_bytes()[:100])
    problems = ckpt.verify(root / "step_00000004")
    assert len(problems) == 1 and str(shard) in problems[0] and "truncated" in problems[0]

    choice = ckpt.choose_checkpoint(root, strict=False)
    assert choice.tag == "step_00000003"
    assert any(str(shard) in w for w in choice.warnings)
    with pytest.raises(CheckpointError, match=str(shard)):
        ckpt.choose_checkpoint(root, strict=True)


@pytest.mark.slow
def test_corrupt_bytes_and_added_files_are_named(failures, tmp_path):
    root = _copy(failures[0], tmp_path)
    shard = _shard(root / "step_00000004")
    data = bytearray(shard.read_bytes())
    data[-50] ^= 0xFF
    shard.write_bytes(bytes(data))
    (root / "step_00000004" / "mp_rank_01_model_states.pt").write_bytes(b"x")
    problems = ckpt.verify(root / "step_00000004")
    assert any(str(shard) in p and "corrupt" in p for p in problems)
    assert any("mp_rank_01_model_states.pt" in p and "not in the manifest" in p for p in problems)


@pytest.mark.slow
def test_latest_naming_a_missing_checkpoint_falls_back(failures, tmp_path):
    root = _copy(failures[0], tmp_path)
    (root / "latest").write_text("step_00000009")
    assert ckpt.choose_checkpoint(root, strict=False).tag == "step_00000004"
    with pytest.raises(CheckpointError, match="step_00000009"):
        ckpt.choose_checkpoint(root, strict=True)


def test_no_complete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "step_00000001").mkdir()  # a directory without a manifest is not a checkpoint
    with pytest.raises(CheckpointError, match=f"no complete checkpoint in {tmp_path}"):
        ckpt.choose_checkpoint(tmp_path, strict=False)


@pytest.mark.parametrize("content", ["../../outside", "/etc", "step_00000001/../../x", "step_1", ""])
def test_latest_outside_or_malformed_is_refused(tmp_path, content):
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "latest").write_text(content)
    with pytest.raises(CheckpointError, match=str(tmp_path / "latest")):
        ckpt.read_latest(tmp_path)


def test_latest_through_a_symlink_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "step_00000001").symlink_to(outside)
    (root / "latest").write_text("step_00000001")
    with pytest.raises(CheckpointError, match="outside"):
        ckpt.read_latest(root)


def test_a_symlinked_latest_is_refused_even_when_it_names_a_valid_tag(tmp_path):
    root = tmp_path / "ckpts"
    (root / "step_00000001").mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("step_00000001")
    (root / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        ckpt.read_latest(root)


# ---------------------------------------------------------------- nothing from a checkpoint runs code


@pytest.mark.slow
def test_pickled_code_in_a_checkpoint_is_refused_and_never_runs(failures, tmp_path):
    root = _copy(failures[0], tmp_path)
    marker = tmp_path / "PWNED"
    target = root / "step_00000004" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "evil": Payload(marker)}, target)

    with pytest.raises(CheckpointError, match=f"{target}.*system"):
        ckpt.load(object(), root, "step_00000004")
    with pytest.raises(CheckpointError, match="system"):
        ckpt.consolidated_fp32_state_dict(root, "step_00000004")
    # The second line of defence: DeepSpeed's own torch.load(weights_only=False) is forced weights-only.
    with ckpt.weights_only_loads(), pytest.raises(Exception, match="system"):
        torch.load(target, weights_only=False)
    assert not marker.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None


@pytest.mark.slow
def test_real_checkpoints_pass_the_scan(failures, round_trips):
    for root in [failures[0], *(round_trips[0] / name for name in NAMES)]:
        for info in ckpt.list_complete(root):
            ckpt.scan_pickles(info.path)


# ---------------------------------------------------------------- world size 2 -> 1


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "source"), [(2, "failures"), (3, "round_trips")])
def test_resume_on_a_different_world_size_through_universal(request, tmp_path, stage, source):
    from dist import run_distributed

    root, results = request.getfixturevalue(source)
    where = root if stage == 2 else root / "zero3"
    tag = "step_00000004" if stage == 2 else "step_00000002"
    expected = _tensors(results[0]["weights"] if stage == 2 else results[0]["zero3"]["weights"])
    where = _copy(where, tmp_path)

    (got,) = run_distributed(_universal_load, 1, str(where), stage, tag, timeout=300)
    assert got["same_dir"] and got["problems"] == []
    assert (where / f"{tag}_universal" / "manifest.json").is_file()
    assert not (where / ".incoming" / f"convert_{tag}").exists()
    assert ckpt.read_latest(where) == tag  # conversion leaves the commit pointer alone
    assert got["client"]["step"] == int(tag[-8:]) and got["client"]["rng"] is not None
    assert np.isfinite(got["loss"])
    for name, tensor in expected.items():
        assert torch.equal(torch.from_numpy(got["weights"][name]), tensor), name


@pytest.mark.slow
def test_universal_is_refused_for_unpartitioned_state(round_trips, tmp_path):
    where = _copy(round_trips[0] / "zero0", tmp_path)
    (info,) = ckpt.list_complete(where)
    assert not ckpt.needs_universal(info, Layout(1))  # stage 0 loads at any world size as it is
    with pytest.raises(CheckpointError, match="nothing to convert"):
        ckpt.convert_to_universal(where, info.tag)


# ---------------------------------------------------------------- before a save: is there room?


def test_a_checkpoint_that_cannot_fit_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "ckpts"
    free = ckpt.free_bytes(root)  # the filesystem root will be on, measured without creating it
    assert free is not None and abs(free - shutil.disk_usage(tmp_path).free) < 2**30
    rule = ckpt.SpaceRule(min_free=free + 2**40, first_save=ckpt.SizeEstimate(1234, "a guess"))
    result = ckpt.save(object(), root, 40, {}, 0, 1, keep=None, keep_every=None, space=rule)
    assert not result.ok and result.tag == "step_00000040" and result.path is None
    needs = "needs ~1.2 KiB (estimated from a guess), "
    assert result.error.startswith(f"not enough free space on {root}: {needs}")
    assert result.error.endswith(" free (checkpoint.min_free)")
    assert not root.exists()  # no staging dir, no partial file: the engine was never asked to write


@pytest.mark.slow
def test_a_checkpoint_that_cannot_fit_on_one_rank_is_refused_on_every_rank(failures):
    root, results = failures
    refused = [r["no_room"] for r in results]
    assert not any(r.ok for r in refused)
    assert refused[0] == refused[1]  # the same verdict, the same words, on both ranks
    needs = "needs ~1000 B (estimated from a guess), "
    assert refused[0].error.startswith(f"rank 1: not enough free space on {root}: {needs}")
    assert "rank 0" not in refused[0].error  # only the rank short of space is named
    assert [r["left_by_no_room"] for r in results] == [[], []]  # nothing written: no staging dir, no file


def test_the_expected_size_falls_back_to_the_estimate_without_a_readable_latest_checkpoint(tmp_path):
    guess = ckpt.SizeEstimate(5, "a guess")
    assert ckpt.expected_size(tmp_path, guess) == guess  # no checkpoint yet
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "latest").write_text("step_00000002")
    assert ckpt.expected_size(tmp_path, guess) == guess  # `latest` names no complete checkpoint
    assert ckpt.expected_size(tmp_path, None).bytes == 0


def _debug_config(engine: str) -> Any:
    from llmtrain.config import resolve

    stage = 1 if engine == "deepspeed" else 3  # runs' default ZeRO stage; FSDP2 runs stages 2-3
    flags = {"preset": "debug", "train.engine": engine, "zero.stage": stage, "train.micro_batch": 2}
    return resolve(flags={**flags, "train.precision": "bf16"})  # as _engine's: the default is auto


def _first_saves(rank: int, ws: int, root: str) -> dict[str, tuple[int, int, str]]:
    """A real first checkpoint of the debug preset (bf16) on DeepSpeed ZeRO 1 and on FSDP2, after one
    update (Adam's moments exist): engine -> (the manifest's total, the size then expected, its basis)."""
    from llmtrain.engine import fsdp2
    from llmtrain.planning import fsdp2_plan

    deepspeed = _engine(1, seed=1)
    _train_step(deepspeed, 1, rank)
    cfg = _debug_config("fsdp2")
    fsdp = fsdp2.build_engine(cfg, fsdp2_plan.build(cfg, ws), torch.device("cpu"), "cpu")
    ids = torch.randint(0, 512, (2, SEQ))
    fsdp.backward(fsdp.forward({"input_ids": ids, "labels": ids}), last=True, skip=False)
    fsdp.update(skip=False)
    out = {}
    for name, engine in (("deepspeed", _wrapped(deepspeed)), ("fsdp2", fsdp)):
        where = Path(root) / name
        result = ckpt.save(engine, where, 1, {"step": 1}, rank, ws, keep=None, keep_every=None)
        assert result.ok, result.error
        saved = sum(entry["size"] for entry in ckpt.read_manifest(where / result.tag)["files"])
        expected = ckpt.expected_size(where, None)
        out[name] = (saved, expected.bytes, expected.basis)
    return out


@pytest.mark.slow
def test_the_expected_size_is_the_last_checkpoints_and_the_first_estimate_a_little_above_it(tmp_path):
    from dist import run_distributed

    from llmtrain.train.trainer import space_rule

    (sizes,) = run_distributed(_first_saves, 1, str(tmp_path), timeout=300)
    for engine, (saved, expected, basis) in sizes.items():
        assert (expected, basis) == (saved, "step 1's checkpoint")
        estimate = space_rule(_debug_config(engine)).first_save
        assert estimate is not None
        print(f"{engine}: first checkpoint {saved} B, estimated {estimate.bytes} B ({estimate.basis})")
        assert saved <= estimate.bytes <= 1.3 * saved
