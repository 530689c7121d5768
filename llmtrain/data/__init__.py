"""Data: sources -> tokenizer -> memory-mapped token shards -> packed, resumable training stream.

Modules:
    sources     text sources (files, globs, save_to_disk directories, Hub datasets) -> a `datasets` table
    tokenizer   train, load and hash byte-level BPE tokenizers
    corpus      the built-in corpus (Python's own documentation)
    prepare     the writer: a source -> token shards + manifest.json (`llmtrain prepare-data`)
    shards      the reader: manifest, token streams, an opened prepared directory
    cache       `train --data`: prepared shards built once per source, tokenizer and settings, then reused
    dataset     packed sequences, the world-size-independent sampler, prefetch (TrainLoader, val_batches)
    mixture     several weighted sources (`--data a:0.7 --data b:0.3`): names, one tokenizer, each prepared
    blend       a mixture's stream: sources drawn by weight (Megatron's deficit rule), MixtureLoader

The trainer needs three calls:
    prepared = cache.ensure_prepared(cfg.data, cfg.model.vocab_size, local_rank=..., barrier=...)
    loader = dataset.TrainLoader(prepared, seq_len, micro_batch, global_batch, rank=..., world_size=..., seed=...)
    batches = loader.next_step()          # this rank's grad_accum micro-batches for one optimizer step
and `dataset.val_batches(...)` for evaluation; `loader.state_dict()` goes into the checkpoint.
"""
