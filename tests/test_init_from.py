"""`train --init-from`: a Hugging Face Llama (GQA, an explicit head_dim, llama3 RoPE scaling, its own
tokenizer with a start-of-text token) or a run's checkpoint as the first weights.

One HF model is built with transformers (random weights, save_pretrained, nothing downloaded) and shared:
llmtrain's logits equal transformers' before any step; ZeRO 1 and ZeRO 3 at world size 2 start from
exactly its weights (their first loss is transformers' loss on the same batch) and train; the export
of the trained run loads back into transformers with llmtrain's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from exportkit import finish, run_cli, start
from tokenizers import processors
from trained_run import trained_run
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from llmtrain import cli, config, inference
from llmtrain.data import corpus
from llmtrain.data import tokenizer as toks
from llmtrain.data.cache import ensure_prepared
from llmtrain.data.dataset import TrainLoader
from llmtrain.engine import pretrained

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SEQ = 96  # past the llama3 scaling's original context (64): the scaled frequencies matter
TRAIN = ["--precision", "fp32", "--seq-len", str(SEQ), "--micro-batch", "2", "--steps", "3", "--lr", "1e-3"]
TRAIN += ["--warmup-steps", "1", "--log-every", "1", "--save-every", "3", "--set", "data.val_fraction=0.05"]


def llama_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE on the built-in corpus with Llama 3's special tokens and its BOS post-processor."""
    texts = corpus.builtin_corpus().read_text().splitlines()[:2000]
    tok = toks.train_tokenizer(texts, 400)
    tok.add_special_tokens([BOS, EOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(out)
    return fast


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_llama(tmp_path_factory.mktemp("hf") / "llama")


def save_hf_llama(out: Path) -> Path:
    """A random LlamaForCausalLM with GQA, head_dim 24 and llama3 RoPE scaling, and its tokenizer."""
    tokenizer = llama_tokenizer(out)
    hf_cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden / heads: q_proj is 96 wide
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded wrongly shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


def hf_model(directory: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(
        directory, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_model_config_follows_the_hf_config(hf_dir: Path) -> None:
    cfg = config.resolve(flags={"train.init_from": str(hf_dir)})
    m = cfg.model
    assert (m.vocab_size, m.hidden_size, m.num_attention_heads, m.num_key_value_heads) == (402, 64, 4, 2)
    assert (m.head_dim, m.head_width, m.rope_theta) == (24, 24, 50000.0)
    assert (m.rope_scaling_type, m.rope_scaling_factor) == ("llama3", 8.0)
    assert m.rope_scaling_original_max_position_embeddings == 64
    assert cfg.data.tokenizer == str(hf_dir)


def test_logits_equal_transformers_before_any_step(hf_dir: Path) -> None:
    cfg = config.resolve(flags={"train.init_from": str(hf_dir)})
    ours = pretrained.build_loaded(cfg.model, pretrained.open_weights(str(hf_dir)), "cpu").eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(hf_dir)(ids).logits
        got = ours(ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def first_batch_loss(run_dir: Path, model: torch.nn.Module) -> float:
    """`model`'s mean loss on the run's first global batch (the loader's own sequences)."""
    cfg = config.load_run_config(run_dir / "config.yaml")
    prepared = ensure_prepared(cfg.data, cfg.model.vocab_size, show_progress=False)
    loader = TrainLoader(prepared, cfg.train.seq_len, cfg.global_batch, cfg.global_batch, seed=cfg.train.seed)
    (batch,) = loader.build_step(0, 0)
    loader.close()
    with torch.no_grad():
        logits = model(batch["input_ids"])
    logits = getattr(logits, "logits", logits)  # transformers' output, or our model's tensor
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind", "train") == "train" and "loss" in r]


@pytest.fixture(scope="module")
def trained(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO 1 and ZeRO 3 runs from the HF model, world size 2, side by side."""
    base = tmp_path_factory.mktemp("init")
    common = ["--init-from", str(hf_dir), "--gpus", "2", *TRAIN]
    procs = {stage: start(base, f"zero{stage}", [*common, "--zero", stage]) for stage in ("1", "3")}
    for stage, proc in procs.items():
        finish(base, f"zero{stage}", proc)
    return base


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["1", "3"])
def test_zero_stages_start_from_the_hf_weights(trained: Path, hf_dir: Path, stage: str) -> None:
    run_dir = trained / f"zero{stage}"
    saved = config.load_run_config(run_dir / "config.yaml")
    assert saved.train.init_from == str(hf_dir)
    got = losses(run_dir)
    assert len(got) == 3 and got[-1] < got[0]
    assert got[0] == pytest.approx(first_batch_loss(run_dir, hf_model(hf_dir)), abs=1e-5)


@pytest.mark.slow
def test_documents_start_with_the_tokenizers_start_token(trained: Path, hf_dir: Path) -> None:
    """Every document of the prepared stream is `<|begin_of_text|> text <|end_of_text|>`, as Llama 3
    was pre-trained."""
    cfg = config.load_run_config(trained / "zero1" / "config.yaml")
    prepared = ensure_prepared(cfg.data, cfg.model.vocab_size, show_progress=False)
    tokens = prepared.stream("train").read(0, 20000).tolist()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    assert prepared.eot_id == tokenizer.eos_token_id
    ends = [i for i, t in enumerate(tokens[:-1]) if t == tokenizer.eos_token_id]
    assert tokens[0] == tokenizer.bos_token_id and len(ends) > 3
    assert all(tokens[i + 1] == tokenizer.bos_token_id for i in ends)


@pytest.mark.slow
def test_export_round_trips_to_transformers(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Equal logits; and transformers' ordinary generate (its tokenizer adds the start token) gives
    llmtrain generate's text."""
    from transformers import AutoTokenizer

    run_dir, out = trained / "zero3", trained / "exported"
    run_cli(capsys, "export", str(run_dir), "--out", str(out))
    exported = json.loads((out / "config.json").read_text())
    assert exported["head_dim"] == 24
    assert exported["rope_scaling"]["rope_type"] == "llama3"
    prompt = "The function"
    ours = run_cli(
        capsys, "generate", str(run_dir), "--prompt", prompt, "--temperature", "0", "--max-tokens", "24"
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    loaded = inference.load_run(run_dir, device="cpu")
    assert loaded.eot_id == tokenizer.eos_token_id == exported["eos_token_id"]  # generation stops there
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        generated = hf_model(out).generate(**inputs, max_new_tokens=24, do_sample=False)
    assert tokenizer.decode(generated[0], skip_special_tokens=True) == ours[:-1]  # print()'s newline
    ids = torch.randint(0, 402, (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = loaded.model(ids)
        got = hf_model(out)(ids).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_init_from_a_run_takes_its_checkpoint_weights(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """`--init-from RUN:6`: the step-6 weights (not the latest), pinned in config.yaml; the new run's
    first loss is the parent's step-6 model's on the new run's first batch."""
    parent = trained_run(tmp_path_factory)
    proc = start(
        tmp_path,
        "child",
        ["--init-from", f"{parent}:6", "--zero", "1", *TRAIN[:2], "--seq-len", "64", "--steps", "1"],
    )
    finish(tmp_path, "child", proc)
    child = tmp_path / "child"
    assert config.load_run_config(child / "config.yaml").train.init_from == f"{parent.resolve()}:6"
    at_step_6 = inference.load_run(parent, checkpoint="6", device="cpu").model
    assert losses(child)[0] == pytest.approx(first_batch_loss(child, at_step_6), abs=1e-5)


# ---------------------------------------------------------------- refused, one line, exit 2


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_shape_keys_must_agree_with_the_weights(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(tmp_path / "run")
    line = bad(capsys, "--init-from", str(hf_dir), "--set", "model.hidden_size=128", "--run-dir", run)
    assert "--set model.hidden_size: 128" in line and "hidden_size=64" in line
    line = bad(capsys, "--init-from", str(hf_dir), "--preset", "debug", "--run-dir", run)
    assert line.startswith("error: --preset:")
    assert not (tmp_path / "run").exists()


def test_weights_that_do_not_match_config_json_are_refused(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in hf_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    cfg = json.loads((hf_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    line = bad(capsys, "--init-from", str(broken), "--run-dir", str(tmp_path / "run"))
    assert "mlp.gate_proj.weight has shape (160, 64)" in line and "(128, 64)" in line
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    assert "'qwen2'" in bad(capsys, "--init-from", str(broken), "--run-dir", str(tmp_path / "run"))
    assert "no such directory" in bad(
        capsys, "--init-from", str(tmp_path / "nothing"), "--run-dir", str(tmp_path / "run")
    )
    assert not (tmp_path / "run").exists()
