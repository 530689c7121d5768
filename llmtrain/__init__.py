"""llmtrain: train Llama-style language models with DeepSpeed, from one CPU to a GPU cluster."""

__version__ = "0.1.0"
