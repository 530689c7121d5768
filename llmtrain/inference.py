"""Using a trained run: load a checkpoint's weights, sample text, measure loss, export to Hugging Face.

Everything here is single-process and needs no DeepSpeed engine: `checkpoint.consolidated_fp32_state_dict`
reassembles full fp32 weights from a checkpoint of any ZeRO stage, and they load into a plain
`model.Llama`. The tokenizer is the run's own copy, RUN_DIR/tokenizer.json (written at train start);
runs from before that copy existed fall back to the prepared data directory the config points at.

Public API:
    open_run(run_dir, checkpoint=None) -> RunCheckpoint        config + chosen checkpoint, no weights
    load_run(run_dir, checkpoint=None, device=None) -> LoadedRun   + model, tokenizer
    generate_text(run_dir, prompt, *, max_tokens, temperature, top_k, seed, checkpoint) -> str
    sample_tokens(model, context, *, max_tokens, temperature, top_k, seed, stop_id) -> list[int]
    evaluate_run(run_dir, *, data=None, batches=None, checkpoint=None) -> dict
    export_run(run_dir, out, checkpoint=None) -> Path
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from llmtrain import checkpoint as ckpt
from llmtrain import rundir
from llmtrain.config import ConfigError, TrainConfig
from llmtrain.data import tokenizer as toks
from llmtrain.data.shards import PreparedData
from llmtrain.export import strip_wrapper_prefixes
from llmtrain.model import Llama, build_model


@dataclass(frozen=True)
class RunCheckpoint:
    """A run directory's resolved config and the complete, verified checkpoint to use."""

    run_dir: Path
    cfg: TrainConfig
    tag: str
    step: int
    warnings: list[str]


@dataclass
class LoadedRun:
    run: RunCheckpoint
    model: Llama
    tokenizer: Tokenizer
    tokenizer_path: Path
    eot_id: int


# ---------------------------------------------------------------- finding what to load


def open_run(run_dir: str | Path, checkpoint: str | None = None) -> RunCheckpoint:
    """The run's config and checkpoint: `checkpoint` (a tag or a step number), else the latest intact one.

    ConfigError (exit 2) when `run_dir` is not a run, has no complete checkpoint, or the named one is
    missing or damaged.
    """
    run_dir = Path(run_dir)
    cfg = rundir.load_saved_config(run_dir)
    root = rundir.checkpoint_root(run_dir)
    if not ckpt.list_complete(root):
        raise ConfigError(
            f"{run_dir}: no complete checkpoint yet; train it (`llmtrain train --run-dir {run_dir} "
            "--resume auto`) until its first save"
        )
    if checkpoint is None:
        try:
            choice = ckpt.choose_checkpoint(root, strict=False)
        except ckpt.CheckpointError as exc:
            raise ConfigError(f"{run_dir}: {exc}") from None
        return RunCheckpoint(run_dir, cfg, choice.tag, choice.info.step, choice.warnings)
    tag = _tag_from(checkpoint)
    try:
        path = ckpt.checkpoint_dir(root, tag)
    except ckpt.CheckpointError as exc:
        raise ConfigError(
            f"--checkpoint {checkpoint}: {exc}; list them with `llmtrain runs {run_dir}`"
        ) from None
    problems = ckpt.verify(path)
    if problems:
        raise ConfigError(f"--checkpoint {checkpoint}: damaged: {'; '.join(problems)}")
    return RunCheckpoint(run_dir, cfg, tag, int(tag.removeprefix("step_")), [])


def _print_warnings(run: RunCheckpoint) -> None:
    for warning in run.warnings:  # e.g. `latest` damaged: an older intact checkpoint is used instead
        print(f"warning: {warning}", file=sys.stderr)


def _tag_from(checkpoint: str) -> str:
    """`step_00000100`, `100` -> the tag; anything else is passed on for checkpoint_dir to refuse."""
    text = checkpoint.strip()
    return ckpt.tag_for(int(text)) if text.isdigit() else text


def run_tokenizer_path(run_dir: Path, cfg: TrainConfig) -> Path:
    """RUN_DIR/tokenizer.json, else the run's --tokenizer, else the prepared data's copy."""
    own = run_dir / rundir.TOKENIZER_FILE
    if own.is_file():
        return own
    if cfg.data.tokenizer:
        return toks.tokenizer_file(cfg.data.tokenizer, "--tokenizer (from the run's config.yaml)")
    return _prepared(cfg).tokenizer_path


def _prepared(cfg: TrainConfig) -> PreparedData:
    """The run's prepared data, from the cache (prepared again, identically, when it was deleted)."""
    from llmtrain.data.cache import ensure_prepared

    if cfg.data.mixture:
        names = ", ".join(entry.source for entry in cfg.data.mixture)
        raise ConfigError(
            f"the run trained on a mixture ({names}); name the data to evaluate: --data SOURCE "
            "(one of them, or any other source)"
        )
    return ensure_prepared(cfg.data, cfg.model.vocab_size, show_progress=False)


def load_weights(run: RunCheckpoint) -> dict[str, torch.Tensor]:
    """Full fp32 weights of the chosen checkpoint, with our parameter names."""
    from llmtrain.parallel.accelerator import select_accelerator

    select_accelerator()  # DeepSpeed is imported below: name the accelerator instead of letting it guess
    chatter = io.StringIO()
    try:
        # DeepSpeed's zero_to_fp32 prints its progress to stdout (and a tqdm bar to stderr): keep
        # `eval --json` output parseable.
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            state = ckpt.consolidated_fp32_state_dict(rundir.checkpoint_root(run.run_dir), run.tag)
    except ckpt.CheckpointError as exc:
        raise ConfigError(f"{run.run_dir}: {exc}") from None
    return {strip_wrapper_prefixes(name): tensor for name, tensor in state.items()}


def build_inference_model(cfg: TrainConfig, state: dict[str, torch.Tensor], device: str) -> Llama:
    """An fp32 Llama in eval mode holding `state` (every parameter must be present)."""
    model = build_model(cfg.model, device="meta")
    model.to_empty(device=device)
    if cfg.model.tie_word_embeddings:
        model.tie_weights()
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_run(run_dir: str | Path, checkpoint: str | None = None, device: str | None = None) -> LoadedRun:
    """Config, checkpoint weights in a fp32 model, and the run's tokenizer."""
    run = open_run(run_dir, checkpoint)
    _print_warnings(run)
    tok_path = run_tokenizer_path(run.run_dir, run.cfg)
    tok = toks.load_tokenizer(tok_path, "tokenizer")
    if toks.vocab_size(tok) > run.cfg.model.vocab_size:
        raise ConfigError(
            f"{tok_path}: {toks.vocab_size(tok)} tokens, more than the model's vocab_size "
            f"{run.cfg.model.vocab_size}; this is not the run's tokenizer"
        )
    model = build_inference_model(run.cfg, load_weights(run), device or default_device())
    return LoadedRun(run, model, tok, tok_path, toks.eot_id(tok, tok_path, "tokenizer"))


# ---------------------------------------------------------------- sampling


def check_sampling(max_tokens: int, temperature: float, top_k: int) -> None:
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens {max_tokens}: must be at least 1")
    if not temperature >= 0 or not math.isfinite(temperature):
        raise ConfigError(f"--temperature {temperature}: must be >= 0 (0 = always the most likely token)")
    if top_k < 1:
        raise ConfigError(
            f"--top-k {top_k}: must be at least 1; to sample from every token pass the vocabulary size"
        )


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id from logits [V]: argmax at temperature 0, else a draw among the top_k."""
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    values, ids = torch.topk(scaled, min(top_k, scaled.numel()))
    probs = torch.softmax(values, dim=-1)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


@torch.inference_mode()
def sample_tokens(
    model: Llama,
    context: list[int],
    *,
    max_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    stop_id: int | None,
) -> list[int]:
    """Up to `max_tokens` new ids after `context`, stopping early at `stop_id` (not included).

    No KV cache: each step runs the whole window again, cropped to the last max_position_embeddings
    tokens (the longest sequence RoPE and training covered). Only the last position's logits are
    computed.
    """
    if not context:
        raise ValueError("sample_tokens needs at least one context token")
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    limit = model.cfg.max_position_embeddings
    ids = list(context)
    new: list[int] = []
    for _ in range(max_tokens):
        window = torch.tensor([ids[-limit:]], dtype=torch.long, device=device)  # [1, T]
        last = model.hidden_states(window)[:, -1]  # [1, D]
        logits = model.lm_head(last)[0].float().cpu()  # [V]
        token = next_token(logits, temperature, top_k, generator)
        if token == stop_id:
            break
        ids.append(token)
        new.append(token)
    return new


def generate_text(
    run_dir: str | Path,
    prompt: str,
    *,
    max_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    checkpoint: str | None = None,
) -> str:
    """The prompt followed by the model's continuation (`llmtrain generate`).

    The context starts as every training document did: after the end-of-text token (the separator
    before it), or after the tokenizer's own start token where it has one (a Hugging Face Llama's
    `<|begin_of_text|>`, as transformers' `tokenizer(prompt)` adds it). Generation stops at end of text.
    """
    check_sampling(max_tokens, temperature, top_k)
    loaded = load_run(run_dir, checkpoint)
    prompt_ids = loaded.tokenizer.encode(prompt, add_special_tokens=False).ids
    start = toks.start_ids(loaded.tokenizer, loaded.eot_id) or [loaded.eot_id]
    new = sample_tokens(
        loaded.model,
        [*start, *prompt_ids],
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        stop_id=loaded.eot_id,
    )
    # Decode prompt and continuation together: a character split across the boundary stays whole.
    return loaded.tokenizer.decode(prompt_ids + new, skip_special_tokens=False)


# ---------------------------------------------------------------- evaluation


def evaluate_run(
    run_dir: str | Path,
    *,
    data: str | None = None,
    batches: int | None = None,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    """Mean loss and perplexity of a checkpoint (`llmtrain eval`).

    Without `data`: the run's validation split, by default the same sequences the training-time
    evaluation used (train.eval_batches per process), so the number is comparable with metrics.jsonl's
    val_loss. With `data` (a source or a prepared directory): prepared with the run's tokenizer; its
    validation split when it has one, else all of it. `batches` caps the number of micro-batches.
    """
    if batches is not None and batches < 1:
        raise ConfigError(f"--batches {batches}: must be at least 1")
    loaded = load_run(run_dir, checkpoint)
    cfg = loaded.run.cfg
    prepared, split = _eval_data(loaded, data)
    seq_len, micro = cfg.train.seq_len, cfg.train.micro_batch
    if batches is None:
        batches = _training_eval_batches(prepared, cfg) if data is None else 10**9
    windows = sequence_batches(prepared, split, seq_len, micro, batches, cfg.data.document_masking)
    if not windows:
        raise ConfigError(
            f"{'--data ' + data if data else 'validation split'}: fewer tokens than one batch of "
            f"{micro} sequences of {seq_len} (+1); use more data"
        )
    loss = mean_loss(loaded.model, windows)
    return {
        "val_loss": loss,
        "val_ppl": math.exp(loss) if loss < 700 else math.inf,
        "tokens": len(windows) * micro * seq_len,
        "checkpoint": loaded.run.tag,
        "step": loaded.run.step,
        "data": data or "validation split",
        "split": split,
        "batches": len(windows),
    }


def _training_eval_batches(prepared: PreparedData, cfg: TrainConfig) -> int:
    """How many micro-batches training-time evaluation covers: eval_batches on each of W data-parallel
    ranks (tp and sp ranks share theirs), capped (as data.dataset.val_batches caps it) by what the split
    holds for W ranks."""
    from llmtrain.data.dataset import num_sequences

    world, micro = cfg.data_parallel, cfg.train.micro_batch
    per_process = num_sequences(prepared.stream("val"), cfg.train.seq_len) // (micro * world)
    return max(1, min(cfg.train.eval_batches, per_process) * world)


def _eval_data(loaded: LoadedRun, data: str | None) -> tuple[PreparedData, str]:
    from llmtrain.data.cache import ensure_prepared
    from llmtrain.data.shards import is_prepared_dir, open_prepared

    cfg = loaded.run.cfg
    if data is None:
        prepared = _prepared(cfg)
        _check_same_tokenizer(prepared, loaded)
        return prepared, "val"
    if is_prepared_dir(data):
        prepared = open_prepared(data, tokenizer=loaded.tokenizer_path, vocab_size=cfg.model.vocab_size)
    else:
        # All of a raw source is evaluation data: no split is held out of it.
        source = dataclasses.replace(
            cfg.data, source=data, tokenizer=str(loaded.tokenizer_path), val_fraction=0.0, streaming=False
        )
        prepared = ensure_prepared(source, cfg.model.vocab_size, show_progress=False)
    val = prepared.manifest.splits.get("val")
    enough = val is not None and val.tokens > cfg.train.seq_len * cfg.train.micro_batch
    return prepared, "val" if enough else "train"


def _check_same_tokenizer(prepared: PreparedData, loaded: LoadedRun) -> None:
    if prepared.manifest.tokenizer_hash != toks.tokenizer_hash(loaded.tokenizer):
        raise ConfigError(
            f"{prepared.path}: the run's data is now tokenized differently from {loaded.tokenizer_path}; "
            "evaluate with --data SOURCE (prepared with the run's tokenizer)"
        )


def sequence_batches(
    prepared: PreparedData, split: str, seq_len: int, micro_batch: int, max_batches: int, masking: bool
) -> list[dict[str, torch.Tensor]]:
    """The split's first sequences in order (packed as in training), `micro_batch` per batch.

    On the validation split these are exactly the batches training-time evaluation uses at world size 1
    (data.dataset.val_batches), so batch b of a world-size-W evaluation is one of ours too.
    """
    from llmtrain.data.dataset import consecutive_batches, num_sequences

    stream = prepared.stream(split)
    count = min(max_batches, num_sequences(stream, seq_len) // micro_batch)
    firsts = range(0, count * micro_batch, micro_batch)
    return consecutive_batches(stream, firsts, seq_len, micro_batch, prepared.eot_id, masking)


@torch.inference_mode()
def mean_loss(model: Llama, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean over batches of each batch's mean cross-entropy (equal-sized batches: the token mean)."""
    device = model.embed_tokens.weight.device
    total = 0.0
    for batch in batches:
        total += float(model(**{k: v.to(device) for k, v in batch.items()}))
    return total / len(batches)


# ---------------------------------------------------------------- export


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str | None = None) -> Path:
    """A Hugging Face model directory (model.safetensors, config.json, tokenizer) from a checkpoint."""
    from llmtrain.export import _check_destination, export_hf

    _check_destination(Path(out))  # before the (slow) consolidation
    run = open_run(run_dir, checkpoint)
    _print_warnings(run)
    tok_path = run_tokenizer_path(run.run_dir, run.cfg)
    tok = toks.load_tokenizer(tok_path, "tokenizer")
    eot = toks.eot_id(tok, tok_path, "tokenizer")
    # The end-of-text token both ends a document and starts the next: the model was trained on documents
    # that follow it, and generation stops at it. A tokenizer with a start token of its own keeps it.
    bos = (toks.start_ids(tok, eot) or [eot])[0]
    return export_hf(
        load_weights(run), run.cfg.model, out, tokenizer_path=tok_path, eos_token_id=eot, bos_token_id=bos
    )
