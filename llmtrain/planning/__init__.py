"""The planning layer: what a layout costs on a cluster, before any process starts.

Torch-free like the memory model: `hardware` holds the devices and clusters as data (built-in specs
with their sources, or a user's YAML file), `flops` the model's arithmetic per token and per rank, and
`timing` predicts one optimizer step's time term by term.
"""
