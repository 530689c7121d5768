"""Data: sources -> tokenizer -> memory-mapped token shards -> packed, resumable training stream.

The trainer needs three calls:
    prepared = ensure_prepared(cfg.data, cfg.model.vocab_size, local_rank=..., barrier=...)
    loader = TrainLoader(prepared, seq_len, micro_batch, global_batch, rank=..., world_size=..., seed=...)
    batches = loader.next_step()          # this rank's grad_accum micro-batches for one optimizer step
and `val_batches(...)` for evaluation; `loader.state_dict()` goes into the checkpoint.

Names are imported lazily so `import llmtrain.data.tokenizer` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EpochPermutation": "dataset",
    "TrainLoader": "dataset",
    "val_batches": "dataset",
    "Manifest": "prepare",
    "PreparedData": "prepare",
    "ensure_prepared": "prepare",
    "open_prepared": "prepare",
    "prepare_data": "prepare",
    "eot_id": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenizer_hash": "tokenizer",
    "train_tokenizer": "tokenizer",
    "builtin_corpus": "corpus",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmtrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"llmtrain.data.{_EXPORTS[name]}"), name)
