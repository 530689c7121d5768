"""estimate-memory --pp: the heaviest stage's model states, per-stage activations under 1F1B and GPipe,
the bubble, the JSON and table, the errors, and pipelines in the fit search. Arithmetic only: no
DeepSpeed process starts."""

from __future__ import annotations

import json

import pytest

from llmtrain.cli import main
from llmtrain.config import check_layout, resolve
from llmtrain.planning import layout, memory, rules, stages
from llmtrain.planning.memory import activations, pipeline

# debug: vocab 512, hidden 64, MLP 176, 2 blocks, 4 heads of 16, 2 KV heads. Per block: two norms 128,
# q and o 64 x 64, k and v 64 x 32, gate, up and down 64 x 176 = 46,208; embedding = output layer =
# 512 x 64 = 32,768; final norm 64. With pp 2 each stage runs one block:
STAGE0_PARAMS = 32_768 + 46_208  # embedding, block 0
STAGE1_PARAMS = 46_208 + 64 + 32_768  # block 1, final norm, output layer: the heaviest
_DEBUG_PP2 = {
    "preset": "debug",
    "parallel.pp": 2,
    "train.micro_batch": 2,
    "train.seq_len": 32,
    "train.global_batch": 8,  # dp 1: m = 8 / (2 x 1) = 4 micro-batches per step
    "launch.gpus": 2,
}

# One micro-batch (2 x 32 = 64 tokens, bf16) on each stage, by hand:
#   one block saves 148,992 B: norms 2 x (64 x 64 x 2 + 4 x 64) = 16,896; attention: normed input
#   2 x 64 x 64 = 8,192, q, k, v, SDPA output 2 x 64 x (64 + 64 + 32 + 32) = 24,576, log-sum-exp
#   4 x 64 x 4 = 1,024; MLP: input 8,192 + gate, silu, up, product 4 x 2 x 64 x 176 = 90,112.
#   Its own RoPE cos and sin: 2 x 2 x 64 x 16 = 4,096. The residual stream: 2 x 64 x 64 = 8,192.
BLOCK, ROPE, RESIDUAL = 148_992, 4_096, 8_192
POSITIONS = 8 * 64  # int64, passed along with the hidden states
# Stage 0: block 0, the embedding's int64 ids (512), its output kept for backward, the positions.
STAGE0_MICRO = BLOCK + ROPE + 8 * 64 + RESIDUAL + POSITIONS
# Stage 1: block 1, the received input, positions and labels; the final norm (64 x 64 x 2 + 4 x 64), the
# fused loss's gradients for the hidden states and the output weight (2 x 512 x 64), the token count.
STAGE1_MICRO = BLOCK + ROPE + RESIDUAL + 2 * POSITIONS + (64 * 64 * 2 + 4 * 64) + RESIDUAL + 2 * 512 * 64 + 8


def _setup(**flags: object) -> memory.Setup:
    return memory.setup_from_config(resolve(flags=flags))


def test_the_per_block_bytes_are_the_estimators() -> None:
    model = resolve(flags={"preset": "debug"}).model
    assert activations.layer_activation_bytes(model, 2, 32, "bf16", False) == BLOCK
    assert (STAGE0_MICRO, STAGE1_MICRO) == (162_304, 244_488)


# ---------------------------------------------------------------- model states


def test_stage_parameters_and_the_heaviest_stage() -> None:
    setup = _setup(**_DEBUG_PP2)
    assert [span.parameters for span in setup.spans] == [STAGE0_PARAMS, STAGE1_PARAMS]
    assert setup.state_span.index == 1 and setup.rank_params == STAGE1_PARAMS
    assert [span.blocks for span in setup.spans] == [1, 1]


def test_states_are_the_heaviest_stages_with_zero1_over_its_dp_ranks() -> None:
    # 4 GPUs, pp 2: dp 2 replicas of each stage. ZeRO 1 in bf16 (BF16_Optimizer): bf16 parameters 2 B,
    # bf16 grads + a full fp32 accumulation buffer 6 B, fp32 master + moments 12 B / dp 2.
    setup = _setup(**{**_DEBUG_PP2, "launch.gpus": 4})
    states = memory.model_states(setup)
    assert setup.zero_group == 2
    assert (states.params_gpu, states.grads_gpu, states.optim_gpu) == (
        2 * STAGE1_PARAMS,
        6 * STAGE1_PARAMS,
        12 * STAGE1_PARAMS // 2,
    )
    assert states.total == 14 * STAGE1_PARAMS == 1_106_560
    stage0 = memory.model_states(setup.for_stage(0))
    assert stage0.total == 14 * STAGE0_PARAMS


def test_a_tied_output_layer_is_a_copy_on_the_last_stage() -> None:
    setup = _setup(**{**_DEBUG_PP2, "model.tie_word_embeddings": True})
    assert setup.params == 158_016 - 32_768  # one embedding in the one-process model
    assert [span.parameters for span in setup.spans] == [STAGE0_PARAMS, STAGE1_PARAMS]


# ---------------------------------------------------------------- activations and the bubble


def test_one_micro_batch_on_each_stage() -> None:
    setup = _setup(**_DEBUG_PP2)
    assert [activations.activation_bytes(setup, s) for s in (0, 1)] == [STAGE0_MICRO, STAGE1_MICRO]


def test_1f1b_holds_pp_micro_batches_on_the_first_stage_and_gpipe_all_m() -> None:
    one_f_one_b = _setup(**_DEBUG_PP2)
    gpipe = _setup(**_DEBUG_PP2, **{"parallel.pp_schedule": "gpipe"})
    assert one_f_one_b.accumulation_steps == gpipe.accumulation_steps == 4
    assert [one_f_one_b.in_flight(s) for s in (0, 1)] == [2, 1]
    assert [gpipe.in_flight(s) for s in (0, 1)] == [4, 4]
    terms = {t.name: t.bytes for t in memory.estimate(one_f_one_b).gpu}
    assert terms["activations"] == 2 * STAGE0_MICRO == 324_608  # stage 0, the peak
    terms = {t.name: t.bytes for t in memory.estimate(gpipe).gpu}
    assert terms["activations"] == 4 * STAGE1_MICRO == 977_952  # stage 1: its micro-batch is larger


def test_1f1b_never_holds_more_than_the_step_runs() -> None:
    assert pipeline.in_flight("1f1b", 4, 2, 0) == 2  # m 2 on 4 stages
    assert pipeline.in_flight("1f1b", 4, 8, 3) == 1
    assert pipeline.in_flight("gpipe", 1, 8, 0) == 1  # no pipeline: accumulation, one at a time


def test_selective_checkpointing_counts_each_stages_own_blocks() -> None:
    # tiny has 8 blocks; every 3rd is recomputed (0, 3, 6): two on stage 0 (0-3), one on stage 1 (4-7).
    assert activations.checkpointed_in(range(0, 4), "selective", 3) == 2
    assert activations.checkpointed_in(range(4, 8), "selective", 3) == 1
    assert activations.checkpointed_in(range(4, 8), "full", 3) == 4


def test_the_loss_belongs_to_the_last_stage_and_the_embedding_to_the_first() -> None:
    setup = _setup(**_DEBUG_PP2)
    first, last = setup.spans
    assert (first.embedding, first.head, last.embedding, last.head) == (True, False, False, True)
    terms = {t.name: t for t in memory.estimate(setup).gpu}
    assert terms["logits and loss"].note.endswith("last stage only")
    assert terms["pipeline receive buffers"].bytes == RESIDUAL  # pp 2: one buffer on each end stage


@pytest.mark.parametrize(("pp", "m", "bubble"), [(2, 4, 0.2), (4, 4, 3 / 7), (1, 8, 0.0), (8, 1, 7 / 8)])
def test_bubble_fraction(pp: int, m: int, bubble: float) -> None:
    assert stages.bubble_fraction(pp, m) == pytest.approx(bubble)


def test_one_stage_is_the_model_without_a_pipeline() -> None:
    plain = _setup(**{**_DEBUG_PP2, "parallel.pp": 1})
    assert plain.bubble == 0.0 and plain.in_flight(0) == 1
    assert memory.estimate(plain).to_dict()["pipeline"] is None


# ---------------------------------------------------------------- the command line


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["estimate-memory", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


_ARGS = ["--preset", "debug", "--gpus", "2", "--pp", "2", "--micro-batch", "2", "--seq-len", "32"]


def test_json_carries_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _cli_json(capsys, *_ARGS, "--global-batch", "8")
    s = doc["setup"]
    assert (s["pp"], s["pp_schedule"], s["layout"], s["zero_group"]) == (2, "1f1b", "dp 1 x pp 2", 1)
    assert (s["global_batch"], s["gradient_accumulation_steps"]) == (8, 4)
    pipe = doc["pipeline"]
    assert pipe["bubble_fraction"] == pytest.approx(0.2)
    assert (pipe["stages"], pipe["micro_batches"], pipe["heaviest_stage"], pipe["activation_peak_stage"]) == (
        2,
        4,
        1,
        0,
    )
    stages = pipe["per_stage"]
    assert [st["params"] for st in stages] == [STAGE0_PARAMS, STAGE1_PARAMS]
    assert [st["model_states_bytes"] for st in stages] == [20 * STAGE0_PARAMS, 20 * STAGE1_PARAMS]
    assert [st["in_flight_micro_batches"] for st in stages] == [2, 1]
    assert [st["activations_per_micro_batch_bytes"] for st in stages] == [STAGE0_MICRO, STAGE1_MICRO]
    assert [st["activations_bytes"] for st in stages] == [2 * STAGE0_MICRO, STAGE1_MICRO]
    assert [st["layers"] for st in stages] == ["embedding, block 0", "block 1, final norm, output layer"]
    rows = {r["term"]: r["bytes"] for r in doc["per_gpu"]}
    assert rows["parameters"] == 2 * STAGE1_PARAMS and rows["activations"] == 2 * STAGE0_MICRO
    assert doc["model_states_per_rank_bytes"] == 20 * STAGE1_PARAMS


def test_gpipe_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _cli_json(
        capsys, *_ARGS, "--global-batch", "8", "--pp-schedule", "gpipe", "--pp-partition", "blocks"
    )
    assert (doc["pipeline"]["schedule"], doc["pipeline"]["partition"]) == ("gpipe", "blocks")
    assert [st["in_flight_micro_batches"] for st in doc["pipeline"]["per_stage"]] == [4, 4]
    assert {r["term"]: r["bytes"] for r in doc["per_gpu"]}["activations"] == 4 * STAGE1_MICRO


def test_the_table_prints_the_bubble_and_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate-memory", *_ARGS, "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "dp 1 x pp 2" in out
    assert "bubble (pp - 1) / (m + pp - 1) = 1/5 = 20.0% of each step idle" in out
    assert "model states of stage 1 (the heaviest) + activations of stage 0 (the peak)" in out
    assert "Pipeline stages" in out and "block 1, final norm, output layer" in out


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--preset", "debug", "--gpus", "2", "--pp", "2", "--zero", "3"], "--zero"),
        (["--preset", "debug", "--gpus", "2", "--pp", "2", "--zero", "2"], "--zero"),
        (["--preset", "debug", "--gpus", "2", "--pp", "2", "--zero", "0"], "--zero"),
        (["--preset", "debug", "--gpus", "4", "--pp", "2", "--sp", "2"], "--pp"),
        (["--preset", "debug", "--gpus", "4", "--pp", "4"], "--pp"),  # 4 stages for 2 blocks
        (["--preset", "debug", "--gpus", "3", "--pp", "2"], "--pp"),  # 2 does not divide 3
        (["--params", "7e9", "--gpus", "2", "--pp", "2"], "--pp"),  # no shape to cut into stages
        (["--preset", "debug", "--gpus", "2", "--pp", "2", "--global-batch", "7"], "--global-batch"),
        (["--preset", "debug", "--gpus", "2", "--pp", "2", "--pp-schedule", "zb"], "--pp-schedule"),
    ],
)
def test_bad_pipeline_input_is_one_line_and_exit_2(
    args: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate-memory", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err


# ---------------------------------------------------------------- the fit search


def _fit(gpu_memory: int, **flags: object) -> tuple[memory.Setup, list[memory.Candidate]]:
    setup = _setup(**flags)
    return setup, memory.fitting(setup, gpu_memory)


def test_fit_proposes_pipelines_only_where_they_compose() -> None:
    # tiny (8 blocks) on 2 nodes of 4 GPUs: pipelines of 2, 4 and 8 stages (across nodes), never 16,
    # alone or with tp inside a node.
    setup, found = _fit(
        80 * 10**9, preset="tiny", **{"launch.gpus": 4, "launch.nodes": 2, "train.micro_batch": 4}
    )
    piped = [c for c in found if c.pp > 1]
    assert {c.pp for c in piped} == {2, 4, 8}
    assert {(c.tp, c.pp) for c in piped} >= {(2, 2), (4, 2), (2, 4)}  # tp x pp: 3D layouts searched
    for c in piped:
        assert (c.sp, c.stage) == (1, 1) and 4 % c.tp == 0 and c.offload != "nvme"
        rules.check(rules.Choice(c.stage, c.offload, "bf16", "cuda", c.tp, c.sp, c.pp))
        lay = layout.Layout(8, c.tp, c.sp, c.pp)
        check_layout(setup.cfg, lay)
        assert c.layout == lay.describe()
        # The setup's global batch (4 x 8 = 32) kept: a whole number of micro-batches per pipeline.
        m = 32 // (c.micro_batch * lay.dp)
        assert m * c.micro_batch * lay.dp == 32
        assert c.bubble == pytest.approx(stages.bubble_fraction(c.pp, m))
        est = memory.estimate(
            setup.with_choice(c.stage, c.offload, c.micro_batch, c.checkpointing, c.tp, c.sp, c.pp)
        )
        assert est.gpu_peak == c.gpu_bytes and est.setup.accumulation_steps == m


def test_fit_keeps_pipelines_within_the_models_blocks() -> None:
    # debug has 2 blocks: on 8 GPUs only pp 2.
    _, found = _fit(80 * 10**9, preset="debug", **{"launch.gpus": 8, "train.seq_len": 32})
    assert {c.pp for c in found} == {1, 2}
    _, found = _fit(80 * 10**9, preset="debug", **{"launch.gpus": 1})
    assert {c.pp for c in found} == {1}


def test_fit_ranks_a_pipeline_after_the_layouts_without_one_at_equal_speed() -> None:
    _, found = _fit(80 * 10**9, preset="tiny", **{"launch.gpus": 4, "train.micro_batch": 4})
    assert found == sorted(found, key=memory.speed_key)
    for offload in ("none", "cpu"):
        for mode in ("none", "selective", "full"):
            peers = [c for c in found if (c.offload, c.checkpointing, c.tp, c.sp) == (offload, mode, 1, 1)]
            piped = [c.pp > 1 for c in peers]
            assert any(piped) and piped == sorted(piped), peers  # every stage and micro-batch first
            bubbles = [c.bubble for c in peers]
            assert bubbles == sorted(bubbles)


def test_bare_params_search_no_pipeline() -> None:
    setup = memory.setup_from_config(resolve(flags={"launch.gpus": 4}), 7 * 10**9, shape_known=False)
    assert all(c.pp == 1 for c in memory.fitting(setup, 80 * 10**9))
