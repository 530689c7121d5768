"""The time model against published runs of other trainers and this repository's own GPU run, and the
properties a step's terms must have (llmtrain.planning.timing, llmtrain.planning.hardware)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from bench import bench_plan
from llmtrain.config import resolve
from llmtrain.errors import ConfigError
from llmtrain.planning import memory, timing, traffic
from llmtrain.planning.flops import flops_per_token
from llmtrain.planning.hardware import CLUSTERS, Cluster, builtin_cluster, cluster_from_dict, load_cluster
from llmtrain.planning.timing import StepTime, step_time


@pytest.mark.parametrize("run", bench_plan.runs(), ids=lambda run: run.name)
def test_predicted_tokens_per_gpu_within_1_5x_of_published_and_measured_runs(run: bench_plan.Run) -> None:
    predicted = bench_plan.predict(run)
    assert 1 / 1.5 <= predicted.tokens_per_second_per_device / run.reported <= 1.5


def test_the_mfu_is_the_measured_runs_definition() -> None:
    run = next(r for r in bench_plan.runs() if r.name == "h200-1b-eager")
    measured = json.loads(bench_plan.GPU_RESULTS.read_text())["throughput_1b"]["eager"]
    predicted = bench_plan.predict(run)
    assert predicted.mfu == pytest.approx(
        predicted.tokens_per_second * measured["flops_per_token"] / measured["peak_bf16_flops"]
    )


def _setup(**flags: Any) -> memory.Setup:
    return memory.setup_from_config(resolve(flags=flags))


# ---------------------------------------------------------------- what a step is made of


def _step(cluster: Cluster | None = None, **flags: Any) -> StepTime:
    setup = _setup(
        preset="7b", **{"train.precision": "bf16", "train.seq_len": 4096, "launch.gpus": 8, **flags}
    )
    nodes = setup.cfg.launch.nodes
    return step_time(setup, (cluster or CLUSTERS["h100"]).with_size(setup.cfg.launch.gpus, nodes))


def _term(step: StepTime, name: str) -> float:
    return sum(t.seconds for t in step.terms if t.name == name)


def test_the_terms_add_up_and_the_rates_follow_from_the_step() -> None:
    step = _step(**{"zero.stage": 3, "train.micro_batch": 2, "train.global_batch": 64})
    assert step.seconds == pytest.approx(sum(t.seconds for t in step.terms))
    assert step.tokens_per_step == 64 * step.setup.cfg.train.seq_len
    assert step.tokens_per_second_per_device == pytest.approx(step.tokens_per_step / step.seconds / 8)
    per_token = flops_per_token(step.setup.cfg.model, step.setup.cfg.train.seq_len)
    assert step.mfu == pytest.approx(step.tokens_per_second * per_token / (8 * 989e12))
    assert step.dominant.name == "compute"


def test_zero3_over_nodes_pays_for_the_nic_that_a_node_of_nvlink_does_not() -> None:
    inside = _step(**{"zero.stage": 3, "train.micro_batch": 1})
    # One GPU per node: the same ZeRO group of 8, every ring step over one NIC.
    across = _step(**{"zero.stage": 3, "train.micro_batch": 1, "launch.gpus": 1, "launch.nodes": 8})
    assert _term(across, "data-parallel comm") > 10 * _term(inside, "data-parallel comm")
    assert _term(across, "compute") == pytest.approx(_term(inside, "compute"))


def test_zero3_gathers_again_for_backward_what_it_frees_after_forward() -> None:
    """DeepSpeed frees a weight after its forward when twice the weights used after it reach
    stage3_max_reuse_distance (1e9 here): 7B's blocks but the last two, and its embedding."""
    setup = _setup(preset="7b", **{"zero.stage": 3, "launch.gpus": 8})
    m = setup.cfg.model
    block = (setup.rank_params - 2 * m.vocab_size * m.hidden_size - m.hidden_size) // m.num_hidden_layers
    again = traffic.backward_gathered_elements(setup)
    assert setup.zero["stage3_max_reuse_distance"] == 1_000_000_000
    # Released: the embedding, the 30 first blocks (less their norms, kept whole) and the first
    # projections of the 31st; the rest of the last two blocks' weights are reused within the distance.
    embedding = m.vocab_size * m.hidden_size
    assert embedding + 30 * block < again < embedding + 31 * block
    small = _setup(preset="tiny", **{"zero.stage": 3, "launch.gpus": 8})
    assert traffic.backward_gathered_elements(small) == 0  # the whole model stays gathered


def test_hpz_gathers_across_nodes_once_per_step_and_inside_them_after() -> None:
    """ZeRO 3 over 4 nodes of 8 with 4 micro-batches on 10 Gb/s Ethernet: flat ZeRO 3 gathers the
    weights over the NICs for each forward and again for each backward; hpZ once, then in the node."""
    slow = dataclasses.replace(CLUSTERS["h100"], inter_node_bandwidth=1.25e9).with_size(8, 4)
    flags = {"zero.stage": 3, "train.micro_batch": 1, "train.global_batch": 128, "launch.nodes": 4}
    flat = _step(slow, **flags)
    hpz = _step(slow, **flags, **{"zero.shard_within_node": True})
    assert hpz.setup.zero["zero_hpz_partition_size"] == 8
    weights = hpz.setup.rank_params * 2
    again = traffic.backward_gathered_elements(hpz.setup) * 2
    assert traffic.bytes_by_span(flat.setup, 8) == {
        "inside_node": 0,
        "across_nodes": 8 * weights + 4 * again,
    }
    assert traffic.bytes_by_span(hpz.setup, 8) == {
        "inside_node": 3 * weights + 4 * again,
        "across_nodes": 5 * weights,
    }
    assert _term(hpz, "data-parallel comm") < 0.6 * _term(flat, "data-parallel comm")
    note = next(t.note for t in hpz.terms if t.name == "data-parallel comm")
    inside = 3 + 4 * again / weights  # 3 forwards and 4 backwards' re-gathers
    assert note.startswith(
        f"1 all-gather over the ZeRO group, {inside:.3g} weights' worth inside the node (hpZ)"
    )


def test_more_micro_batches_shrink_the_pipeline_bubble_share() -> None:
    flags = {"zero.stage": 1, "parallel.pp": 4, "train.micro_batch": 1}
    few, many = _step(**flags, **{"train.global_batch": 8}), _step(**flags, **{"train.global_batch": 64})
    share = [_term(s, "pipeline bubble") / s.seconds for s in (few, many)]
    assert share[0] > 3 * share[1] > 0
    assert _term(few, "pipeline sends") > 0


def _shared_cores_pipeline(handoff: float) -> StepTime:
    """pp2 x dp2 of the debug preset on 4 processes sharing 2 cores, as on a calibrated CPU."""
    cpu = dataclasses.replace(CLUSTERS["h100"], host_cores=2, core_handoff=handoff, link_efficiency=1.0)
    setup = _setup(
        preset="debug", **{"train.precision": "fp32", "launch.gpus": 4, "parallel.pp": 2,
                           "train.micro_batch": 1, "train.global_batch": 8}
    )  # fmt: skip
    return step_time(setup, cpu.with_size(4, 1))


def test_a_waiting_stage_hands_its_cores_to_the_stage_at_work_as_far_as_calibrated() -> None:
    kept, handed = _shared_cores_pipeline(0.0), _shared_cores_pipeline(1.0)
    # Nothing handed over: every slot at the heaviest stage's pace (the one with the output layer), and
    # the pp - 1 idle slots lost whole.
    stages = [timing._stage_compute(kept.setup, kept.cluster, span).total for span in kept.setup.spans]
    m = kept.setup.accumulation_steps
    assert max(stages) > 1.05 * sum(stages) / 2  # the output layer's stage is the heavier
    assert _term(kept, "compute") == pytest.approx(m * max(stages))
    assert _term(kept, "pipeline bubble") >= max(stages)
    # All of it: the two stages' ranks fill the two cores, so the work is spread evenly (the stages'
    # mean per slot) and the bubble costs nothing.
    assert _term(handed, "compute") == pytest.approx(m * sum(stages) / 2)
    assert _term(handed, "pipeline bubble") == 0
    half = _shared_cores_pipeline(0.5)
    assert _term(half, "compute") == pytest.approx(m * (max(stages) + sum(stages) / 2) / 2)
    assert handed.seconds < half.seconds < kept.seconds


def test_a_gpu_pipeline_is_paced_by_its_heaviest_stage_whatever_core_handoff_says() -> None:
    flags = {"zero.stage": 1, "parallel.pp": 4, "train.micro_batch": 1, "train.global_batch": 32}
    stingy = dataclasses.replace(CLUSTERS["h100"], core_handoff=0.0)
    assert _step(**flags).seconds == _step(stingy, **flags).seconds


def test_tensor_parallelism_across_nodes_is_slower_than_inside_one() -> None:
    flags = {"zero.stage": 1, "parallel.tp": 2, "train.micro_batch": 1}
    inside = _step(**flags)
    across = _step(**flags, **{"launch.gpus": 1, "launch.nodes": 8})
    assert 0 < _term(inside, "tp all-reduce") < _term(across, "tp all-reduce") / 5


def test_recomputation_costs_compute_and_ulysses_pays_its_all_to_alls() -> None:
    plain = _step(**{"zero.stage": 1, "train.micro_batch": 1})
    full = _step(**{"zero.stage": 1, "train.micro_batch": 1, "train.activation_checkpointing": "full"})
    assert 1.2 < _term(full, "compute") / _term(plain, "compute") < 4 / 3 + 0.01  # + one forward of 3
    sp = _step(**{"zero.stage": 1, "train.micro_batch": 1, "parallel.sp": 2})
    assert _term(sp, "sp all-to-all") > 0


def test_offload_moves_the_step_to_the_host() -> None:
    on_device = _step(**{"zero.stage": 3, "train.micro_batch": 1})
    cpu = _step(**{"zero.stage": 3, "train.micro_batch": 1, "zero.offload": "cpu"})
    assert _term(on_device, "optimizer step") > 0 and _term(cpu, "optimizer step") == 0
    # 7B over 8 ranks, each node's CPU updates all 7B at 2e9 parameters/s.
    assert _term(cpu, "cpu adam") == pytest.approx(cpu.setup.params / 2e9, rel=0.01)
    assert _term(cpu, "offload transfers") > 0


# ---------------------------------------------------------------- clusters as data


def test_a_cluster_file_overrides_a_built_in_and_names_itself_as_the_source(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("base: h100\nnodes: 4\ninter_node_bandwidth: 25e9\n")
    cluster = load_cluster(path)
    assert cluster.nodes == 4 and cluster.world_size == 32
    assert cluster.inter_node_bandwidth == 25e9
    assert cluster.sources["inter_node_bandwidth"] == f"--cluster {path}"
    assert cluster.sources["intra_node_bandwidth"] == CLUSTERS["h100"].sources["intra_node_bandwidth"]
    assert cluster.device == CLUSTERS["h100"].device


def test_a_cluster_file_may_describe_its_own_device(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(
        "devices_per_node: 2\nintra_node_bandwidth: 5e9\ninter_node_bandwidth: 1e9\nhost_bandwidth: 2e10\n"
        "device: {name: this CPU, peak_flops: {fp32: 1.5e11}, memory_bytes: 24e9, memory_bandwidth: 2e10}\n"
    )
    cluster = load_cluster(path)
    assert cluster.device.peak("fp32") == 1.5e11 and cluster.device.memory_bytes == 24_000_000_000
    with pytest.raises(
        ConfigError, match=r"^--precision: this CPU has no peak FLOP/s for bf16; it has fp32$"
    ):
        cluster.device.peak("bf16")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"base": "h100", "nodez": 2}, r"unknown field 'nodez'"),
        ({"base": "h100", "nodes": -1}, r"nodes must be a positive number, got -1"),
        (
            {"device": "h100", "devices_per_node": 8},
            r"give intra_node_bandwidth, inter_node_bandwidth, host_",
        ),
        ({"base": "tpu"}, r"no built-in device 'tpu'"),
        ({"base": "h100", "core_handoff": 1.5}, r"core_handoff is a share of a core, 0 to 1, got 1.5"),
        ({"devices_per_node": 8, "device": {"name": "x"}}, r"device: missing memory_bandwidth, memory_bytes"),
    ],
)
def test_a_bad_cluster_is_one_line_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        cluster_from_dict(dict(data), "--cluster c.yaml")
    assert "\n" not in str(raised.value)


def test_every_built_in_number_has_a_source() -> None:
    for name, cluster in CLUSTERS.items():
        assert builtin_cluster(name.upper()) is cluster
        assert {"intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth"} <= set(cluster.sources)
        assert {"peak_flops", "memory_bytes", "memory_bandwidth", "matmul_efficiency"} <= set(
            cluster.device.sources
        )


def test_bench_plan_records_every_run_with_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_plan, "OUT", tmp_path / "plan.json")
    bench_plan.main()
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert set(doc["runs"]) == {run.name for run in bench_plan.runs()}
    for row in doc["runs"].values():
        ratio = row["predicted_tokens_per_s_per_gpu"] / row["reported_tokens_per_s_per_gpu"]
        assert row["predicted_over_reported"] == pytest.approx(ratio)
    assert {"git_sha", "git_clean", "cpu_model", "torch", "deepspeed"} <= set(doc["machine"])
