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
- Megatron-LM's GPT runs in Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: 39.1B, 76.1B and 145.6B on 512, 1024
  and 1536 A100 80GB with tensor, pipeline and data parallelism together (tp 8 x pp 2 x dp 32, tp 8 x
  pp 4 x dp 32, tp 8 x pp 8 x dp 24), every layer recomputed. The paper reports TFLOP/s per GPU; the
  file holds them as tokens/s per GPU (`_megatron_tokens_per_gpu`).
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
MEGATRON_PAPER = "Narayanan et al. SC21 (arXiv 2104.04473), Table 1"
# The paper's GPT models: vocabulary 51,200 and sequence 2048 (its section 5.1), trained in 16-bit mixed
# precision on Selene's DGX A100 80GB nodes, one 200 Gb/s HDR adapter per GPU (CLUSTERS["a100-80gb"]).
# The A100's fp16 and bf16 peaks are the same 312 TFLOP/s, and llmtrain models the run as bf16.
GPT_VOCAB, GPT_SEQ = 51200, 2048


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    what: str
    cluster: Cluster
    flags: dict[str, Any]
    reported: float  # tokens/s per GPU
    published: str = ""  # the figure as its source gives it, where that is not tokens/s per GPU


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


def _megatron_tokens_per_gpu(tflops: float, hidden: int, layers: int) -> float:
    """Tokens/s per GPU from the paper's achieved TFLOP/s per GPU (X). Its equation (3) counts
    F = 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs per iteration of B sequences of s tokens, recomputation
    included: the block's weights 8 FLOPs per weight and token (6 trained + 2 recomputed, 96·l·h² =
    8 x 12·l·h²), attention's scores and values 16·l·h·s (forward, backward, recomputed forward) and the
    logits 6·V·h, as llmtrain's time model counts the same run. An iteration moves B·s tokens, so
    tokens/s per GPU = X / (F / (B·s)) = X / (96·l·h²·(1 + s/6h + V/16lh)): 138 TFLOP/s for the 39.1B
    model (h 8192, l 48) is 425 tokens/s per GPU."""
    s, v = GPT_SEQ, GPT_VOCAB
    per_token = 96 * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
    return tflops * 1e12 / per_token


def _megatron_gpt(
    size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops: float
) -> Run:
    """One row of the paper's Table 1 (its columns in order) as llmtrain's Llama keys: multi-head
    attention (key/value heads = heads), GPT's tied input and output embeddings, and a SwiGLU MLP of three
    h x i matrices with i the multiple of tp nearest 8h/3, the matmul FLOPs of GPT's two h x 4h matrices
    (8h², within 0.02%). Every layer recomputed in backward (equation (3) counts the extra forward).

    The micro-batch is not published for Table 1: 1, as the paper's Table 2 runs its tp x pp x dp
    layouts (micro-batch 2 moves these predictions by under 5%). ZeRO 1, because llmtrain's pipeline
    runs ZeRO 1 only: it all-reduces the fp32 gradients and all-gathers the updated weights over dp,
    where the paper's Megatron all-reduced the gradients and stepped Adam on every replica.

    The paper ran Table 1 with its interleaved schedule (section 5.1): with v model chunks per GPU (not
    published) its bubble is (pp - 1) / (v·m) of the compute, where llmtrain's schedule of one chunk per
    stage idles (pp - 1) / m. With m = batch / dp = 48, 56 and 96 micro-batches per pipeline here, that
    is 2%, 5% and 7%: the most idle time the prediction can count beyond the interleaved run's. The
    interleaved run sends v times the activations between stages, which its scatter/gather
    optimization cuts by tp on the links across nodes."""
    dp = gpus // (tp * pp)
    flags = {
        "model.hidden_size": hidden,
        "model.intermediate_size": round(8 * hidden / 3 / tp) * tp,
        "model.num_hidden_layers": layers,
        "model.num_attention_heads": heads,
        "model.num_key_value_heads": heads,
        "model.vocab_size": GPT_VOCAB,
        "model.max_position_embeddings": GPT_SEQ,
        "model.tie_word_embeddings": True,
        "parallel.tp": tp,
        "parallel.pp": pp,
        "zero.stage": 1,
        "train.precision": "bf16",
        "train.seq_len": GPT_SEQ,
        "train.micro_batch": 1,
        "train.global_batch": batch,
        "train.activation_checkpointing": "full",
        "launch.gpus": 8,
        "launch.nodes": gpus // 8,
    }
    return Run(
        f"megatron-gpt-{size}b-{gpus}-a100",
        MEGATRON_PAPER,
        f"GPT {size}B, {gpus} A100 80GB, tp {tp} x pp {pp} x dp {dp}, full checkpointing, batch {batch}",
        CLUSTERS["a100-80gb"].with_size(nodes=gpus // 8),
        flags,
        _megatron_tokens_per_gpu(tflops, hidden, layers),
        f"{tflops:g} TFLOP/s per GPU",
    )


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
        # Table 1's rows with tp, pp and dp all above 1 and at most 8 stages (deeper pipelines are where
        # the interleaved schedule's bubble differs most): size, heads, hidden, layers, tp, pp, GPUs,
        # batch, achieved TFLOP/s per GPU.
        _megatron_gpt("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
        _megatron_gpt("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
        _megatron_gpt("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
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
            **({"published": run.published} if run.published else {}),
            "reported_tokens_per_s_per_gpu": run.reported,
            "predicted_tokens_per_s_per_gpu": predicted.tokens_per_second_per_device,
            "predicted_over_reported": predicted.tokens_per_second_per_device / run.reported,
            "predicted_mfu": predicted.mfu,
            "dominant_term": predicted.dominant.name,
        }
    write_result({"machine": rundir.environment(1), "runs": rows}, OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
