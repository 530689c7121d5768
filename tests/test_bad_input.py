"""Bad input everywhere: every verb, flag kind and file `llmtrain` reads.

Each case runs the real entry point (in-process `llmtrain.cli.main`, or a subprocess where the command
gets as far as starting a process group) and asserts what a user relies on: exit code 2, exactly one
short `error: ` line on stderr naming what is wrong and how to fix it, no traceback, and nothing left
on disk a later command would take for real (no run directory, no output directory, no half-prepared
dataset in the cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from llmtrain import config as config_mod
from llmtrain.cli import main
from llmtrain.data.tokenizer import train_tokenizer

MAX_MESSAGE = 400  # one short line


@dataclass(frozen=True)
class Case:
    argv: str  # {w} is the working directory with the files below
    needle: str  # what the message must say (names the flag or file, and the fix)
    absent: tuple[str, ...] = ()  # paths (relative to {w}) that must not exist afterwards


TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("bad_input")
    (w / "good.txt").write_text(TEXT)
    (w / "empty.txt").write_text("")
    (w / "data.xyz").write_text("x")
    (w / "no_files").mkdir()
    (w / "rows.jsonl").write_text('{"content": "a"}\n{"content": "b"}\n')
    (w / "broken.parquet").write_bytes(b"PAR1 not really")
    (w / "bad.yaml").write_text("train:\n  steps: [1\n")
    (w / "list.yaml").write_text("- a\n- b\n")
    (w / "unknown.yaml").write_text("trian:\n  steps: 3\n")
    (w / "wrongtype.yaml").write_text("train:\n  steps: many\n")
    (w / "garbage.json").write_text("{not json")
    (w / "no_eot.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (w / "bad_hosts").write_text("host1 slots=2\nhost2 slots\n")
    (w / "dup_hosts").write_text("host1 slots=2\nhost1 slots=2\n")
    (w / "one_host").write_text("host1 slots=2\n")
    (w / "taken.png").write_bytes(b"")
    train_tokenizer([TEXT], 300, w / "tok.json")
    _make_run_dirs(w)
    return w


def _saved_config() -> str:
    return config_mod.dump_yaml(config_mod.resolve(None, [], {"preset": "debug", "train.steps": "4"}))


def _make_run_dirs(w: Path) -> None:
    """Run directories in the states `resume` must refuse (no process group is ever started), and one
    that has logged a step (for `plot`)."""
    (w / "not_a_run").mkdir()
    for name in ("no_ckpt", "ok_run", "bad_latest", "broken_yaml", "alien_yaml", "list_yaml", "logged"):
        (w / name).mkdir()
        (w / name / "config.yaml").write_text(_saved_config())
    (w / "logged" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 6.0, "lr": 1e-3, "tokens": 64}) + "\n"
    )
    for name in ("ok_run", "bad_latest"):
        (w / name / "checkpoints" / "step_00000002").mkdir(parents=True)
    (w / "bad_latest" / "checkpoints" / "latest").write_text("../../../etc\n")
    (w / "broken_yaml" / "config.yaml").write_text("model: {hidden_size: [\n")
    (w / "alien_yaml" / "config.yaml").write_text(yaml.safe_dump({"model": {"colour": "red"}}))
    (w / "list_yaml" / "config.yaml").write_text("- 1\n")


T = "train --preset debug --steps 2 --run-dir {w}/run"  # every train case must leave {w}/run absent
RUN = ("run", "runs")

CASES: dict[str, Case] = {
    # ---- train: flag values of every type
    "int-not-a-number": Case(f"{T} --steps abc", "--steps: train.steps must be int", RUN),
    "int-not-positive": Case(f"{T} --micro-batch -1", "--micro-batch: must be positive", RUN),
    "float-not-positive": Case(f"{T} --lr -1", "--lr: must be positive", RUN),
    "choice-unknown": Case(
        f"{T} --precision fp8", "--precision: train.precision must be auto | bf16 | fp16 | fp32", RUN
    ),
    "bool-as-word": Case(f"{T} --set train.compile=maybe", "--set: train.compile must be bool", RUN),
    "zero-stage": Case(f"{T} --zero 5", "--zero: invalid stage 5; valid values: 0, 1, 2, 3", RUN),
    "preset-unknown": Case("train --preset huge --run-dir {w}/run", "--preset: unknown preset 'huge'", RUN),
    "set-unknown-key": Case(
        f"{T} --set optim.lrr=1", "unknown config key 'optim.lrr'; did you mean optim.lr?", RUN
    ),
    "set-without-equals": Case(f"{T} --set noequals", "expected section.key=value", RUN),
    "offload-needs-zero": Case(
        f"{T} --offload cpu --zero 0", "--offload: offload cpu needs ZeRO stage 1, 2 or 3", RUN
    ),
    "nvme-needs-path": Case(
        f"{T} --offload nvme --zero 3", "--nvme-path: --offload nvme needs --nvme-path DIR", RUN
    ),
    "batch-not-divisible": Case(f"{T} --global-batch 3 --micro-batch 2", "use a multiple of 2", RUN),
    "seq-len-too-long": Case(
        f"{T} --seq-len 5000", "--seq-len: 5000 exceeds model.max_position_embeddings", RUN
    ),
    "steps-and-tokens": Case(f"{T} --tokens 100", "give either --steps or --tokens, not both", RUN),
    "timeout-not-positive": Case(
        f"{T} --collective-timeout 0", "--collective-timeout: must be positive", RUN
    ),
    # ---- train: layouts DeepSpeed cannot run, refused before any process starts
    "tp-not-dividing-world": Case(
        f"{T} --gpus 2 --tp 3", "--tp: tp 3 x sp 1 x pp 1 = 3 does not divide the world size 2", RUN
    ),
    # 6 heads, debug's 2 key/value heads: tp 3 neither splits nor replicates them evenly
    "tp-kv-heads": Case(
        f"{T} --gpus 3 --tp 3 --set model.hidden_size=96 --set model.num_attention_heads=6",
        "--tp: tp 3 is more than the 2 key/value heads and not a multiple of them",
        RUN,
    ),
    "sp-seq-len": Case(
        f"{T} --gpus 2 --sp 2 --seq-len 33", "--sp: --seq-len 33 is not divisible by sp 2", RUN
    ),
    # debug's 2 key/value heads split 2 ways, not tp 2 x sp 2 = 4
    "tp-sp-heads": Case(
        f"{T} --gpus 4 --tp 2 --sp 2", "--sp: 2 key/value heads are not divisible by tp 2 x sp 2", RUN
    ),
    "partition-without-tp": Case(
        f"{T} --activation-checkpointing full --partition-activations",
        "--partition-activations: splits each checkpointed input over the tensor-parallel ranks",
        RUN,
    ),
    "cpu-checkpointing-without-recompute": Case(
        f"{T} --cpu-checkpointing",
        "--cpu-checkpointing: applies to checkpointed blocks; add --activation-checkpointing full",
        RUN,
    ),
    "tp-vocab": Case(
        f"{T} --gpus 2 --tp 2 --set model.vocab_size=8191",
        "--tp: vocabulary size 8191 is not divisible by tp 2",
        RUN,
    ),
    "tp-zero0": Case(f"{T} --gpus 2 --tp 2 --zero 0", "--zero: ZeRO 0 with --tp/--sp", RUN),
    "pp-zero3": Case(f"{T} --gpus 2 --pp 2 --zero 3", "--zero: ZeRO 3 with --pp", RUN),
    "pp-zero0": Case(f"{T} --gpus 2 --pp 2 --zero 0", "--zero: ZeRO 0 with --pp", RUN),
    "pp-with-sp": Case(f"{T} --gpus 4 --pp 2 --sp 2", "--pp: --pp 2 with --sp 2", RUN),
    "pp-more-stages-than-blocks": Case(
        f"{T} --gpus 4 --pp 4", "--pp: 4 stages for 2 transformer blocks; use at most 2 stages", RUN
    ),
    "pp-not-dividing-world": Case(
        f"{T} --gpus 3 --pp 2", "--pp: tp 1 x sp 1 x pp 2 = 2 does not divide the world size 3", RUN
    ),
    "pp-schedule": Case(f"{T} --gpus 2 --pp 2 --pp-schedule zigzag", "--pp-schedule", RUN),
    # ---- train: ZeRO++ where DeepSpeed cannot run it, refused before any process starts
    "dp-shard-deepspeed": Case(
        f"{T} --gpus 2 --zero 3 --dp-shard 1",
        "--dp-shard: with --engine deepspeed: replicating across shard groups (HSDP) is FSDP2's",
        RUN,
    ),
    "dp-shard-not-dividing": Case(
        f"{T} --gpus 4 --engine fsdp2 --zero 3 --dp-shard 3",
        "--dp-shard: 3 does not divide the 4 data-parallel ranks",
        RUN,
    ),
    "dp-shard-zero": Case(
        f"{T} --gpus 2 --engine fsdp2 --zero 3 --dp-shard 0", "--dp-shard: must be at least 1, got 0", RUN
    ),
    "hpz-zero2": Case(f"{T} --zero 2 --shard-within-node", "--zero: --shard-within-node with --zero 2", RUN),
    "hpz-fsdp2": Case(
        f"{T} --engine fsdp2 --zero 3 --shard-within-node",
        "--engine: --shard-within-node with --engine fsdp2: ZeRO++ is DeepSpeed's",
        RUN,
    ),
    "hpz-tp": Case(
        f"{T} --gpus 2 --zero 3 --tp 2 --shard-within-node",
        "--shard-within-node: with --tp 2 --sp 1: DeepSpeed groups hpZ's ranks by consecutive rank",
        RUN,
    ),
    "hpz-nvme": Case(
        f"{T} --zero 3 --offload nvme --nvme-path {{w}} --shard-within-node",
        "--shard-within-node: with --offload nvme: DeepSpeed 0.19 allocates hpZ's second partition",
        RUN,
    ),
    "hpz-one-node": Case(
        f"{T} --gpus 2 --zero 3 --shard-within-node",
        "--shard-within-node: with one node ZeRO 3 already gathers inside it",
        RUN,
    ),
    "qwz-on-cpu": Case(
        f"{T} --zero 3 --quantize-weights",
        "--quantize-weights: needs a CUDA GPU (this machine runs cpu)",
        RUN,
    ),
    "qgz-on-cpu": Case(
        f"{T} --zero 3 --quantize-grads", "--quantize-grads: needs a CUDA GPU (this machine runs cpu)", RUN
    ),
    # ---- train: what FSDP2 does not map, refused before any process starts
    "engine-unknown": Case(f"{T} --engine megatron", "--engine: train.engine must be deepspeed | fsdp2", RUN),
    "fsdp2-zero1": Case(f"{T} --engine fsdp2 --zero 1", "--zero: ZeRO 1 with --engine fsdp2", RUN),
    "fsdp2-nvme": Case(
        f"{T} --engine fsdp2 --zero 3 --offload nvme --nvme-path {{w}}",
        "--offload: NVMe offload with --engine fsdp2",
        RUN,
    ),
    "fsdp2-fp16": Case(
        f"{T} --engine fsdp2 --zero 3 --precision fp16", "--precision: fp16 with --engine fsdp2", RUN
    ),
    "fsdp2-with-sp": Case(
        f"{T} --gpus 2 --engine fsdp2 --zero 3 --sp 2", "--engine: --engine fsdp2 with --sp/--pp", RUN
    ),
    "fsdp2-tp-over-kv-heads": Case(
        f"{T} --gpus 4 --engine fsdp2 --zero 3 --tp 4",
        "--tp: tp 4 with --engine fsdp2 is more than the 2 key/value heads",
        RUN,
    ),
    "heads-do-not-divide": Case(
        f"{T} --set model.num_attention_heads=3", "3 heads do not divide hidden_size", RUN
    ),
    "run-name-is-a-path": Case(f"{T} --set logging.run_name=../../x", "is not a plain name", (*RUN, "x")),
    "profile-syntax": Case(f"{T} --profile 5-2", "--profile: expected START:STEPS (e.g. 5:2 profiles", RUN),
    "profile-start-zero": Case(f"{T} --profile 0:2", "--profile: START counts steps from 1, got '0:2'", RUN),
    "profile-no-steps": Case(f"{T} --profile 1:0", "--profile: STEPS must be at least 1, got '1:0'", RUN),
    "profile-past-the-run": Case(
        f"{T} --profile 2:3", "--profile: 2:3 profiles steps 2-4, past the run's last step 2", RUN
    ),
    "resume-mode": Case(f"{T} --resume always", "--resume: only `auto` is accepted", RUN),
    "unknown-flag": Case(f"{T} --stepz 3", "No such option: --stepz", RUN),
    # ---- train: the config file
    "config-missing": Case(f"{T} --config {{w}}/missing.yaml", "missing.yaml: file not found", RUN),
    "config-bad-yaml": Case(f"{T} --config {{w}}/bad.yaml", "not valid YAML at line 3; fix the syntax", RUN),
    "config-not-mapping": Case(
        f"{T} --config {{w}}/list.yaml", "expected a mapping of sections, got list", RUN
    ),
    "config-unknown-key": Case(f"{T} --config {{w}}/unknown.yaml", "did you mean train.steps?", RUN),
    "config-wrong-type": Case(
        f"{T} --config {{w}}/wrongtype.yaml", "train.steps must be int or none, got 'many'", RUN
    ),
    # ---- train: data and tokenizer files
    "data-missing": Case(f"{T} --data {{w}}/missing.txt", "missing.txt: file not found", RUN),
    "data-unsupported": Case(f"{T} --data {{w}}/data.xyz", "unsupported file type '.xyz'", RUN),
    "data-empty": Case(f"{T} --data {{w}}/empty.txt", "empty source (no text)", RUN),
    "data-dir-without-files": Case(f"{T} --data {{w}}/no_files", "the directory holds no", RUN),
    "tokenizer-missing": Case(
        f"{T} --tokenizer {{w}}/missing.json", "--tokenizer {w}/missing.json: file not found", RUN
    ),
    "tokenizer-garbage": Case(f"{T} --tokenizer {{w}}/garbage.json", "not a tokenizers JSON file", RUN),
    "tokenizer-too-big": Case(
        f"{T} --tokenizer {{w}}/tok.json --set model.vocab_size=260", "more than model.vocab_size=260", RUN
    ),
    # ---- train: hostfile and launch
    "hostfile-missing": Case(f"{T} --hostfile {{w}}/nohosts", "nohosts: file not found; write one", RUN),
    "hostfile-malformed": Case(
        f"{T} --hostfile {{w}}/bad_hosts", "bad_hosts:2: expected `hostname slots=N`", RUN
    ),
    "hostfile-duplicate": Case(f"{T} --hostfile {{w}}/dup_hosts", "host host1 listed twice", RUN),
    "hostfile-too-few": Case(f"{T} --hostfile {{w}}/one_host --nodes 3", "3 nodes asked for but", RUN),
    "nodes-without-hostfile": Case(f"{T} --nodes 2", "--nodes: 2 nodes need --hostfile", RUN),
    "hostfile-slots-short": Case(
        f"{T} --hostfile {{w}}/one_host --gpus 4", "--gpus: 4 processes per node, but", RUN
    ),
    "launcher-not-installed": Case(
        f"{T} --hostfile {{w}}/one_host --gpus 2 --launcher mvapich", "`mpiname` is not installed", RUN
    ),
    "forward-env-not-a-name": Case(
        f"{T} --hostfile {{w}}/one_host --gpus 2 --forward-env WANDB_API_KEY,a-b",
        "--forward-env: 'a-b' is not an environment variable name",
        RUN,
    ),
    "fresh-run-over-checkpoints": Case(
        "train --preset debug --run-dir {w}/ok_run",
        "already holds checkpoints; continue it with `llmtrain resume",
    ),
    # ---- resume: the run directory, its config and checkpoints
    "resume-missing-dir": Case("resume {w}/nowhere", "no such run directory", ("nowhere",)),
    "resume-not-a-run": Case("resume {w}/not_a_run", "not a run directory (no config.yaml)"),
    "resume-no-checkpoint": Case("resume {w}/no_ckpt", "no checkpoint to resume from; start it with"),
    "resume-breaking-change": Case(
        "resume {w}/ok_run --set model.hidden_size=512",
        "model.hidden_size: 64 -> 512; start a new run instead",
    ),
    "resume-profile-past-the-run": Case(
        "resume {w}/ok_run --profile 4:2", "--profile: 4:2 profiles steps 4-5, past the run's last step 4"
    ),
    "resume-latest-escapes": Case(
        "resume {w}/bad_latest", "not a checkpoint tag (step_NNNNNNNN); refusing it"
    ),
    "resume-broken-yaml": Case("resume {w}/broken_yaml", "config.yaml: unreadable run config"),
    "resume-unknown-key": Case("resume {w}/alien_yaml", "unknown config key 'model.colour'"),
    "resume-config-not-mapping": Case("resume {w}/list_yaml", "not a run config (a list)"),
    # ---- the other verbs
    "config-world-size": Case("config --world-size 0", "--world-size: must be at least 1"),
    "config-out-unwritable": Case(
        "config --out {w}/nowhere/x.json", "--out {w}/nowhere/x.json: cannot write it", ("nowhere",)
    ),
    "estimate-size": Case("estimate-memory --gpu-memory 80XB", "--gpu-memory: cannot read '80XB' as a size"),
    "estimate-params": Case("estimate-memory --params abc", "--params: expected a number such as 7e9"),
    "plan-no-cluster": Case(
        "plan --preset 7b", "--gpu: give a built-in device (--gpu h100) or --cluster FILE"
    ),
    "plan-unknown-gpu": Case("plan --gpu tpu-v5", "--gpu: no built-in device 'tpu-v5'"),
    "plan-gpus-over-node": Case(
        "plan --gpu h100 --gpus 16", "--gpus: 16 per node, but a H100 SXM node has 8"
    ),
    "plan-cluster-missing": Case("plan --cluster {w}/none.yaml", "--cluster {w}/none.yaml: cannot read"),
    "plan-calibrate-with-gpu": Case(
        "plan --calibrate {w}/c.yaml --gpu h100",
        "--calibrate: measures this machine; give it without --gpu and --cluster",
        ("c.yaml",),
    ),
    "plan-nothing-fits": Case(
        "plan --preset 70b --gpu a100-40gb --offload none --seq-len 4096 --global-batch 64",
        "no layout fits 8 x A100 40GB (40.00 GiB each); smallest change that fits: --nodes 8 (64 GPUs)",
    ),
    "prepare-source-missing": Case(
        "prepare-data {w}/missing.txt --tokenizer {w}/tok.json --out {w}/o",
        "missing.txt: file not found",
        ("o",),
    ),
    "prepare-tokenizer-missing": Case(
        "prepare-data {w}/good.txt --tokenizer {w}/nope.json --out {w}/o", "nope.json: file not found", ("o",)
    ),
    "prepare-tokenizer-no-eot": Case(
        "prepare-data {w}/good.txt --tokenizer {w}/no_eot.json --out {w}/o", "no_eot.json", ("o",)
    ),
    "prepare-val-fraction": Case(
        "prepare-data {w}/good.txt --tokenizer {w}/tok.json --out {w}/o --val-fraction 1.5",
        "--val-fraction 1.5: must be in [0, 1)",
        ("o",),
    ),
    "prepare-dtype": Case(
        "prepare-data {w}/good.txt --tokenizer {w}/tok.json --out {w}/o --dtype int8",
        "unknown token dtype",
        ("o",),
    ),
    "prepare-empty-source": Case(
        "prepare-data {w}/empty.txt --tokenizer {w}/tok.json --out {w}/o", "empty source", ("o",)
    ),
    "prepare-missing-field": Case(
        "prepare-data {w}/rows.jsonl --tokenizer {w}/tok.json --out {w}/o", "'text'", ("o",)
    ),
    "prepare-broken-parquet": Case(
        "prepare-data {w}/broken.parquet --tokenizer {w}/tok.json --out {w}/o", "broken.parquet", ("o",)
    ),
    "prepare-num-proc": Case(
        "prepare-data {w}/good.txt --tokenizer {w}/tok.json --out {w}/o --num-proc 0", "--num-proc 0", ("o",)
    ),
    "tokenizer-source-missing": Case(
        "tokenizer train {w}/missing.txt --vocab-size 1000 --out {w}/t.json",
        "missing.txt: file not found",
        ("t.json",),
    ),
    "tokenizer-vocab-too-small": Case(
        "tokenizer train {w}/good.txt --vocab-size 10 --out {w}/t.json",
        "--vocab-size 10: a byte-level BPE needs",
        ("t.json",),
    ),
    "tokenizer-empty-source": Case(
        "tokenizer train {w}/empty.txt --vocab-size 1000 --out {w}/t.json", "empty source", ("t.json",)
    ),
    "plot-not-a-run": Case("plot {w}/not_a_run", "{w}/not_a_run: not a run directory (no config.yaml)"),
    "plot-no-metrics": Case(
        "plot {w}/no_ckpt", "{w}/no_ckpt: no metrics yet (metrics.jsonl holds no training step)"
    ),
    "plot-x-unknown": Case(
        "plot {w}/logged --x time", "--x time: unknown x axis; use --x step or --x tokens"
    ),
    "plot-out-not-png": Case(
        "plot {w}/logged --out {w}/c.jpg", "--out {w}/c.jpg: writes PNG only; give a path ending in .png"
    ),
    "plot-out-exists": Case(
        "plot {w}/logged --out {w}/taken.png", "--out {w}/taken.png: already exists; nothing was changed"
    ),
    "plot-text-with-out": Case(
        "plot {w}/logged --text --out {w}/c.png",
        "--out: --text prints and draws no PNG; drop --out or --text",
    ),
    "plot-text-with-x": Case(
        "plot {w}/logged --text --x tokens", "--x: --text prints and draws no PNG; drop --x or --text"
    ),
    "plot-run-twice": Case("plot {w}/logged {w}/logged", "{w}/logged: given twice; name each RUN_DIR once"),
    "verb-unknown": Case("trian", "No such command 'trian'"),
}


def _argv(case: Case, w: Path) -> list[str]:
    return [arg.replace("{w}", str(w)) for arg in case.argv.split()]


def _assert_one_error_line(err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    assert len(lines[0]) <= MAX_MESSAGE, lines[0]
    assert "Traceback" not in err


def _files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")} if path.exists() else set()


def test_there_are_at_least_thirty_cases_across_the_verbs() -> None:
    assert len(CASES) >= 30
    verbs = {case.argv.split()[0] for case in CASES.values()}
    assert {
        "train",
        "resume",
        "config",
        "estimate-memory",
        "plan",
        "prepare-data",
        "tokenizer",
        "plot",
    } <= verbs


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(
    name: str,
    workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    case = CASES[name]
    monkeypatch.chdir(workdir)  # a default run directory would land in {w}/runs
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE"):  # never inside a launcher here
        monkeypatch.delenv(var, raising=False)
    before = _files_under(workdir)
    assert main(_argv(case, workdir)) == 2
    _assert_one_error_line(capsys.readouterr().err, case.needle.replace("{w}", str(workdir)))
    for rel in case.absent:
        assert not (workdir / rel).exists(), f"{rel} left behind"
    assert _files_under(workdir) == before  # nothing new anywhere (no run dir, no .tmp, no output)
    assert not (tmp_path / "cache" / "data").exists() or _no_dataset(tmp_path / "cache" / "data")


def _no_dataset(data_cache: Path) -> bool:
    """Only lock files: no prepared dataset (manifest or shard) and no half of one."""
    return all(p.name == "locks" or p.parent.name == "locks" for p in data_cache.rglob("*"))


# ---------------------------------------------------------------- through a subprocess
# These get past every up-front check and fail inside the worker (after the process group starts).


def _llmtrain(args: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMTRAIN_CACHE_DIR": str(cache), "DS_ACCELERATOR": "cpu"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "llmtrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_data_rejected_inside_the_worker_leaves_no_run_dir_and_no_dataset(
    tmp_path: Path, workdir: Path, engine: str
) -> None:
    run_dir = tmp_path / "run"
    out = _llmtrain(
        [
            "train",
            "--preset",
            "debug",
            "--steps",
            "2",
            "--engine",
            engine,
            "--zero",
            "3",
            "--run-dir",
            str(run_dir),
            "--data",
            str(workdir / "rows.jsonl"),
        ],
        tmp_path,
        tmp_path / "cache",
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = _error_lines(out.stderr)
    assert len(errors) == 1 and "rows.jsonl" in errors[0] and "'text'" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not run_dir.exists()
    assert _no_dataset(tmp_path / "cache" / "data")


@pytest.mark.slow
def test_a_damaged_checkpoint_under_strict_is_bad_input_naming_the_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(_saved_config())
    tag = run_dir / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "weights.pt").write_bytes(b"0123456789")
    manifest = {
        "format": 1,
        "tag": tag.name,
        "step": 2,
        "world_size": 1,
        "zero_stage": 1,
        "partitioned": False,
    }
    manifest |= {"created": "", "files": [{"path": "weights.pt", "size": 10, "sha256": "0" * 64}]}
    (tag / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "checkpoints" / "latest").write_text(tag.name + "\n")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    out = _llmtrain(["resume", str(run_dir), "--strict"], tmp_path, tmp_path / "cache")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = _error_lines(out.stderr)
    assert len(errors) == 1, out.stderr[-3000:]
    assert "weights.pt: corrupt (sha256 differs from the manifest)" in errors[0]
    assert "strict: refusing to fall back" in errors[0]
    assert "Traceback" not in out.stderr
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # the run dir is left as it was: nothing truncated, nothing added
