"""HSDP on FSDP2 on the loopback two-node cluster (tests/cluster.py): 2 nodes x 2 processes through pdsh,
against FSDP2 sharded over all four ranks.

Jobs at once, fp32, `--engine fsdp2 --zero 3`, STEPS steps, a checkpoint every SAVE_EVERY:
- `flat`: `--dp-shard 4`, every parameter sharded over the four ranks, its gathers across nodes;
- `hsdp`: the default on two nodes (each node's two ranks shard, the nodes replicate), with rank 3
  (node-b's second process) hanging in step KILLED_AT after the checkpoint at SAVE_EVERY: the steps in
  between are logged, the test SIGKILLs that worker, the job ends, and `resume` runs it to the end.
The resumed steps that were logged before the kill come out bit for bit as they were (an exact resume
through DCP's replicated, sharded tensors); every loss follows flat FSDP2's within 1e-6 (the gradient
sums are grouped differently: within a node, then across). Each step's `comm_bytes` matches
planning.traffic within 10%: HSDP's only cross-node traffic is the all-reduce of each rank's gradient
shard. A third job, `tp`: `--tp 2` on the same nodes (dp 2 x tp 2, tp inside each node) follows `flat`
within 1e-5. Cost: ~120 s (12 processes on 2 cores, then 4 for the resume).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster import Cluster, cluster, predicted_traffic, remote_worker, running_or_skip
from dist import free_port
from runkit import (
    BASE_FLAGS,
    assert_recomputed_bitwise,
    kill_tree,
    last_logged_step,
    latest,
    losses,
    metrics,
    run_env,
    start,
    wait_for,
)

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY, KILLED_AT = 8, 4, 7  # the victim hangs in step 7: steps 5 and 6 are logged first
GLOBAL_BATCH = 16  # micro-batch 2 x 4 ranks x 2 accumulation steps
VICTIM = 3
JOB_TIMEOUT = 400.0


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = cluster(tmp_path_factory.mktemp("cluster"), mark="# llmtrain test hsdp")
    yield from running_or_skip(started, "cluster")


def _train(run_dir: Path, *launch: str) -> list[str]:
    return [
        "train", *BASE_FLAGS, "--engine", "fsdp2", "--zero", "3", "--global-batch", str(GLOBAL_BATCH),
        "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--run-dir", str(run_dir), "--master-port", str(free_port()), *launch,
    ]  # fmt: skip


@dataclass
class Jobs:
    dirs: dict[str, Path]
    codes: dict[str, int]
    outputs: dict[str, str]
    before_kill: list[dict[str, object]]  # the hsdp run's metrics as logged before its worker was killed
    killed_after: str  # the checkpoint the hsdp run had when it was killed, which resume starts from


@pytest.fixture(scope="module")
def jobs(nodes: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    tmp = tmp_path_factory.mktemp("hsdp")
    hostfile = nodes.hostfile(tmp / "hostfile", {"node-a": 2, "node-b": 2})
    dirs = {name: tmp / name for name in ("flat", "hsdp", "tp")}
    two_nodes = ["--hostfile", str(hostfile), "--nodes", "2", "--gpus", "2"]
    runs = {
        "flat": start(
            _train(dirs["flat"], *two_nodes, "--dp-shard", "4"), tmp / "flat.log", nodes.env(run_env())
        ),
        "hsdp": start(
            _train(dirs["hsdp"], *two_nodes),
            tmp / "hsdp.log",
            nodes.env(run_env(faults=f"hang@{VICTIM}:{KILLED_AT - 1}")),  # 0-based step
        ),
        "tp": start(_train(dirs["tp"], *two_nodes, "--tp", "2"), tmp / "tp.log", nodes.env(run_env())),
    }
    codes, outputs = {}, {}
    try:
        wait_for(
            lambda: last_logged_step(dirs["hsdp"]) >= KILLED_AT - 1, JOB_TIMEOUT, "the hsdp run's step 6"
        )
        victim = remote_worker(dirs["hsdp"], VICTIM)
        assert victim is not None, runs["hsdp"].output()[-3000:]
        victim.kill()
        for name, run in runs.items():
            codes[name], outputs[name] = run.wait(JOB_TIMEOUT)
        before_kill, killed_after = metrics(dirs["hsdp"]), latest(dirs["hsdp"])
        assert killed_after is not None
        resumed = start(
            ["resume", str(dirs["hsdp"]), "--master-port", str(free_port())],
            tmp / "resume.log",
            nodes.env(run_env()),
        )
        codes["resume"], outputs["resume"] = resumed.wait(JOB_TIMEOUT)
    finally:
        for run in runs.values():
            kill_tree(run.proc.pid)
    return Jobs(dirs, codes, outputs, before_kill, killed_after)


def test_hsdp_is_the_default_on_two_nodes_and_shards_within_each(jobs: Jobs) -> None:
    meshes = {name: json.loads((d / "fsdp2_plan.json").read_text())["mesh"] for name, d in jobs.dirs.items()}
    assert meshes == {
        "flat": {"replicate": 1, "shard": 4, "tp": 1},
        "hsdp": {"replicate": 2, "shard": 2, "tp": 1},
        "tp": {"replicate": 1, "shard": 2, "tp": 2},  # a node's two ranks are one tp group
    }


def test_dp2_x_tp2_over_two_nodes_follows_fsdp2_over_four_ranks(jobs: Jobs) -> None:
    """tp inside each node (DTensor styles, vocab-parallel loss), the data-parallel shards across: the
    same global batch, the losses of FSDP2 over four ranks (itself one process's within 1e-6:
    test_train_dist, test_parallel) within 1e-5."""
    assert jobs.codes["tp"] == 0, jobs.outputs["tp"][-3000:]
    tp, flat = losses(jobs.dirs["tp"]), losses(jobs.dirs["flat"])
    assert sorted(tp) == list(range(1, STEPS + 1))
    for step in flat:
        assert tp[step] == pytest.approx(flat[step], rel=1e-5, abs=0), step


def test_hsdp_killed_and_resumed_continues_bit_for_bit_and_follows_flat_fsdp2(jobs: Jobs) -> None:
    assert jobs.codes["flat"] == 0, jobs.outputs["flat"][-3000:]
    assert jobs.codes["hsdp"] != 0  # a rank was killed
    assert jobs.codes["resume"] == 0, jobs.outputs["resume"][-3000:]
    assert latest(jobs.dirs["hsdp"]) == f"step_{STEPS:08d}"
    resumed_steps = re.findall(r"^node-a: step (\d+)/", jobs.outputs["resume"], re.M)
    assert resumed_steps == [str(s) for s in range(SAVE_EVERY + 1, STEPS + 1)]
    hsdp, flat = losses(jobs.dirs["hsdp"]), losses(jobs.dirs["flat"])
    assert sorted(hsdp) == sorted(flat) == list(range(1, STEPS + 1))
    assert jobs.killed_after == f"step_{SAVE_EVERY:08d}"
    assert set(range(SAVE_EVERY + 1, KILLED_AT)) <= {r["step"] for r in jobs.before_kill}  # logged twice
    assert_recomputed_bitwise(jobs.before_kill, jobs.killed_after, jobs.dirs["hsdp"], STEPS)
    for step in flat:
        assert hsdp[step] == pytest.approx(flat[step], rel=1e-6, abs=0), step


def test_each_steps_bytes_match_the_formula_and_hsdp_crosses_nodes_with_one_shard_all_reduce(
    jobs: Jobs,
) -> None:
    measured = {}
    for name in ("flat", "hsdp"):
        records = [r for r in metrics(jobs.dirs[name]) if "loss" in r]
        assert len(records) >= STEPS
        predicted = predicted_traffic(jobs.dirs[name], ranks_per_node=2)
        for record in records:
            got = record["comm_bytes"]
            for span in ("inside_node", "across_nodes"):
                assert got[span] == pytest.approx(predicted[span], rel=0.10, abs=1 << 16), (name, record)
        measured[name] = records[-1]["comm_bytes"]
    flat, hsdp = measured["flat"], measured["hsdp"]
    # Two micro-batches, --zero 3: 4 fp32 gathers and 1 fp32 reduce-scatter of the whole model, all
    # across nodes when sharded over both; under HSDP they stay in the node, and the all-reduce of
    # each rank's half of the gradients (1/10 of flat's volume) is all that crosses.
    assert flat["inside_node"] == 0
    assert hsdp["inside_node"] == pytest.approx(flat["across_nodes"], rel=0.01)
    assert hsdp["across_nodes"] == pytest.approx(flat["across_nodes"] / 10, rel=0.05)
