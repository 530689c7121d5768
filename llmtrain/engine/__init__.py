"""The training engine: DeepSpeed's config dict and engine construction."""
