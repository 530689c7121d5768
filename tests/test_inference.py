"""generate / eval / export on a real trained run (ZeRO 2 checkpoints), through the CLI entry point."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from trained_run import EVERY, MICRO_BATCH, SEQ_LEN, STEPS, trained_run

from llmtrain import cli, inference
from llmtrain.data import tokenizer as toks
from llmtrain.train.metrics import read_metrics

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers loads only local directories here


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained_run(tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(run_dir: Path) -> inference.LoadedRun:
    return inference.load_run(run_dir, device="cpu")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r}


# ---------------------------------------------------------------- loading


def test_run_dir_holds_the_tokenizer_the_data_was_prepared_with(
    run_dir: Path, loaded: inference.LoadedRun
) -> None:
    assert loaded.tokenizer_path == run_dir / "tokenizer.json"
    prepared = inference._prepared(loaded.run.cfg)
    assert toks.tokenizer_hash(loaded.tokenizer) == prepared.manifest.tokenizer_hash
    assert loaded.eot_id == prepared.eot_id
    assert loaded.run.tag == f"step_{STEPS:08d}"


def test_loaded_weights_are_the_trained_ones_not_a_fresh_init(loaded: inference.LoadedRun) -> None:
    from llmtrain.model import build_model

    fresh = build_model(loaded.run.cfg.model, seed=loaded.run.cfg.train.seed)
    moved = [
        (name, (p - fresh.state_dict()[name]).abs().max().item())
        for name, p in loaded.model.state_dict().items()
    ]
    assert all(delta > 1e-4 for _, delta in moved), [n for n, d in moved if d <= 1e-4]
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())


# ---------------------------------------------------------------- eval


def test_eval_reproduces_the_training_time_validation_loss(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _cli(capsys, "eval", str(run_dir), "--json")
    assert code == 0
    result = json.loads(out)
    # Same checkpoint weights, same validation sequences, fp32 both: training's own eval number.
    assert result["val_loss"] == pytest.approx(_val_losses(run_dir)[STEPS], abs=2e-5)
    assert result["val_ppl"] == pytest.approx(math.exp(result["val_loss"]))
    assert result["checkpoint"] == f"step_{STEPS:08d}"
    assert result["tokens"] == result["batches"] * MICRO_BATCH * SEQ_LEN > 0

    code, out, _ = _cli(capsys, "eval", str(run_dir), "--json", "--checkpoint", str(EVERY))
    earlier = json.loads(out)
    assert earlier["checkpoint"] == f"step_{EVERY:08d}"
    assert earlier["val_loss"] == pytest.approx(_val_losses(run_dir)[EVERY], abs=2e-5)
    assert earlier["val_loss"] > result["val_loss"]  # the run learned between the two


def test_eval_on_another_source_uses_all_of_it_with_the_runs_tokenizer(
    run_dir: Path,
    loaded: inference.LoadedRun,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    text = "def add(a, b):\n    return a + b\n\nThe function returns the sum of its arguments. " * 40
    source = tmp_path / "extra.txt"
    source.write_text(text)
    code, out, _ = _cli(capsys, "eval", str(run_dir), "--data", str(source), "--batches", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["split"] == "train" and result["batches"] == 2

    # Reference: the text encoded by the run's tokenizer plus the separator, cut into the first
    # 2 x MICRO_BATCH windows of SEQ_LEN + 1, through the same weights.
    ids = Tokenizer.from_file(str(run_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    stream = np.array([*ids, loaded.eot_id])
    losses = []
    for b in range(2):
        windows = torch.tensor(
            np.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(b * 4, b * 4 + 4)])
        )
        with torch.no_grad():
            logits = loaded.model(windows[:, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))
    assert result["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), abs=1e-5)


# ---------------------------------------------------------------- sampling


def test_next_token_greedy_and_top_k() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 2.8, -1.0, 1.0])
    generator = torch.Generator().manual_seed(0)
    assert inference.next_token(logits, 0.0, 50, generator) == 1
    draws = {inference.next_token(logits, 1.0, 3, generator) for _ in range(300)}
    assert draws == {1, 2, 3}  # never outside the top 3, and each of them drawn
    assert {inference.next_token(logits, 5.0, 1, generator) for _ in range(20)} == {1}
    everything = {inference.next_token(logits, 50.0, 100, generator) for _ in range(500)}
    assert everything == set(range(6))  # top_k beyond the vocabulary: every token


def test_greedy_generation_matches_transformers_generate(
    loaded: inference.LoadedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import LlamaForCausalLM

    code, _, _ = _cli(capsys, "export", str(loaded.run.run_dir), "--out", str(tmp_path / "hf"))
    assert code == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    context = [loaded.eot_id, *loaded.tokenizer.encode("The function", add_special_tokens=False).ids]
    ours = inference.sample_tokens(
        loaded.model, context, max_tokens=12, temperature=0.0, top_k=50, seed=0, stop_id=None
    )
    ids = torch.tensor([context])
    with torch.no_grad():  # an explicit mask: the leading end-of-text id is no padding
        theirs = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=loaded.eot_id,
        )[0, len(context) :].tolist()
    assert ours == theirs and len(ours) == 12


def test_an_exported_run_generates_in_transformers_ordinary_use_as_llmtrain_does(
    run_dir: Path, loaded: inference.LoadedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """AutoTokenizer + generate, and the text-generation pipeline, with nothing added by hand: the
    exported tokenizer starts the context with the end-of-text token, as llmtrain does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    prompt = "The function"
    code, ours, _ = _cli(
        capsys, "generate", str(run_dir), "--prompt", prompt, "--temperature", "0", "--max-tokens", "24"
    )
    assert code == 0 and ours.endswith("\n")
    ours = ours[:-1]  # print()'s newline
    assert _cli(capsys, "export", str(run_dir), "--out", str(tmp_path / "hf"))[0] == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == loaded.eot_id == tokenizer.bos_token_id
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert tokenizer.decode(generated[0], skip_special_tokens=True) == ours
    piped = pipeline("text-generation", model=model, tokenizer=tokenizer)(
        prompt, max_new_tokens=24, do_sample=False
    )
    assert piped[0]["generated_text"] == ours


def test_generation_is_seeded_and_crops_to_max_position_embeddings(loaded: inference.LoadedRun) -> None:
    limit = loaded.model.cfg.max_position_embeddings
    long_context = [
        int(t) for t in torch.randint(2, 500, (limit + 40,), generator=torch.Generator().manual_seed(3))
    ]

    def sample(context: list[int], seed: int) -> list[int]:
        return inference.sample_tokens(
            loaded.model, context, max_tokens=4, temperature=1.0, top_k=20, seed=seed, stop_id=None
        )

    cropped = sample(long_context[-limit:], seed=5)
    assert sample(long_context, seed=5) == cropped  # only the last `limit` tokens are seen
    assert [sample(long_context[-64:], seed=s) for s in (1, 1)] == [sample(long_context[-64:], 1)] * 2
    assert len({tuple(sample(long_context[-64:], seed=s)) for s in range(6)}) > 1


def test_generate_cli_prints_the_prompt_and_its_continuation(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(run_dir), "--prompt", "The function", "--max-tokens", "8", "--seed", "1"]
    code, first, _ = _cli(capsys, *argv)
    assert code == 0 and first.startswith("The function") and len(first.strip()) > len("The function")
    assert _cli(capsys, *argv)[1] == first  # seeded
    code, greedy, _ = _cli(capsys, *argv, "--temperature", "0", "--checkpoint", f"step_{EVERY:08d}")
    assert code == 0 and greedy.startswith("The function")


# ---------------------------------------------------------------- export


def test_export_loads_in_transformers_with_our_logits(
    run_dir: Path, loaded: inference.LoadedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path / "hf"
    code, stdout, _ = _cli(capsys, "export", str(run_dir), "--out", str(out))
    assert code == 0 and str(out) in stdout
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(
        0, loaded.run.cfg.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, theirs = loaded.model(ids), hf(ids).logits
    assert ours.abs().max() > 0.1
    assert (ours - theirs).abs().max().item() <= 1e-5

    text = "The function returns a value."
    exported = AutoTokenizer.from_pretrained(out)
    assert exported(text)["input_ids"] == [loaded.eot_id, *loaded.tokenizer.encode(text).ids]
    assert exported(text, add_special_tokens=False)["input_ids"] == loaded.tokenizer.encode(text).ids
    assert hf.generation_config.eos_token_id == hf.generation_config.bos_token_id == loaded.eot_id

    # Exporting again over an earlier export replaces it.
    assert _cli(capsys, "export", str(run_dir), "--out", str(out), "--checkpoint", str(EVERY))[0] == 0


# ---------------------------------------------------------------- bad input: one line, exit 2


def _assert_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> None:
    code, out, err = _cli(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def test_bad_input_is_one_line_and_exit_2(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(run_dir)
    _assert_bad_input(capsys, ["generate", str(tmp_path), "--prompt", "x"], "not a run directory")
    _assert_bad_input(capsys, ["eval", str(tmp_path / "missing")], "no such run directory")
    _assert_bad_input(capsys, ["generate", run], "--prompt")
    _assert_bad_input(capsys, ["generate", run, "--prompt", "x", "--temperature", "-0.5"], "--temperature")
    _assert_bad_input(capsys, ["generate", run, "--prompt", "x", "--top-k", "0"], "--top-k")
    _assert_bad_input(capsys, ["generate", run, "--prompt", "x", "--max-tokens", "0"], "--max-tokens")
    _assert_bad_input(capsys, ["eval", run, "--checkpoint", "step_00000099"], "no such checkpoint")
    _assert_bad_input(capsys, ["eval", run, "--checkpoint", "../../etc"], "not a checkpoint tag")
    _assert_bad_input(capsys, ["eval", run, "--batches", "0"], "--batches")

    not_export = tmp_path / "notes"
    not_export.mkdir()
    (not_export / "keep.txt").write_text("mine")
    _assert_bad_input(capsys, ["export", run, "--out", str(not_export)], "not empty")
    assert [p.name for p in not_export.iterdir()] == ["keep.txt"]

    fresh = tmp_path / "fresh-run"
    fresh.mkdir()
    shutil.copy(run_dir / "config.yaml", fresh / "config.yaml")
    for verb in (
        ["generate", str(fresh), "--prompt", "x"],
        ["eval", str(fresh)],
        ["export", str(fresh), "--out", str(tmp_path / "o")],
    ):
        _assert_bad_input(capsys, verb, "no complete checkpoint")
