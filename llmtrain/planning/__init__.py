"""The planning layer: what a layout is, what composes, what it costs on a cluster, before any process
starts. Torch-free; the runtime reads the same modules.

* layout, rules, stages, partition: which rank holds what (tp innermost, pp outermost), what composes
  (ZeRO stage x offload x precision x tp x sp x pp x engine), each pipeline stage's layers, each
  parameter's shape and tensor-parallel split.
* dsconfig, fsdp2_plan: the DeepSpeed config dict and the FSDP2 plan a run is built from.
* memory: the memory model (`estimate-memory`): per-GPU and per-node bytes, term by term, what fits.
* hardware, flops, timing: devices and clusters as data, FLOPs per token and per rank, and the time
  model: one step's predicted time, term by term.
* plan, report: `llmtrain plan`, every layout that fits ranked by predicted tokens/s.
"""
