"""The memory estimator behind `llmtrain estimate-memory`: per-GPU and per-node bytes, term by term, and
the layouts that fit.

* formulas: a Setup (config + parameter count) -> an Estimate, from the model shape and the DeepSpeed
  config dsconfig generates (calibrated in tests/test_memory_calibration.py), or FSDP2's own terms
  under --engine fsdp2 (calibrated in tests/test_memory_fsdp2.py).
* pipeline: under --pp, the blocks each stage runs, the micro-batches it holds at once, the bubble.
* fit: every layout llmtrain.parallel.rules allows that fits given memory, fastest first.
* inputs: the command line's sizes, counts and raw shape flags -> a Setup.
* render: the --json document (breakdown, verdict, what fits) and its rich tables.

Import-light on purpose: no torch, no DeepSpeed, no model; estimating a 70B model allocates nothing.
"""

from llmtrain.memory.fit import Candidate, fitting, speed_key
from llmtrain.memory.formulas import (
    LOSS_CHUNK_ROWS,
    Estimate,
    ModelStates,
    Setup,
    Term,
    activation_bytes,
    checkpoint_bytes,
    estimate,
    model_states,
    parameter_tensors,
    setup_from_config,
)
from llmtrain.memory.inputs import parse_count, parse_size, resolve_setup
from llmtrain.memory.render import render, report

__all__ = [
    "LOSS_CHUNK_ROWS",
    "Candidate",
    "Estimate",
    "ModelStates",
    "Setup",
    "Term",
    "activation_bytes",
    "checkpoint_bytes",
    "estimate",
    "fitting",
    "model_states",
    "parameter_tensors",
    "parse_count",
    "parse_size",
    "render",
    "report",
    "resolve_setup",
    "setup_from_config",
    "speed_key",
]
