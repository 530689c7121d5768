"""The memory estimator behind `llmtrain estimate-memory`: per-GPU and per-node bytes, term by term, and
the layouts that fit.

* setup: a Setup (config + parameter count + the DeepSpeed dict planning.dsconfig generates) and its
  layout's views: the ZeRO group, the rank's parameters, pipeline stages, accumulation.
* states: parameters, gradients and optimizer states per rank as DeepSpeed's ZeRO stage or FSDP2
  keeps them (calibrated in tests/test_memory_calibration.py and tests/test_memory_fsdp2.py); one
  checkpoint's bytes.
* activations: what a micro-batch saves for backward per rank, per block and checkpointing mode.
* formulas: the breakdown, a Setup -> an Estimate: those terms, the buffers DeepSpeed or FSDP2
  allocates, host memory and NVMe, per GPU and per node.
* pipeline: under --pp, the blocks each stage runs, the micro-batches it holds at once, the bubble.
* fit: every layout llmtrain.planning.rules allows that fits given memory, fastest first.
* inputs: the command line's sizes, counts and raw shape flags -> a Setup.
* render: the --json document (breakdown, verdict, what fits) and its rich tables.

Import-light on purpose: no torch, no DeepSpeed, no model; estimating a 70B model allocates nothing.
"""

from llmtrain.planning.memory.activations import LOSS_CHUNK_ROWS, activation_bytes
from llmtrain.planning.memory.fit import Candidate, fitting, speed_key
from llmtrain.planning.memory.formulas import Estimate, Term, estimate
from llmtrain.planning.memory.inputs import parse_count, parse_size, resolve_setup
from llmtrain.planning.memory.render import render, report
from llmtrain.planning.memory.setup import Setup, parameter_tensors, setup_from_config
from llmtrain.planning.memory.states import (
    ModelStates,
    checkpoint_bytes,
    model_states,
    secondary_partition_elements,
)

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
    "secondary_partition_elements",
    "setup_from_config",
    "speed_key",
]
