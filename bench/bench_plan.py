"""The time model against runs others published and this repository measured: predicted vs reported
tokens/s per GPU, side by side.

`python -m bench plan` predicts each run below with llmtrain.planning (no process starts, no device is
used: seconds) and writes bench/results/plan.json: each run's source, its reported tokens/s per GPU, the
prediction and their ratio. docs/planning.md quotes the file; tests/test_planning_time.py holds every
ratio within 1.5x.

The runs:
- torchtitan's docs/performance.md: Llama 3 8B and 70B with FSDP on 64 A100 80GB (local batch 1,
  sequence 8192), and Llama 3.1 8B with FSDP on 8 H100 (local batch 2; its H100s have 96 GB of HBM2e at
  2.4 TB/s and ran at 500 W).
- bench/results/gpu.json: the `1b` preset on one H200 at ZeRO 1, eager and compiled, as `make
  gpu-check` measured it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from typing import Any

from bench.ranks import REPO, write_result
from llmtrain import rundir
from llmtrain.config import resolve
from llmtrain.planning import memory
from llmtrain.planning.hardware import CLUSTERS, Cluster
from llmtrain.planning.timing import StepTime, step_time

OUT = REPO / "bench" / "results" / "plan.json"
GPU_RESULTS = REPO / "bench" / "results" / "gpu.json"
TORCHTITAN = "torchtitan docs/performance.md"
# Llama 3 8B and 70B as torchtitan trains them (seq_len 8192, vocabulary 128,256).
LLAMA3_8B = {
    "model.hidden_size": 4096,
    "model.intermediate_size": 14336,
    "model.num_hidden_layers": 32,
    "model.num_attention_heads": 32,
    "model.num_key_value_heads": 8,
    "model.vocab_size": 128256,
    "model.max_position_embeddings": 8192,
}
LLAMA3_70B = {
    **LLAMA3_8B,
    "model.hidden_size": 8192,
    "model.intermediate_size": 28672,
    "model.num_hidden_layers": 80,
    "model.num_attention_heads": 64,
}
FSDP_BF16 = {"train.engine": "fsdp2", "zero.stage": 3, "train.precision": "bf16", "train.seq_len": 8192}
SELECTIVE = {"train.activation_checkpointing": "selective", "train.checkpoint_every_k": 2}


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    what: str
    cluster: Cluster
    flags: dict[str, Any]
    reported: float  # tokens/s per GPU


def _torchtitan_h100() -> Cluster:
    h100 = CLUSTERS["h100"]
    return replace(h100, device=replace(h100.device, memory_bandwidth=2.4e12, memory_bytes=96 << 30))


def _h200_runs() -> list[Run]:
    measured = json.loads(GPU_RESULTS.read_text())["throughput_1b"]
    runs = []
    for mode in ("eager", "compile"):
        m = measured[mode]
        flags = {
            "preset": m["preset"],
            "zero.stage": m["zero"],
            "train.precision": m["precision"],
            "train.micro_batch": m["micro_batch"],
            "train.seq_len": m["seq_len"],
            "train.compile": m["compile"],
        }
        what = f"1b preset, one H200, ZeRO 1, {'--compile' if m['compile'] else 'eager'}"
        h200 = CLUSTERS["h200"].with_size(devices_per_node=1)
        runs.append(Run(f"h200-1b-{mode}", "bench/results/gpu.json", what, h200, flags, m["tokens_per_sec"]))
    return runs


def runs() -> list[Run]:
    a100 = CLUSTERS["a100-80gb"].with_size(nodes=8)
    on_64 = {"launch.gpus": 8, "launch.nodes": 8}
    return [
        Run(
            "torchtitan-llama3-8b-64-a100",
            TORCHTITAN,
            "Llama 3 8B, 64 A100 80GB, FSDP, selective layer checkpointing, local batch 1",
            a100,
            {**LLAMA3_8B, **FSDP_BF16, **SELECTIVE, **on_64, "train.micro_batch": 1},
            2904,
        ),
        Run(
            "torchtitan-llama3-70b-64-a100",
            TORCHTITAN,
            "Llama 3 70B, 64 A100 80GB, FSDP, full checkpointing, local batch 1",
            a100,
            {
                **LLAMA3_70B,
                **FSDP_BF16,
                **on_64,
                "train.micro_batch": 1,
                "train.activation_checkpointing": "full",
            },
            331,
        ),
        Run(
            "torchtitan-llama3.1-8b-8-h100",
            TORCHTITAN,
            "Llama 3.1 8B, 8 H100 (500 W, 2.4 TB/s HBM2e), FSDP, selective checkpointing, local batch 2",
            _torchtitan_h100(),
            {**LLAMA3_8B, **FSDP_BF16, **SELECTIVE, "launch.gpus": 8, "train.micro_batch": 2},
            5762,
        ),
        *_h200_runs(),
    ]


def predict(run: Run) -> StepTime:
    return step_time(memory.setup_from_config(resolve(flags=run.flags)), run.cluster)


def main(argv: list[str] | None = None) -> None:
    del argv  # no options: every run, predicted
    rows = {}
    for run in runs():
        predicted = predict(run)
        rows[run.name] = {
            "source": run.source,
            "what": run.what,
            "reported_tokens_per_s_per_gpu": run.reported,
            "predicted_tokens_per_s_per_gpu": predicted.tokens_per_second_per_device,
            "predicted_over_reported": predicted.tokens_per_second_per_device / run.reported,
            "predicted_mfu": predicted.mfu,
            "dominant_term": predicted.dominant.name,
        }
    write_result({"machine": rundir.environment(1), "runs": rows}, OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
