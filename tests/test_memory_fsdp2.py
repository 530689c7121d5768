"""estimate-memory --engine fsdp2: FSDP2's terms by hand, the fit search, the CLI, and the model states
against the real FSDP2 engine (llmtrain.engine.fsdp2) at world size 2 on gloo.

The debug preset's numbers used below: vocabulary 512, hidden 64, 2 blocks of 46,208 parameters each
(two norms 2 x 64, q and o 64 x 64, k and v 64 x 32, gate, up and down 64 x 176), the root unit
(embedding, final norm, output layer) 2 x 512 x 64 + 64 = 65,600: P = 158,016.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from dist import run_distributed

from llmtrain.cli import main
from llmtrain.config import resolve
from llmtrain.planning import memory, rules
from llmtrain.planning.memory import states

P, ROOT, BLOCK = 158_016, 65_600, 46_208


def _config(stage: int, offload: str = "none", precision: str = "bf16", **flags: Any) -> Any:
    return resolve(
        flags={
            "preset": "debug",
            "train.engine": "fsdp2",
            "zero.stage": stage,
            "zero.offload": offload,
            "train.precision": precision,
            "train.micro_batch": 2,
            "train.seq_len": 32,
            "launch.gpus": 2,
            **flags,
        }
    )


def _terms(stage: int, offload: str = "none", precision: str = "bf16", **flags: Any) -> dict[str, int]:
    est = memory.estimate(memory.setup_from_config(_config(stage, offload, precision, **flags)))
    return {t.name: t.bytes for t in est.gpu + est.cpu}


# ---------------------------------------------------------------- the numbers, by hand


def test_units_are_the_blocks_and_the_root() -> None:
    assert states.shard_units(_config(3).model) == states.ShardUnits(ROOT, BLOCK, 2)
    assert ROOT + 2 * BLOCK == P == memory.setup_from_config(_config(3)).params
    tied = _config(3, **{"model.tie_word_embeddings": True}).model
    assert states.shard_units(tied).root == 512 * 64 + 64  # lm_head is the embedding's Parameter


@pytest.mark.parametrize("stage", [2, 3])
def test_model_states_are_fp32_shards_of_params_grads_and_moments(stage: int) -> None:
    on_gpu = memory.model_states(memory.setup_from_config(_config(stage)))
    assert (on_gpu.params_gpu, on_gpu.grads_gpu, on_gpu.optim_gpu) == (4 * P // 2, 4 * P // 2, 8 * P // 2)
    offloaded = memory.model_states(memory.setup_from_config(_config(stage, "cpu")))
    assert offloaded.gpu == 0
    assert (offloaded.params_cpu, offloaded.grads_cpu, offloaded.optim_cpu) == (
        4 * P // 2,
        4 * P // 2,
        8 * P // 2,
    )
    # fp32 training holds the same: the shards are fp32 whatever the compute dtype.
    assert (
        memory.model_states(memory.setup_from_config(_config(stage, precision="fp32"))).total == 16 * P // 2
    )


def test_hsdp_shards_within_a_node_by_default_on_several_nodes() -> None:
    """2 nodes x 2 GPUs: each parameter sharded over a node's 2 ranks and replicated on the other node
    (HSDP), unless --dp-shard says otherwise; one node shards over all its ranks."""
    two_nodes = {"launch.nodes": 2}
    hsdp = memory.setup_from_config(_config(3, **two_nodes))
    assert hsdp.fsdp_mesh == {"replicate": 2, "shard": 2, "tp": 1}
    assert memory.model_states(hsdp).total == 16 * P // 2
    flat = memory.setup_from_config(_config(3, **two_nodes, **{"parallel.dp_shard": 4}))
    assert flat.fsdp_mesh == {"replicate": 1, "shard": 4, "tp": 1}
    assert memory.model_states(flat).total == 16 * P // 4
    one_node = memory.setup_from_config(_config(3, **{"launch.gpus": 4}))
    assert one_node.fsdp_mesh == {"replicate": 1, "shard": 4, "tp": 1}
    replicated = memory.setup_from_config(_config(3, **{"launch.gpus": 4, "parallel.dp_shard": 1}))
    assert memory.model_states(replicated).total == 16 * P
    # The buffers are per unit, whatever the mesh.
    assert _terms(3, **two_nodes)["gathered parameters"] == _terms(3)["gathered parameters"]


def test_hsdp_traffic_keeps_the_gathers_inside_the_node() -> None:
    from llmtrain.planning import traffic

    setup = memory.setup_from_config(_config(3, **{"launch.nodes": 2, "train.global_batch": 16}))
    assert setup.accumulation_steps == 2
    found = traffic.fsdp2_collectives(setup)
    assert [(c.kind, c.nbytes, c.count, traffic.group_ranks(setup, c.group)) for c in found] == [
        ("all-gather", 2 * P, 4, [0, 1]),  # bf16, two micro-batches, gathered again for backward
        ("reduce-scatter", 4 * P, 1, [0, 1]),
        ("all-reduce", 4 * P // 2, 1, [0, 2]),  # each rank's fp32 shard, across the nodes
    ]
    assert traffic.bytes_by_span(setup, ranks_per_node=2) == {
        "inside_node": 4 * 2 * P + 4 * P,
        "across_nodes": 2 * P,
    }


def test_gathered_parameters_and_reduce_scatter_buffers() -> None:
    # --zero 3: the root, the running block and one all-gather output; --zero 2: every unit and the
    # last block's all-gather output. In the model dtype.
    assert _terms(3)["gathered parameters"] == 2 * (ROOT + 2 * BLOCK)
    assert _terms(2)["gathered parameters"] == 2 * (ROOT + 3 * BLOCK)
    assert _terms(2, precision="fp32")["gathered parameters"] == 4 * (ROOT + 3 * BLOCK)
    # The largest unit (the root) unsharded in the model dtype plus its fp32 reduce-scatter input.
    assert _terms(3)["reduce-scatter buffers"] == (2 + 4) * ROOT
    assert _terms(3, precision="fp32")["reduce-scatter buffers"] == (4 + 4) * ROOT
    # Offloading moves the states, not the gathering and reducing, off the GPU.
    offloaded = _terms(3, "cpu")
    assert offloaded["gathered parameters"] == 2 * (ROOT + 2 * BLOCK)
    assert offloaded["offloaded optimizer states"] == 2 * 8 * P // 2  # per node: 2 GPUs
    assert "pinned staging buffers" not in _terms(2, "cpu")  # DeepSpeed's, not FSDP2's


def test_gradient_accumulation_keeps_fp32_gradients_unsharded() -> None:
    assert "accumulated gradients" not in _terms(3)
    assert _terms(3, **{"train.global_batch": 8})["accumulated gradients"] == 4 * P  # 2 micro-batches


def test_deepspeed_buffers_are_not_fsdp2s() -> None:
    fsdp2 = _terms(3)
    deepspeed = _terms(3, **{"train.engine": "deepspeed"})
    assert "reduce bucket" in deepspeed and "reduce bucket" not in fsdp2
    assert "gathered parameters" in deepspeed  # ZeRO-3's own, from its live-parameter limits
    assert fsdp2["activations"] == deepspeed["activations"]  # the same model, the same activations


# ---------------------------------------------------------------- what fits


def test_fit_search_proposes_only_what_fsdp2_runs() -> None:
    setup = memory.setup_from_config(
        resolve(flags={"preset": "7b", "train.engine": "fsdp2", "zero.stage": 3, "launch.gpus": 8})
    )
    found = memory.fitting(setup, 80 * 10**9)
    # ZeRO 2 or 3 x offload none or cpu, with data and tensor parallelism: never an sp or pp degree.
    assert {(c.stage, c.offload) for c in found} == {(2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")}
    assert {c.tp for c in found} > {1}
    for c in found:
        assert (c.engine, c.sp, c.pp) == ("fsdp2", 1, 1)
        rules.check(rules.Choice(c.stage, c.offload, "bf16", "cuda", tp=c.tp, engine="fsdp2"))
        est = memory.estimate(setup.with_choice(c.stage, c.offload, c.micro_batch, c.checkpointing, c.tp, 1))
        assert est.gpu_peak == c.gpu_bytes <= 80 * 10**9


# ---------------------------------------------------------------- the command line

_CLI = ["estimate-memory", "--engine", "fsdp2", "--preset", "debug", "--gpus", "2", "--micro-batch", "2"]


def test_cli_prints_fsdp2s_terms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_CLI, "--zero", "3", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 --zero 3 (reshard after forward)" in out
    for term in ("fp32 shards / 2 ranks, the masters", "gathered parameters", "reduce-scatter buffers"):
        assert term in out, term


def test_cli_json_has_fsdp2s_terms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_CLI, "--zero", "3", "--seq-len", "32", "--offload", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["setup"]["engine"], doc["setup"]["zero_stage"]) == ("fsdp2", 3)
    gpu = {r["term"]: r["bytes"] for r in doc["per_gpu"]}
    cpu = {r["term"]: r["bytes"] for r in doc["per_node_cpu"]}
    assert (gpu["parameters"], gpu["gradients"], gpu["optimizer states"]) == (0, 0, 0)
    assert gpu["gathered parameters"] == 2 * (ROOT + 2 * BLOCK)
    assert gpu["reduce-scatter buffers"] == 6 * ROOT
    assert cpu == {
        "offloaded parameters": 4 * P,
        "offloaded gradients": 4 * P,
        "offloaded optimizer states": 8 * P,
    }
    assert doc["model_states_per_rank_bytes"] == 16 * P // 2


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--zero", "1"], "--zero"),
        (["--zero", "0"], "--zero"),
        (["--zero", "3", "--offload", "nvme", "--nvme-path", "/tmp"], "--offload"),
        (["--zero", "3", "--precision", "fp16"], "--precision"),
        (["--zero", "3", "--sp", "2"], "--engine"),
    ],
)
def test_cli_refuses_what_fsdp2_does_not_run(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_CLI, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}: ") and "fsdp2" in err[0], err


# ---------------------------------------------------------------- against the real engine

# (stage, offload, precision, tp)
CASES = [
    (2, "none", "bf16", 1),
    (3, "none", "bf16", 1),
    (2, "none", "fp32", 1),
    (3, "none", "fp32", 1),
    (2, "cpu", "bf16", 1),
    (3, "cpu", "bf16", 1),
]


def _case_config(case: tuple[int, str, str, int], flags: dict[str, Any]) -> Any:
    stage, offload, precision, tp = case
    return _config(stage, offload, precision, **{"parallel.tp": tp}, **flags)


def _measure_engines(
    rank: int, world: int, cases: list[tuple[int, str, str, int]], flags: dict[str, Any]
) -> dict[tuple, tuple[int, int]]:
    """Each case's (parameter, model-state) bytes on this rank after an update (AdamW's moments exist)
    and the next backward (gradients held), the config taking `flags`."""
    from llmtrain.engine.fsdp2 import build_engine, held_model_states
    from llmtrain.planning import fsdp2_plan

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))  # debug vocabulary
    batch = {"input_ids": ids, "labels": ids}
    measured = {}
    for case in cases:
        cfg = _case_config(case, flags)
        engine = build_engine(cfg, fsdp2_plan.build(cfg, world), torch.device("cpu"), "cpu")
        engine.backward(engine.forward(batch), last=True, skip=False)
        engine.update(skip=False)
        engine.backward(engine.forward(batch), last=True, skip=False)
        held = held_model_states(engine)
        measured[case] = (held.params, held.total)
    return measured


def _calibration_errors(
    cases: list[tuple[int, str, str, int]], flags: dict[str, Any], ranks: list[dict[tuple, tuple[int, int]]]
) -> list[tuple[str, float]]:
    """(what, relative error) of the estimated parameters and model states against each rank's."""
    errors: list[tuple[str, float]] = []  # printed (pytest -s): the calibration's relative errors
    for case in cases:
        states = memory.model_states(memory.setup_from_config(_case_config(case, flags)))
        estimated = {"parameters": states.params_gpu + states.params_cpu, "model states": states.total}
        for rank, measured in enumerate(ranks):
            for (what, estimate), held in zip(estimated.items(), measured[case], strict=True):
                line = f"{'/'.join(map(str, case))} rank {rank} {what}: estimated {estimate}, engine holds {held}"
                errors.append((line, (estimate - held) / held))
    for line, error in errors:
        print(f"{error:+.3%}  {line}")
    return errors


@pytest.mark.slow
def test_model_states_match_the_real_fsdp2_engine_within_5_percent() -> None:
    errors = _calibration_errors(CASES, {}, run_distributed(_measure_engines, 2, CASES, {}))
    failures = [line for line, error in errors if abs(error) > 0.05]
    assert not failures, "\n".join(failures)


# HSDP: 2 replicas x 2 shards; the last, dp 2 x tp 2 (DTensor tp, parallel.dtensor_tp: each rank holds
# 1/dp of its tp slices).
WORLD4_CASES = [(3, "none", "fp32", 1), (2, "none", "bf16", 1), (3, "cpu", "bf16", 1), (3, "none", "fp32", 2)]


@pytest.mark.slow
def test_hsdp_and_tp_model_states_match_the_real_engine_at_world_size_4_within_2_percent() -> None:
    """2 nodes x 2 ranks as the estimator sees them; the engine's mesh is its plan from the same config
    at world size 4. 4 processes on one machine, ~20 s."""
    flags = {"launch.nodes": 2}
    ranks = run_distributed(_measure_engines, 4, WORLD4_CASES, flags)
    errors = _calibration_errors(WORLD4_CASES, flags, ranks)
    failures = [line for line, error in errors if abs(error) > 0.02]
    assert not failures, "\n".join(failures)
