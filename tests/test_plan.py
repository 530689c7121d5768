"""`llmtrain plan`: every layout that fits, fastest first, each the train command that runs it, its
memory the estimator's, the user's flags pinning their part (llmtrain.planning.plan, .report)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dist import run_distributed

from llmtrain import calibrate
from llmtrain.calibrate import fit_matmul
from llmtrain.cli import main
from llmtrain.planning.hardware import load_cluster
from llmtrain.planning.report import add_measured, render_confirmed, spearman

REQUEST = ["--preset", "7b", "--seq-len", "4096", "--global-batch", "256", "--gpu", "h100", "--nodes", "2"]


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _estimate(capsys: pytest.CaptureFixture[str], command: str) -> dict[str, Any]:
    """estimate-memory --json for the flags of a row's `llmtrain train` command."""
    words = shlex.split(command)
    assert words[:2] == ["llmtrain", "train"]
    assert main(["estimate-memory", *words[2:], "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.fixture(scope="module")
def plan_7b() -> dict[str, Any]:
    """One plan for the module (about a second); capsys is per test, so stdout is taken by hand."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *REQUEST, "--top", "50", "--json"]) == 0
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


def test_the_rows_fit_fastest_first_and_train_the_same_tokens_per_step(plan_7b: dict[str, Any]) -> None:
    rows = plan_7b["rows"]
    assert plan_7b["layouts_that_fit"] >= len(rows) == 50
    seconds = [row["step_seconds"] for row in rows]
    assert seconds == sorted(seconds)
    for row in rows:
        assert 0 < row["gpu_peak_bytes"] <= plan_7b["cluster"]["memory_bytes"]
        dp = 16 // (row["tp"] * row["sp"] * row["pp"])
        assert row["micro_batch"] * row["accumulation_steps"] * dp == 256
        assert row["tokens_per_second"] == pytest.approx(256 * 4096 / row["step_seconds"])
        assert sum(term["seconds"] for term in row["terms"]) == pytest.approx(row["step_seconds"])
    kinds = {(row["engine"], row["tp"] > 1, row["sp"] > 1, row["pp"] > 1) for row in rows}
    assert {("deepspeed", False, False, False), ("fsdp2", False, False, False)} <= kinds


def test_plan_and_estimate_memory_agree_on_every_shown_row(
    plan_7b: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    for row in plan_7b["rows"][:10]:
        estimate = _estimate(capsys, row["command"])
        assert estimate["per_gpu_peak_bytes"] == row["gpu_peak_bytes"], row["command"]


def test_the_first_rows_command_is_the_layout_it_describes(plan_7b: dict[str, Any]) -> None:
    first = plan_7b["rows"][0]
    words = shlex.split(first["command"])
    flags = dict(zip(words[2::2], words[3::2], strict=True))
    assert flags["--preset"] == "7b" and flags["--seq-len"] == "4096" and flags["--global-batch"] == "256"
    assert flags["--gpus"] == "8" and flags["--nodes"] == "2"
    assert flags["--zero"] == str(first["zero_stage"]) and flags["--engine"] == first["engine"]
    assert flags["--micro-batch"] == str(first["micro_batch"])


def test_zero3_on_several_nodes_is_also_planned_with_hpz(
    plan_7b: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    hpz = [row for row in plan_7b["rows"] if row["shard_within_node"]]
    assert hpz and all(row["engine"] == "deepspeed" and row["zero_stage"] == 3 for row in hpz)
    assert all(
        ("--shard-within-node" in row["command"]) == row["shard_within_node"] for row in plan_7b["rows"]
    )
    estimate = _estimate(capsys, hpz[0]["command"])  # the second partition counted by both
    assert estimate["per_gpu_peak_bytes"] == hpz[0]["gpu_peak_bytes"]
    one_node = _plan(capsys, *REQUEST[:-2], "--nodes", "1", "--zero", "3", "--top", "100")
    assert one_node["rows"] and not any(row["shard_within_node"] for row in one_node["rows"])


def test_fsdp2_on_several_nodes_is_planned_as_hsdp_and_sharded_over_all_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two 8-GPU nodes: HSDP (a node's 8 ranks shard, the default, no flag) and FSDP2 over all 16
    (--dp-shard 16), each as the command that runs it; the states of HSDP are twice the full shard's."""
    doc = _plan(
        capsys, *REQUEST, "--engine", "fsdp2", "--zero", "3", "--offload", "none", "--tp", "1", "--top", "100"
    )
    meshes = {(r["fsdp_mesh"]["replicate"], r["fsdp_mesh"]["shard"]) for r in doc["rows"]}
    assert meshes == {(2, 8), (1, 16)}
    for row in doc["rows"]:
        assert ("--dp-shard 16" in row["command"]) == (row["fsdp_mesh"]["shard"] == 16)
        assert "--dp-shard 8" not in row["command"]  # the default on two nodes
    hsdp = next(r for r in doc["rows"] if r["fsdp_mesh"]["replicate"] == 2)
    estimate = _estimate(capsys, hsdp["command"])
    assert estimate["per_gpu_peak_bytes"] == hsdp["gpu_peak_bytes"]
    assert estimate["setup"]["fsdp_mesh"] == {"replicate": 2, "shard": 8, "tp": 1}
    pinned = _plan(
        capsys, *REQUEST, "--engine", "fsdp2", "--zero", "3", "--tp", "1", "--dp-shard", "4", "--top", "100"
    )
    assert pinned["rows"] and {r["fsdp_mesh"]["shard"] for r in pinned["rows"]} == {4}
    assert main(["plan", *REQUEST[:-2], "--nodes", "1", "--engine", "fsdp2", "--zero", "3", "--json"]) == 0
    one_node = json.loads(capsys.readouterr().out)
    assert {r["fsdp_mesh"]["replicate"] for r in one_node["rows"]} == {1}


def test_the_engine_alone_pins_the_engine_and_the_stages_are_searched(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--engine fsdp2` without --zero plans (train's default stage, ZeRO 1, is DeepSpeed's alone)."""
    doc = _plan(capsys, *REQUEST, "--engine", "fsdp2", "--top", "100")
    assert doc["rows"] and {row["engine"] for row in doc["rows"]} == {"fsdp2"}
    assert {row["zero_stage"] for row in doc["rows"]} == {2, 3}


def test_flags_pin_their_part_of_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _plan(capsys, *REQUEST, "--zero", "3", "--tp", "2", "--top", "100")
    assert doc["rows"] and all(row["zero_stage"] == 3 and row["tp"] == 2 for row in doc["rows"])
    assert {row["engine"] for row in doc["rows"]} == {"deepspeed", "fsdp2"}  # FSDP2 with DTensor tp


def test_a_cluster_file_plans_a_cpu_in_fp32(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(
        "devices_per_node: 2\nintra_node_bandwidth: 5e9\ninter_node_bandwidth: 1e9\nhost_bandwidth: 2e10\n"
        "device: {name: this CPU, peak_flops: {fp32: 1e11}, memory_bytes: 12GiB, memory_bandwidth: 2e10}\n"
    )
    doc = _plan(
        capsys, "--preset", "tiny", "--cluster", str(path), "--precision", "fp32", "--global-batch", "8"
    )
    assert doc["cluster"]["sources"]["intra_node_bandwidth"] == f"--cluster {path}"
    assert doc["rows"][0]["command"].endswith("--precision fp32 --gpus 2 --nodes 1")
    assert main(["plan", "--preset", "tiny", "--cluster", str(path), "--precision", "bf16"]) == 2
    assert "--precision: this CPU has no peak FLOP/s for bf16" in capsys.readouterr().err


def test_the_table_names_the_dominant_term_and_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *REQUEST, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s/GPU" in out and "compute" in out
    assert "layouts fit; run the first with:\n  llmtrain train --preset 7b" in out


@pytest.mark.parametrize(
    ("argv", "printed"),
    [
        (["plan", "--preset", "7b", "--gpu", "a100-80gb", "--top", "1"], "layouts fit; run the first with:"),
        (
            [
                "estimate-memory",
                "--preset",
                "7b",
                "--zero",
                "3",
                "--offload",
                "cpu",
                "--gpus",
                "8",
                "--gpu-memory",
                "24GB",
            ],
            "Verdict: fits",
        ),
    ],
)
def test_the_planning_verbs_build_no_model_and_import_no_torch(argv: list[str], printed: str) -> None:
    code = (
        f"import sys; from llmtrain.cli import main; rc = main({argv!r}); "
        "print('RESULT', rc, 'torch' in sys.modules, 'deepspeed' in sys.modules, 'llmtrain.model' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "RESULT 0 False False False" in out
    assert printed in out


def test_calibrate_writes_this_machine_as_a_cluster_that_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two processes side by side measure matmuls, memory, an all-reduce, CPU Adam and three engines'
    steps; the file plans the debug preset and its first two layouts run here (about 50 s in all)."""
    path = tmp_path / "here.yaml"
    assert main(["plan", "--calibrate", str(path), "--gpus", "2"]) == 0
    assert f"wrote {path}: 2 x " in capsys.readouterr().out
    assert path.read_text().startswith("# measured by llmtrain plan --calibrate: ")
    cluster = load_cluster(path)
    assert (cluster.devices_per_node, cluster.nodes) == (2, 1)
    assert cluster.device.peak("fp32") > 1e8 and cluster.device.peak("bf16") > 0  # any CPU: > 0.1 GFLOP/s
    assert 0 < cluster.device.attention_efficiency <= 1 and cluster.device.matmul_overhead_s >= 0
    assert cluster.intra_node_bandwidth > 0 and cluster.cpu_adam_rate > 0
    assert cluster.host_cores == len(os.sched_getaffinity(0))
    # Each engine kind's own work, measured on a real engine and left over after the modelled terms.
    assert set(cluster.engine_overhead) == set(cluster.engine_steps) == {"zero1", "zero3", "fsdp2", "tp"}
    assert all(0 <= v < 1e-5 for each in cluster.engine_overhead.values() for v in each.values())
    # The steps it was derived from are kept: a later time model derives it again from them.
    recorded = yaml.safe_load(path.read_text())
    assert calibrate.engine_overhead(recorded) == recorded["engine_overhead"]
    assert all(0 < seconds < 60 for each in cluster.engine_steps.values() for seconds in each.values())
    doc = _plan(
        capsys, "--preset", "debug", "--cluster", str(path), "--precision", "fp32", "--global-batch", "8",
        "--confirm", "2", "--confirm-steps", "4",
    )  # fmt: skip
    assert doc["cluster"]["devices_per_node"] == 2 and doc["confirmed"]["layouts"] == 2
    for row in doc["rows"][:2]:  # two real runs of the rows' own commands, 2 timed steps each
        assert row["measured_step_seconds"] > 0
        assert row["measured_over_predicted"] == pytest.approx(
            row["measured_step_seconds"] / row["step_seconds"]
        )
    assert "measured_step_seconds" not in doc["rows"][2]
    assert main(["plan", "--calibrate", str(path)]) == 2  # never replaces a file
    assert "already exists" in capsys.readouterr().err


def test_the_matmul_curve_is_fitted_back_from_its_own_points() -> None:
    made = {d: 2 * d**3 / (20e-6 + 2 * d**3 / 100e9) for d in (64, 128, 256, 512, 1024)}
    peak, overhead = fit_matmul(made)
    assert peak == pytest.approx(100e9, rel=1e-6) and overhead == pytest.approx(20e-6, rel=1e-6)
    assert fit_matmul({64: 5e10, 256: 5e10, 1024: 5e10}) == (pytest.approx(5e10), pytest.approx(0, abs=1e-15))


def test_core_handoff_reads_the_share_of_a_waiting_ranks_core_from_the_measured_ratio() -> None:
    # 4 ranks on 2 cores: 2 computing alone take half the time all 4 take when the others' cores are
    # theirs, all of it when not; 3 on 2: the 2 computing get a core each instead of 2/3 of one.
    assert calibrate.core_handoff(0.5, ranks=4, cores=2) == 1.0
    assert calibrate.core_handoff(1.0, ranks=4, cores=2) == 0.0
    assert calibrate.core_handoff(0.75, ranks=4, cores=2) == pytest.approx(0.5)
    assert calibrate.core_handoff(2 / 3, ranks=3, cores=2) == pytest.approx(1.0)
    assert calibrate.core_handoff(0.45, ranks=4, cores=2) == 1.0  # noise past either end is clamped
    assert calibrate.core_handoff(1.1, ranks=4, cores=2) == 0.0


def _alone_over_all(rank: int, world_size: int) -> float | None:
    import torch

    from llmtrain.parallel.distributed import share_cores

    share_cores(world_size)  # as calibrate's ranks share the cores
    return calibrate._alone_over_all(torch.device("cpu"))


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) >= 4, reason="needs more processes than cores: 4 on at most 3"
)
def test_the_core_handoff_probe_times_the_even_ranks_alone_against_all_four() -> None:
    """4 gloo processes on this machine's cores (about 10 s): the odd ranks wait in a barrier while the
    even ones compute; their time over the time with all four computing is between a full hand-over's
    (ranks / 2 computing get at most a core each) and a little over 1 (nothing handed over, noise)."""
    ratios = run_distributed(_alone_over_all, 4, timeout=120)
    assert ratios[1] is None and ratios[3] is None
    cores = len(os.sched_getaffinity(0))
    full = (cores / 4) / min(1.0, cores / 2)
    for ratio in (ratios[0], ratios[2]):
        assert full * 0.8 < ratio < 1.3, ratios
    assert 0 <= calibrate.core_handoff((ratios[0] + ratios[2]) / 2, ranks=4, cores=cores) <= 1


def test_spearman_ranks_ties_by_their_mean() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 6]) == pytest.approx(0.8660254)  # ranks 0.5, 0.5, 2


def test_confirmed_rows_show_the_measured_peak_where_a_gpu_measured_one(
    plan_7b: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU's runs log their allocator peak; the table puts it beside the estimate (a CPU's has none)."""
    doc = json.loads(json.dumps(plan_7b))  # the module's plan stays as it was
    first, second, third = (row["step_seconds"] for row in doc["rows"][:3])
    add_measured(doc, [2 * first, 3 * second, 4 * third], [30 << 30, None, 20 << 30])
    assert doc["rows"][0]["measured_peak_bytes"] == 30 << 30 and "measured_peak_bytes" not in doc["rows"][1]
    assert doc["confirmed"]["layouts"] == 3
    assert doc["confirmed"]["median_relative_error"] == pytest.approx(2.0)
    render_confirmed(doc)
    out = capsys.readouterr().out
    assert "measured peak" in out and "30.00 GiB" in out and "20.00 GiB" in out
    on_a_cpu = json.loads(json.dumps(plan_7b))
    add_measured(on_a_cpu, [first], [None])
    render_confirmed(on_a_cpu)
    assert "measured peak" not in capsys.readouterr().out
