"""Tokenizers: train a byte-level BPE, load one, identify it.

Our tokenizers have two special tokens, `<|endoftext|>` (id 0, the separator written after every
document) and `<|pad|>` (id 1; the packed training stream never uses it, it is there for inference
batching and for tools that expect one). `load_tokenizer` also takes a local Hugging Face tokenizer
directory; its end-of-text token is the `eos_token` of its tokenizer_config.json.

Document text is always encoded as text: a literal "<|endoftext|>" inside a document becomes ordinary
tokens (`encode_special_tokens`), so the only end-of-text ids in a prepared stream are the separators.
Documents are encoded with `add_special_tokens=False`; a tokenizer whose post-processor starts every
text with a token of its own (Llama's `<|begin_of_text|>`) has that token put before each document
(`start_ids`), as its models were pre-trained.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmtrain.config import ConfigError

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOT, PAD)
_EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, plus the special tokens


def train_tokenizer(
    documents: Iterable[str],
    vocab_size: int,
    out_path: str | Path | None = None,
    *,
    length: int | None = None,
    flag: str = "--vocab-size",
) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens; save it as tokenizer.json when asked.

    The vocabulary is smaller than asked when the text has too few distinct pairs to merge.
    """
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"{flag} {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=length)
    tok.encode_special_tokens = True
    if out_path is not None:
        save_tokenizer(tok, out_path)
    return tok


def save_tokenizer(tok: Tokenizer, out_path: str | Path) -> Path:
    """Write tokenizer.json atomically (temporary file, fsync, rename)."""
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(tok.to_str(), encoding="utf-8")
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load_tokenizer(path: str | Path, flag: str = "--tokenizer") -> Tokenizer:
    """A tokenizer.json, or a local Hugging Face tokenizer directory holding one."""
    file = tokenizer_file(path, flag)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise ConfigError(
            f"{flag} {path}: not a tokenizers JSON file ({exc}); pass a tokenizer.json"
        ) from None
    tok.encode_special_tokens = True
    eot_id(tok, file, flag)  # a tokenizer without an end-of-text token fails here, early
    return tok


def tokenizer_file(path: str | Path, flag: str = "--tokenizer") -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise ConfigError(
                f"{flag} {path}: the directory has no tokenizer.json (only fast Hugging Face tokenizers "
                "are supported); save one with tokenizer.save_pretrained"
            )
        return p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"{flag} {path}: file not found; pass a tokenizer.json or a tokenizer directory")
    return p


def eot_id(tok: Tokenizer, path: str | Path | None = None, flag: str = "--tokenizer") -> int:
    """Id of the end-of-text token written after every document.

    With `path` (the tokenizer.json or its directory), a Hugging Face `eos_token` configured in the
    tokenizer_config.json next to it comes first; then the usual names.
    """
    config = None if path is None else tokenizer_file(path, flag).parent / "tokenizer_config.json"
    names = [*(_configured_eos(config) if config else []), *_EOT_CANDIDATES]
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    where = f"{flag} {path}: " if path is not None else ""
    raise ConfigError(
        f"{where}the tokenizer has no end-of-text token (looked for {', '.join(names)}); "
        f"train one with `llmtrain tokenizer train` or add {EOT} as a special token"
    )


def _configured_eos(config: Path) -> list[str]:
    if not config.is_file():
        return []
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (ValueError, AttributeError):
        return []
    if isinstance(eos, dict):
        eos = eos.get("content")
    return [eos] if isinstance(eos, str) else []


def vocab_size(tok: Tokenizer) -> int:
    """Ids run from 0 to vocab_size - 1, added tokens included."""
    return int(tok.get_vocab_size(with_added_tokens=True))


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: equal hashes mean identical encodings."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def start_ids(tok: Tokenizer, eot: int) -> list[int]:
    """The ids the tokenizer's own post-processor puts before every text (Llama's `<|begin_of_text|>`).

    A model pre-trained with them (a Hugging Face Llama) reads every document after them, so a prepared
    stream starts each document with them and generation starts its context with them. Empty for a
    tokenizer without a post-processor (llmtrain's own), and for one whose start token is the
    end-of-text token (llmtrain's exports): the separator before every document is that token already.
    """
    if tok.post_processor is None:
        return []
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
    prefix = full[: starts[0]] if starts else []
    return [] if prefix == [eot] else prefix


def encode_documents(tok: Tokenizer, texts: list[str], prefix: list[int] | None = None) -> list[list[int]]:
    """Token ids of each document: `prefix` (start_ids), then the text without the post-processor's
    tokens (the separator after it is the caller's)."""
    start = prefix or []
    return [start + enc.ids for enc in tok.encode_batch(texts, add_special_tokens=False)]


def train_tokenizer_from_source(
    source: str,
    vocab_size: int,
    out_path: str | Path,
    *,
    text_field: str = "text",
    hub_config: str | None = None,
    streaming: bool = False,
    max_chars: int | None = None,
) -> str:
    """`llmtrain tokenizer train`: train on every document of a source (or its first `max_chars`
    characters), write tokenizer.json, return a one-paragraph summary."""
    import time

    from llmtrain.data import sources

    started = time.perf_counter()
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} tokens")
    docs = sources.load_documents(source, text_field=text_field, hub_config=hub_config, streaming=streaming)
    counted = {"documents": 0, "chars": 0}

    def texts() -> Iterable[str]:
        for batch in docs.iter(batch_size=256):
            for text in batch["text"]:
                counted["documents"] += 1
                counted["chars"] += len(text)
                yield text
                if max_chars is not None and counted["chars"] >= max_chars:
                    return

    tok = train_tokenizer(texts(), vocab_size, out_path)
    got = tok.get_vocab_size(with_added_tokens=True)  # `vocab_size` is the argument here
    if counted["chars"] == 0:
        raise ConfigError(f"SOURCE {source}: empty source (every document is empty); point it at text")
    return (
        f"trained {out_path}: {got} tokens (asked {vocab_size}) from {counted['documents']} "
        f"documents, {counted['chars']:,} characters, in {time.perf_counter() - started:.1f}s"
    )
