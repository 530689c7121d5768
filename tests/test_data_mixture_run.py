"""A two-source mixture trained through the real entry point: per-source counts, exhaustion and
validation losses in metrics.jsonl and on the console, a SIGKILL then `resume` (bitwise the
uninterrupted run), and a `fork` that changes the weights.

One module fixture runs everything, two processes at a time (each single-threaded): the reference run
beside one that is killed mid-run, then the resume beside the fork.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from runkit import kill_tree, losses, metrics, run_env, start, wait_for

STEPS, GLOBAL_BATCH, SEQ = 50, 4, 32
FORK_STEP, FORK_STEPS = 20, 30


def _write(path: Path, words: list[str], docs: int, length: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(words, k=length))}) + "\n" for _ in range(docs))
    )


@dataclass
class Runs:
    reference: Path
    killed: Path
    fork: Path
    outputs: dict[str, str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("mixrun")
    _write(tmp / "a.jsonl", [f"alpha{i}" for i in range(50)] + ["the", "of"], 200, 40, 0)
    for part in range(2):  # b: a directory, small enough to run out (about 15 training sequences)
        _write(tmp / "b" / f"part{part}.jsonl", [f"beta{i}" for i in range(20)], 6, 30, part + 1)
    a, b = str(tmp / "a.jsonl"), str(tmp / "b")
    env = run_env(LLMTRAIN_CACHE_DIR=str(tmp / "cache"))
    flags = [
        "--preset", "debug", "--micro-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ), "--precision", "fp32",
        "--log-every", "1", "--steps", str(STEPS), "--save-every", str(FORK_STEP), "--eval-every", str(STEPS),
        "--set", "train.eval_batches=1", "--set", "data.val_fraction=0.25", "--set", "data.num_proc=1", "--data", f"{a}:0.8", "--data", f"{b}:0.2",
    ]  # fmt: skip
    reference, killed, fork = tmp / "reference", tmp / "killed", tmp / "fork"
    ref_run = start(["train", *flags, "--run-dir", str(reference)], tmp / "reference.log", env)
    # Stuck before step 31 (a fault that never returns), then SIGKILLed: the last checkpoint is step 20.
    hung = start(
        ["train", *flags, "--run-dir", str(killed)],
        tmp / "killed.log",
        {**env, "LLMTRAIN_FAULTS": "hang@0:30"},
    )
    wait_for(
        lambda: max(losses(killed), default=0) >= 30 or hung.proc.poll() is not None,
        240,
        "step 30 of the run to kill",
    )
    kill_tree(hung.proc.pid)
    assert hung.proc.wait(30) == -9 and max(losses(killed)) == 30, hung.output()[-3000:]
    outputs = {"reference": _ok(ref_run.wait(240))}

    resumed = start(["resume", str(killed)], tmp / "resumed.log", env)
    forked = start(
        ["fork", str(reference), "--step", str(FORK_STEP), "--run-dir", str(fork), "--steps", str(FORK_STEPS),
         "--data", f"{a}:0.5", "--data", f"{b}:0.5"],
        tmp / "fork.log",
        env,
    )  # fmt: skip
    outputs["resumed"] = _ok(resumed.wait(240))
    outputs["fork"] = _ok(forked.wait(240))
    return Runs(reference, killed, fork, outputs)


def _ok(result: tuple[int, str]) -> str:
    code, output = result
    assert code == 0, output[-3000:]
    return output


def _train_records(run_dir: Path) -> dict[int, dict]:
    return {int(r["step"]): r for r in metrics(run_dir) if "loss" in r}  # type: ignore[arg-type]


def test_each_source_gets_its_weight_of_the_tokens(runs: Runs) -> None:
    last = _train_records(runs.reference)[STEPS]
    tokens = {name: s["tokens"] for name, s in last["sources"].items()}
    assert sum(tokens.values()) == last["tokens"] == STEPS * GLOBAL_BATCH * SEQ
    assert abs(tokens["a"] / last["tokens"] - 0.8) <= 0.02 and abs(tokens["b"] / last["tokens"] - 0.2) <= 0.02
    for step, record in _train_records(runs.reference).items():  # within one sequence at every step
        assert abs(record["sources"]["b"]["tokens"] - 0.2 * step * GLOBAL_BATCH * SEQ) <= SEQ, step
    summary = runs.outputs["reference"]
    assert re.search(rf"tokens a +│ +{tokens['a']:,} \(80\.0%\), epoch 1 │", summary), summary[-1500:]
    assert re.search(r"tokens b +│ +[0-9,]+ \(20\.0%\), epoch [2-9] │", summary), summary[-1500:]


def test_a_source_that_runs_out_is_repeated_and_reported(runs: Runs) -> None:
    warnings = [line for line in runs.outputs["reference"].splitlines() if "exhausted" in line]
    assert warnings, runs.outputs["reference"][-3000:]
    assert warnings[0].startswith("warning: data source b exhausted after ")
    assert warnings[0].endswith("; repeating it (epoch 2)")
    epoch = _train_records(runs.reference)[STEPS]["sources"]["b"]["epoch"]
    assert epoch >= 2 and len(warnings) == epoch - 1, "one warning per new epoch"


def test_each_source_has_its_validation_loss(runs: Runs) -> None:
    record = next(r for r in metrics(runs.reference) if "val_loss" in r)
    per_source = {name: v["val_loss"] for name, v in record["sources"].items()}  # type: ignore[union-attr]
    assert set(per_source) == {"a", "b"}
    assert record["val_loss"] == pytest.approx(0.8 * per_source["a"] + 0.2 * per_source["b"], rel=1e-9)
    line = f"eval step {STEPS} val_loss {record['val_loss']:.4f}"
    assert any(
        out.startswith(line) and out.endswith(f"(a {per_source['a']:.4f}, b {per_source['b']:.4f})")
        for out in runs.outputs["reference"].splitlines()
    )


def test_resume_after_sigkill_continues_the_mixture_bitwise(runs: Runs) -> None:
    reference, resumed = _train_records(runs.reference), _train_records(runs.killed)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step]["loss"] == reference[step]["loss"], step
        assert resumed[step]["sources"] == reference[step]["sources"], step


def test_a_fork_draws_by_its_new_weights(runs: Runs) -> None:
    assert (
        "warning: data mixture weights changed (a 0.8 -> 0.5, b 0.2 -> 0.5); drawn by the new weights from step 21"
        in runs.outputs["fork"]
    )
    records = _train_records(runs.fork)
    assert records[FORK_STEP] == _train_records(runs.reference)[FORK_STEP], (
        "the parent's records up to the fork"
    )
    for step in range(FORK_STEP + 1, FORK_STEPS + 1):
        drawn = {
            n: records[step]["sources"][n]["tokens"] - records[FORK_STEP]["sources"][n]["tokens"]
            for n in "ab"
        }
        assert drawn["a"] == drawn["b"] == (step - FORK_STEP) * GLOBAL_BATCH * SEQ // 2, step
