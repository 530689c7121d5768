"""bench/results/traffic.json, as `python -m bench traffic` recorded it on the loopback two-node cluster:
every step's measured bytes inside and across nodes are planning.traffic's within 10% for flat ZeRO 3,
hpZ, FSDP2 and HSDP, the recorded predictions are what the formula says today for the recorded configs
(a change to the formula re-records the file), hpZ sends a quarter less across nodes and HSDP a tenth of
FSDP2's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import bench_traffic

RESULTS = json.loads(bench_traffic.OUT.read_text())
ROWS: dict[str, dict[str, Any]] = RESULTS["rows"]


@pytest.mark.parametrize("name", list(bench_traffic.LAYOUTS))
def test_every_steps_measured_bytes_are_the_formulas_within_10_percent(name: str) -> None:
    row = ROWS[name]
    assert row["config"]["launch"]["nodes"] == bench_traffic.NODES
    assert row["config"]["zero"]["shard_within_node"] == (name == "hpz")
    for span in bench_traffic.SPANS:
        steps = row["comm_bytes_per_step"][span]
        assert len(steps) == bench_traffic.STEPS - 1
        for measured in steps:
            assert measured == pytest.approx(row["predicted"][span], rel=0.10, abs=1 << 16), (span, steps)


@pytest.mark.parametrize("name", list(bench_traffic.LAYOUTS))
def test_the_recorded_prediction_is_the_formulas_today(name: str) -> None:
    assert ROWS[name]["predicted"] == bench_traffic.predicted(ROWS[name]["config"])


def test_hpz_keeps_the_second_micro_batchs_gather_inside_the_node() -> None:
    ratios = RESULTS["hpz_over_flat"]
    assert ratios["predicted_across_nodes_bytes"] == pytest.approx(3 / 4)
    assert ratios["across_nodes_bytes"] == pytest.approx(ratios["predicted_across_nodes_bytes"], rel=0.10)


def test_hsdp_sends_only_the_gradient_shards_all_reduce_across_nodes() -> None:
    """fp32, two micro-batches at --zero 3: FSDP2 over all four ranks sends 4 gathers and a reduce-scatter
    of the whole model across nodes (20 bytes a parameter); HSDP an all-reduce of each rank's half of
    the fp32 gradients (2 bytes a parameter)."""
    assert ROWS["hsdp"]["config"]["parallel"]["dp_shard"] is None  # the default on two nodes
    assert ROWS["fsdp2 zero3"]["config"]["parallel"]["dp_shard"] == 4
    ratios = RESULTS["hsdp_over_fsdp2"]
    assert ratios["predicted_across_nodes_bytes"] == pytest.approx(1 / 10)
    assert ratios["across_nodes_bytes"] == pytest.approx(ratios["predicted_across_nodes_bytes"], rel=0.10)
