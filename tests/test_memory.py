"""estimate-memory: published figures, formulas against the shape, the CLI's table, JSON and errors."""

from __future__ import annotations

import json

import pytest

from llmtrain.cli import main
from llmtrain.config import ConfigError, check_layout, resolve
from llmtrain.planning import layout, memory, rules
from llmtrain.planning.memory import activations
from llmtrain.presets import PRESETS, count_parameters
from llmtrain.units import human


def _setup(params: int | None = None, **flags: object) -> memory.Setup:
    return memory.setup_from_config(resolve(flags=flags), params, shape_known=params is None)


# ---------------------------------------------------------------- published figures


@pytest.mark.parametrize(("stage", "paper_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example_7_5b_on_64_gpus(stage: int, paper_gb: float) -> None:
    # ZeRO paper, Figure 1: 7.5B parameters, Adam, fp16 mixed precision, N_d = 64, no overlapped
    # reduction (the paper's stage 1 keeps full fp16 gradients until the step).
    setup = _setup(
        7_500_000_000,
        **{
            "zero.stage": stage,
            "train.precision": "fp16",
            "launch.gpus": 8,
            "launch.nodes": 8,
            "zero.overlap_comm": False,
        },
    )
    estimated_gb = memory.model_states(setup).total / 1e9
    assert abs(estimated_gb - paper_gb) / paper_gb <= 0.02, estimated_gb


def test_mixed_precision_adam_is_16_bytes_per_parameter_unpartitioned() -> None:
    states = memory.model_states(_setup(1_000_000, **{"zero.stage": 0, "train.precision": "fp16"}))
    assert (states.params_gpu, states.grads_gpu, states.optim_gpu) == (2_000_000, 2_000_000, 12_000_000)


def test_fp32_stage0_has_no_master_copy() -> None:
    states = memory.model_states(_setup(1_000_000, **{"zero.stage": 0, "train.precision": "fp32"}))
    assert states.total == 16_000_000 and states.optim_gpu == 8_000_000


def test_stage3_partitions_everything_and_offload_moves_it_to_the_cpu() -> None:
    flags = {"preset": "7b", "zero.stage": 3, "launch.gpus": 8}
    on_gpu = memory.model_states(_setup(**flags))
    offloaded = memory.model_states(_setup(**flags, **{"zero.offload": "cpu"}))
    p = count_parameters(**PRESETS["7b"])
    persistent = 2 * 65 * 4096  # 65 RMSNorm weights of 4096 < threshold 10 * hidden, kept whole
    assert on_gpu.params_gpu == round(2 * p / 8) + persistent
    assert on_gpu.total == offloaded.total
    assert offloaded.gpu == persistent
    assert offloaded.optim_cpu == round(12 * p / 8)


def test_parameter_tensors_add_up_to_each_presets_count() -> None:
    for name, shape in PRESETS.items():
        cfg = resolve(flags={"preset": name})
        assert sum(memory.parameter_tensors(cfg.model)) == count_parameters(**shape), name


def test_loss_chunk_rows_match_the_model() -> None:
    from llmtrain.loss import LOSS_CHUNK_ROWS

    assert memory.LOSS_CHUNK_ROWS == LOSS_CHUNK_ROWS


def test_buffers_follow_the_generated_deepspeed_config() -> None:
    from llmtrain.planning import dsconfig

    cfg = resolve(flags={"preset": "7b", "zero.stage": 3, "launch.gpus": 8})
    zero = dsconfig.build(cfg, 8, accelerator="cuda")["zero_optimization"]
    terms = {t.name: t for t in memory.estimate(memory.setup_from_config(cfg)).gpu}
    assert terms["reduce bucket"].bytes == 2 * zero["reduce_bucket_size"]
    assert str(f"{zero['stage3_max_live_parameters']:,}") in terms["gathered parameters"].note


# ---------------------------------------------------------------- tensor and sequence parallelism

_7B = {"preset": "7b", "launch.gpus": 8, "zero.stage": 2, "train.micro_batch": 1, "train.seq_len": 4096}
# 7b: hidden 4096, 32 layers, 32 heads (= KV heads), MLP 11008, vocabulary 32000 (untied).
_SPLIT_7B = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # q, k, v, o, gate, up, down of every layer
_VOCAB_7B = 2 * 32000 * 4096  # the embedding and the output layer


def test_tp_halves_the_split_matrices_and_the_vocabulary() -> None:
    whole = _setup(**_7B)
    tp2 = _setup(**_7B, **{"parallel.tp": 2})
    assert whole.rank_params == count_parameters(**PRESETS["7b"]) == 6_738_415_616
    assert whole.rank_params - tp2.rank_params == (_SPLIT_7B + _VOCAB_7B) // 2 == 3_369_074_688
    assert max(memory.parameter_tensors(tp2.cfg.model, 2)) == 16000 * 4096  # embedding / lm_head rows
    states = memory.model_states(tp2)
    assert tp2.zero_group == 4  # ZeRO partitions over the data-parallel ranks: 8 / tp 2
    assert states.params_gpu == 2 * 3_369_340_928
    assert states.optim_gpu == round(12 * 3_369_340_928 / 4)


def test_tp_divides_the_logits_and_sp_under_tp_divides_the_ulysses_buffers() -> None:
    """The vocab-parallel loss computes V / tp logits per rank; under tp x sp each rank exchanges its
    H / tp heads' q, k, v and output."""
    flags = {**_7B, "train.micro_batch": 2}
    one, tp2 = _setup(**flags), _setup(**flags, **{"parallel.tp": 2})
    assert activations.loss_chunk_bytes(tp2) * 2 == activations.loss_chunk_bytes(one)
    sp2, tp2_sp2 = (
        _setup(**flags, **{"parallel.sp": 2}),
        _setup(**flags, **{"parallel.tp": 2, "parallel.sp": 2}),
    )
    assert activations.ulysses_buffer_bytes(tp2_sp2) * 2 == activations.ulysses_buffer_bytes(sp2) > 0
    assert tp2_sp2.zero_group == 4  # 8 / tp 2: ZeRO shards over dp 2 x sp 2


def test_checkpointed_inputs_partitioned_over_tp_or_held_in_host_memory() -> None:
    """DeepSpeed's activation checkpointing: each of the 32 recomputed blocks keeps its input (micro-batch
    1 x 4096 tokens x 4096 wide, bf16) whole, 1/tp of it partitioned, or none of it on the GPU when it
    lives in host memory (8 GPUs' worth per node)."""
    flags = {**_7B, "parallel.tp": 2, "train.activation_checkpointing": "full"}
    plain = memory.estimate(_setup(**flags))
    parted = memory.estimate(_setup(**flags, **{"train.partition_activations": True}))
    host = memory.estimate(_setup(**flags, **{"train.cpu_checkpointing": True}))
    inputs = activations.checkpointed_input_bytes(plain.setup)
    assert inputs == 32 * 2 * 4096 * 4096

    def activation_term(est: memory.Estimate) -> int:
        return {t.name: t.bytes for t in est.gpu}["activations"]

    assert activation_term(plain) - activation_term(parted) == inputs // 2
    assert activation_term(plain) - activation_term(host) == inputs
    assert {t.name: t.bytes for t in host.cpu}["checkpointed activations"] == 8 * inputs
    assert "checkpointed activations" not in {t.name for t in plain.cpu}


def test_sp_replicates_parameters_and_partitions_over_the_whole_world() -> None:
    plain = memory.model_states(_setup(**_7B))
    sp2 = _setup(**_7B, **{"parallel.sp": 2})
    assert sp2.zero_group == 8 and sp2.rank_params == 6_738_415_616
    assert memory.model_states(sp2) == plain


def test_tp_splits_attention_and_mlp_inner_activations_not_the_residual_stream() -> None:
    model = resolve(flags={"preset": "7b"}).model
    tokens = 4096
    one = activations.layer_activation_bytes(model, 1, tokens, "bf16", False)
    two = activations.layer_activation_bytes(model, 1, tokens, "bf16", False, tp=2)
    # Halved: q, k, v, SDPA's output (bf16) and log-sum-exp (fp32 per head), gate, silu, up, product.
    heads = 2 * tokens * 4 * 4096 + 4 * tokens * 32
    assert one - two == (heads + 2 * 4 * tokens * 11008) // 2 == 247_726_080
    # Whole on each tp rank: the two norms (bf16 input + fp32 rsqrt) and q/k/v's, MLP's inputs.
    assert two - (heads + 2 * 4 * tokens * 11008) // 2 == 2 * tokens * (4096 * 2 + 4) + 2 * 2 * tokens * 4096


def test_sp_halves_the_per_token_activations_and_adds_the_all_to_all() -> None:
    model = resolve(flags={"preset": "7b"}).model
    one = activations.layer_activation_bytes(model, 1, 4096, "bf16", False)
    two = activations.layer_activation_bytes(model, 1, 4096, "bf16", False, sp=2)
    # Every saved tensor holds 2048 of the 4096 tokens; o_proj's input is the all-to-all's copy back.
    assert two == one // 2 + 2 * 2048 * 4096 == 331_628_544
    terms = {t.name: t for t in memory.estimate(_setup(**_7B, **{"parallel.sp": 2})).gpu}
    assert terms["Ulysses all-to-all buffers"].bytes == 2 * 2 * 2048 * (4096 + 4096)  # q, k, v in, out back
    assert terms["activations"].note.startswith("saved for backward, micro-batch 1 x 4096 / sp 2 tokens")
    assert "Ulysses all-to-all buffers" not in {t.name for t in memory.estimate(_setup(**_7B)).gpu}


def test_fit_search_proposes_only_layouts_train_accepts_within_a_node() -> None:
    setup = _setup(**{**_7B, "launch.gpus": 4, "launch.nodes": 2, "train.micro_batch": 2})
    found = memory.fitting(setup, 24 * 10**9)
    layouts = {(c.tp, c.sp) for c in found}
    assert {(1, 1), (2, 1), (4, 1), (1, 2), (1, 4)} <= layouts  # never 8: tp/sp do not cross nodes
    for c in found:
        assert 4 % (c.tp * c.sp) == 0
        rules.check(rules.Choice(c.stage, c.offload, "bf16", "cuda", c.tp, c.sp, c.pp))
        lay = layout.Layout(8, c.tp, c.sp, c.pp)
        check_layout(setup.cfg, lay)
        assert c.layout == lay.describe()
        est = memory.estimate(
            setup.with_choice(c.stage, c.offload, c.micro_batch, c.checkpointing, c.tp, c.sp, c.pp)
        )
        assert est.gpu_peak == c.gpu_bytes <= 24 * 10**9
    assert (2, 2) in layouts  # tp x sp inside a node
    # Fastest first: without offload, data parallelism alone, then sp, then tp (with or without sp).
    kinds = [0 if c.tp == c.sp == 1 else 1 if c.tp == 1 else 2 for c in found if c.offload == "none"]
    assert kinds == sorted(kinds)


def test_fit_search_keeps_degrees_the_model_can_split() -> None:
    # debug: 4 heads, 2 KV heads, seq 32 on 8 GPUs: sp stops at 2 (KV heads), tp at 4 (the query heads;
    # each KV head held by two ranks there), never both (2 x 2 would split the KV heads 4 ways).
    setup = _setup(**{"preset": "debug", "launch.gpus": 8, "train.seq_len": 32})
    found = memory.fitting(setup, 80 * 10**9)
    assert {(c.tp, c.sp) for c in found} == {(1, 1), (2, 1), (4, 1), (1, 2)}
    assert not any(c.stage == 0 and c.tp * c.sp > 1 for c in found)


def test_cli_estimates_a_tp_layout(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _cli_json(capsys, "--preset", "7b", "--tp", "2", "--gpus", "8", "--zero", "2")
    assert (doc["setup"]["tp"], doc["setup"]["layout"], doc["setup"]["zero_group"]) == (2, "dp 4 x tp 2", 4)
    # Every matrix, the embedding and the output layer halved (vocab-parallel); the 65 norms (266,240
    # elements) whole: (6,738,415,616 - 266,240) / 2 + 266,240 bf16 parameters.
    assert {r["term"]: r["bytes"] for r in doc["per_gpu"]}["parameters"] == 2 * 3_369_340_928
    assert (
        main(
            [
                "estimate-memory",
                "--preset",
                "7b",
                "--sp",
                "2",
                "--zero",
                "2",
                "--gpus",
                "8",
                "--gpu-memory",
                "80GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dp 4 x sp 2" in out and "Ulysses all-to-all buffers" in out


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512mib", 512 * 2**20),
        ("1000", 1000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert memory.parse_size(text, "--gpu-memory") == expected


@pytest.mark.parametrize("text", ["0GB", "-5GB", "lots", "24XB", ""])
def test_parse_size_rejects_bad_sizes_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--cpu-memory"):
        memory.parse_size(text, "--cpu-memory")


# ---------------------------------------------------------------- what fits


def test_fitting_configurations_fit_and_come_fastest_first() -> None:
    setup = _setup(**{"preset": "7b", "zero.stage": 3, "launch.gpus": 8, "train.micro_batch": 8})
    found = memory.fitting(setup, 24 * 10**9)
    assert found, "a 7B model fits 8 x 24 GB GPUs in some configuration"
    assert found == sorted(found, key=memory.speed_key)
    assert all(c.gpu_bytes <= 24 * 10**9 for c in found)
    for c in found:  # each listed memory is the estimate of that exact configuration
        est = memory.estimate(
            setup.with_choice(c.stage, c.offload, c.micro_batch, c.checkpointing, c.tp, c.sp, c.pp)
        )
        assert est.gpu_peak == c.gpu_bytes
    assert not any(c.stage == 0 for c in found), "unpartitioned 7B states (112 GB) cannot fit 24 GB"
    assert memory.speed_key(found[0]) <= memory.speed_key(found[-1])


def test_cpu_memory_limit_removes_offload_configurations() -> None:
    setup = _setup(**{"preset": "7b", "zero.stage": 3, "launch.gpus": 8})
    unlimited = memory.fitting(setup, 24 * 10**9)
    limited = memory.fitting(setup, 24 * 10**9, cpu_memory=10 * 10**9)
    assert any(c.offload == "cpu" for c in unlimited)
    assert not any(c.offload == "cpu" for c in limited)
    assert all(c.cpu_bytes <= 10 * 10**9 for c in limited)


# ---------------------------------------------------------------- the command line


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["estimate-memory", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_and_json_carry_the_same_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "7b", "--zero", "3", "--offload", "cpu", "--gpus", "8", "--gpu-memory", "24GB"]
    doc = _cli_json(capsys, *args)
    assert main(["estimate-memory", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = doc["per_gpu"] + doc["per_node_cpu"]
    assert rows and doc["verdict"]["fits"] is True
    for row in rows:
        matching = [line for line in lines if f" {row['term']} " in line]
        assert matching and human(row["bytes"]) in matching[0], row
    assert sum(r["bytes"] for r in doc["per_node_cpu"]) == doc["per_node_cpu_bytes"]
    assert any(human(doc["per_gpu_peak_bytes"]) in line for line in lines if "total" in line)
    assert any("Verdict: fits" in line for line in lines)


def test_verdict_says_does_not_fit_with_headroom_negative(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _cli_json(capsys, "--preset", "70b", "--zero", "0", "--gpu-memory", "80GB", "--cpu-memory", "16GB")
    assert doc["verdict"]["fits"] is False and doc["verdict"]["gpu_headroom_bytes"] < 0
    assert doc["fitting_configurations"] == []


def test_raw_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    states_only = _cli_json(capsys, "--params", "7e9", "--zero", "2", "--gpus", "8")
    assert states_only["model_states_per_rank_bytes"] == 2 * 7 * 10**9 + round(16 * 7e9 / 8)
    assert {r["term"]: r["bytes"] for r in states_only["per_gpu"]}["activations"] == 0
    shaped = _cli_json(
        capsys,
        *[
            "--hidden-size",
            "4096",
            "--layers",
            "32",
            "--heads",
            "32",
            "--intermediate-size",
            "11008",
            "--vocab-size",
            "32000",
        ],
    )
    preset = _cli_json(capsys, "--preset", "7b")
    assert shaped["per_gpu"] == preset["per_gpu"]  # the same shape as the 7b preset


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--micro-batch", "0"], "--micro-batch"),
        (["--seq-len", "-4"], "--seq-len"),
        (["--gpu-memory", "0GB"], "--gpu-memory"),
        (["--gpu-memory", "-3GB"], "--gpu-memory"),
        (["--cpu-memory", "many"], "--cpu-memory"),
        (["--params", "0"], "--params"),
        (["--params", "-7e9"], "--params"),
        (["--hidden-size", "0", "--layers", "2", "--heads", "4"], "--hidden-size"),
        (["--hidden-size", "64", "--layers", "-1", "--heads", "4"], "--layers"),
        (["--hidden-size", "64", "--layers", "2", "--heads", "5"], "--heads"),
        (["--hidden-size", "64", "--layers", "2", "--heads", "4", "--kv-heads", "3"], "--kv-heads"),
        (["--preset", "tiny", "--set", "model.num_attention_heads=5"], "num_attention_heads"),
        (["--preset", "tiny", "--set", "model.num_key_value_heads=3"], "num_key_value_heads"),
        (["--preset", "nope"], "--preset"),
        (["--gpus", "0"], "--gpus"),
        (["--tp", "0"], "--tp"),
        (["--tp", "3", "--gpus", "8"], "--tp"),
        (["--sp", "3", "--gpus", "6", "--preset", "7b"], "--sp"),
        (["--tp", "2", "--zero", "0", "--gpus", "2"], "--zero"),
        (["--tp", "2", "--sp", "2", "--gpus", "4", "--preset", "debug"], "--sp"),  # 2 KV heads
        (["--tp", "2", "--gpus", "2", "--params", "7e9"], "--tp"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate-memory", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err
