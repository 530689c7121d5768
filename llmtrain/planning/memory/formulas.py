"""The breakdown: a Setup -> per-GPU and per-node bytes, term by term (an Estimate), from the model
states (states.py), the activations (activations.py) and the buffers and host terms below.

Every number is derived from the model shape and the DeepSpeed config dsconfig generates, following what
DeepSpeed 0.19.8 and llmtrain.model actually allocate (checked against the real engine and against
saved-tensor hooks in tests/test_memory_calibration.py):

* Model states follow the optimizer wrapper DeepSpeed picks: stage 0 bf16/fp16 keeps an unpartitioned
  fp32 master copy; stage 1 in bf16 (fp32 gradient accumulation) runs BF16_Optimizer, which partitions
  master weights and moments but keeps a full fp32 gradient buffer; stages 1-2 otherwise partition
  gradients once overlap_comm's hooks reduce them; stage 3 partitions everything. ZeRO-1/2/3 clone an fp32
  master partition even in fp32 training (only stage 0 steps the model's own fp32 weights).
* Activations are the bytes autograd saves for backward in llmtrain.model, per layer, per checkpointing
  mode; logits are computed in chunks of LOSS_CHUNK_ROWS rows, so only one chunk's fp32 logits exist, and
  the fused loss holds the output weight's gradient (fp32 sum) from the end of forward.
* Tensor parallelism (tp, planning.partition's split) leaves each rank 1/tp of every layer's q, k, v, o,
  gate, up and down matrices (the embedding, lm_head and norms stay whole), and ZeRO partitions what a
  rank holds over the data-parallel ranks only. Sequence parallelism (sp, Ulysses) replicates the parameters over sp ranks and
  ZeRO partitions over dp x sp; each rank's activations hold seq_len / sp tokens.
* Pipeline parallelism (pp, ZeRO 1 only) gives each rank one stage of llmtrain.planning.stages' partition:
  the model-state terms are the heaviest stage's (ZeRO 1 shards its optimizer states over the dp ranks of
  that stage), the activations the peak over stages of one micro-batch's bytes on the stage times the
  micro-batches it holds at once (planning.memory.pipeline.in_flight), the embedding's on the first stage and the
  final norm's and the loss's on the last. Taking each term's worst stage bounds every stage's peak.
* FSDP2 (--engine fsdp2, torch 2.13's fully_shard as llmtrain.engine.fsdp2 applies it: one unit per
  block, then the root with the embedding, final norm and output layer) replaces DeepSpeed's model states
  and buffers with its own: fp32 shards of the parameters (the masters), of the gradients and of AdamW's
  moments, the units' parameters gathered in the model dtype (--zero 2 keeps them all from forward to
  backward, --zero 3 one block and its prefetched neighbour besides the root), fp32 gradients
  accumulated unsharded between reductions, and one unit's reduce-scatter buffers; the model states are
  checked against the real FSDP2 engine in tests/test_memory_fsdp2.py. Activations are the model's, as
  under DeepSpeed.

Import-light on purpose: no torch, no DeepSpeed, no model; estimating a 70B model allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.planning.memory.activations import (
    LOSS_CHUNK_ROWS,
    activation_bytes,
    activation_peak_stage,
    backward_working_bytes,
    checkpointed_input_bytes,
    hidden_state_bytes,
    loss_chunk_bytes,
    stage_activations,
    ulysses_buffer_bytes,
)
from llmtrain.planning.memory.pipeline import (
    describe_span,
)
from llmtrain.planning.memory.setup import FP32, Setup, parameter_tensors
from llmtrain.planning.memory.states import (
    ModelStates,
    gathered_elements,
    model_states,
    persistent_elements,
    shard_units,
)

# Per GPU, whatever the model: the CUDA context with PyTorch's kernels loaded (~0.5 GiB) plus cuBLAS and
# NCCL workspaces. An assumption, not derived; `make gpu-check` measures the rest against it.
RUNTIME_OVERHEAD_BYTES = 1 << 30
# DeepSpeed's defaults for what dsconfig does not set (read from its dict first where it could).
STAGE0_ALLREDUCE_BUCKET = 500_000_000  # engine allreduce_bucket_size (elements)
NVME_PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (elements)
SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size (elements)


def _fsdp2_terms(setup: Setup) -> list[Term]:
    """FSDP2's buffers on the GPU, in place of DeepSpeed's buckets (offloaded or not: FSDP2 gathers and
    reduces on the GPU)."""
    terms = [_gathered_term(setup), _reduce_scatter_term(setup)]
    if setup.accumulation_steps > 1:
        terms.append(_accumulated_gradients_term(setup))
    return terms


def _gathered_term(setup: Setup) -> Term:
    if not setup.shape_known:
        return Term("gathered parameters", 0, "activations", "unknown: give the model's shape")
    held = (
        "the root unit (embedding, final norm, output layer), the running block and one all-gather output"
        if setup.stage == 3
        else "every unit from its forward to its backward, and the last block's all-gather output"
    )
    return Term("gathered parameters", setup.lp_bytes * gathered_elements(setup), "activations", held)


def _reduce_scatter_term(setup: Setup) -> Term:
    """A unit's post-backward (foreach_reduce) copies its unsharded gradients, in the model dtype, into
    a reduce-scatter input in the fp32 reduce dtype and frees them only then; the input is kept until
    the next unit's reduce (reduce_scatter_max_input_buffers 1), which frees it first: one unit's at a
    time, after the activations of the blocks behind it are freed."""
    if not setup.shape_known:
        return Term("reduce-scatter buffers", 0, "transient", "unknown: give the model's shape")
    largest = shard_units(setup.cfg.model, setup.layout.tp).largest
    note = "the largest unit's gradients, unsharded, and the fp32 reduce-scatter input they are copied into"
    return Term("reduce-scatter buffers", (setup.lp_bytes + FP32) * largest, "transient", note)


def _accumulated_gradients_term(setup: Setup) -> Term:
    """Gradient accumulation without communication (set_requires_gradient_sync(False) on all but the
    last micro-batch): every unit keeps its unsharded gradients, cast to the fp32 reduce dtype
    (FSDPParam.to_accumulated_grad_if_needed), until the last backward reduces them."""
    m = setup.accumulation_steps
    note = f"fp32, unsharded, summed over {m} micro-batches before one reduce-scatter"
    return Term("accumulated gradients", FP32 * setup.rank_params, "activations", note)


# ---------------------------------------------------------------- the breakdown


@dataclass(frozen=True)
class Term:
    """One line of the breakdown. phase: 'always' is held throughout; 'activations' during forward and
    backward; 'transient' the largest of these rides on top of the activations; 'step' during the
    optimizer step (activations are gone by then)."""

    name: str
    bytes: int
    phase: str
    note: str


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    gpu: list[Term]
    cpu: list[Term]  # per node
    nvme: list[Term]  # per node
    states: ModelStates

    @property
    def gpu_peak(self) -> int:
        """always + max(activations + largest transient, step buffers)."""

        def total(phase: str) -> int:
            return sum(t.bytes for t in self.gpu if t.phase == phase)

        transient = max((t.bytes for t in self.gpu if t.phase == "transient"), default=0)
        return total("always") + max(total("activations") + transient, total("step"))

    @property
    def cpu_per_node(self) -> int:
        return sum(t.bytes for t in self.cpu)

    @property
    def nvme_per_node(self) -> int:
        return sum(t.bytes for t in self.nvme)

    def to_dict(self) -> dict[str, Any]:
        s, c = self.setup, self.setup.cfg

        def rows(terms: list[Term]) -> list[dict[str, Any]]:
            return [{"term": t.name, "bytes": t.bytes, "phase": t.phase, "note": t.note} for t in terms]

        return {
            "setup": {
                "params": s.params,
                "preset": c.preset if s.shape_known else None,
                "engine": s.engine,
                "zero_stage": s.stage,
                "offload": s.offload,
                "precision": s.precision,
                "gpus_per_node": c.launch.gpus,
                "nodes": c.launch.nodes,
                "world_size": s.world_size,
                "tp": s.layout.tp,
                "sp": s.layout.sp,
                "pp": s.layout.pp,
                "pp_schedule": c.parallel.pp_schedule,
                "pp_partition": c.parallel.pp_partition,
                "data_parallel": s.layout.dp,
                "layout": s.layout.describe(),
                "zero_group": s.zero_group,
                "fsdp_mesh": s.fsdp_mesh if s.engine == "fsdp2" else None,
                "micro_batch": c.train.micro_batch,
                "global_batch": s.ds["train_batch_size"],
                "gradient_accumulation_steps": s.accumulation_steps,
                "seq_len": c.train.seq_len,
                "activation_checkpointing": c.train.activation_checkpointing,
                "checkpoint_every_k": c.train.checkpoint_every_k,
            },
            "per_gpu": rows(self.gpu),
            "per_gpu_peak_bytes": self.gpu_peak,
            "model_states_per_rank_bytes": self.states.total,
            "per_node_cpu": rows(self.cpu),
            "per_node_cpu_bytes": self.cpu_per_node,
            "per_node_nvme": rows(self.nvme),
            "per_node_nvme_bytes": self.nvme_per_node,
            "pipeline": pipeline_report(s) if s.layout.pp > 1 else None,
        }


def pipeline_report(setup: Setup) -> dict[str, Any]:
    """The pipeline's schedule, bubble and every stage's parameters, model states and activations (the
    per-GPU terms hold the heaviest stage's states and the peak stage's activations)."""
    p = setup.cfg.parallel
    stages = []
    for span in setup.spans:
        states = model_states(setup.for_stage(span.index))
        stages.append(
            {
                "stage": span.index,
                "layers": describe_span(span),
                "blocks": span.blocks,
                "params": span.parameters,
                "model_states_bytes": states.total,
                "model_states_gpu_bytes": states.gpu,
                "in_flight_micro_batches": setup.in_flight(span.index),
                "activations_per_micro_batch_bytes": activation_bytes(setup, span.index),
                "activations_bytes": stage_activations(setup, span.index),
            }
        )
    return {
        "stages": setup.layout.pp,
        "schedule": p.pp_schedule,
        "partition": p.pp_partition,
        "micro_batches": setup.accumulation_steps,
        "bubble_fraction": setup.bubble,
        "heaviest_stage": setup.state_span.index,
        "activation_peak_stage": activation_peak_stage(setup),
        "per_stage": stages,
    }


def estimate(setup: Setup) -> Estimate:
    states = model_states(setup)
    buffers = _fsdp2_terms(setup) if setup.engine == "fsdp2" else _buffer_terms(setup)
    gpu = _state_terms(setup, states) + _activation_terms(setup) + buffers
    gpu += _pipeline_terms(setup)
    gpu.append(
        Term(
            "runtime overhead",
            RUNTIME_OVERHEAD_BYTES,
            "always",
            "CUDA context + cuBLAS/NCCL workspaces (assumed)",
        )
    )
    cpu, nvme = _host_terms(setup, states)
    return Estimate(setup, gpu, cpu, nvme, states)


def _state_terms(setup: Setup, s: ModelStates) -> list[Term]:
    params_note = s.notes.get("params", "model dtype") + _split_note(setup)
    return [
        Term("parameters", s.params_gpu, "always", params_note),
        Term("gradients", s.grads_gpu, "always", s.notes.get("grads", "model dtype")),
        Term("optimizer states", s.optim_gpu, "always", s.notes.get("optim", "")),
    ]


def _split_note(setup: Setup) -> str:
    """What tp, sp or pp does to a rank's parameters, for the parameters' note."""
    lay = setup.layout
    if lay.pp > 1:
        span = setup.state_span
        return (
            f"; pipeline stage {span.index} of {lay.pp}, the heaviest: {setup.rank_params:,} params "
            f"({describe_span(span)})"
        )
    if lay.tp > 1:
        return (
            f"; q,k,v,o,gate,up,down, embedding and lm_head / tp {lay.tp} ({setup.rank_params:,} "
            "params per rank), norms whole"
        )
    return f"; replicated over sp {lay.sp}" if lay.sp > 1 else ""


def _activation_terms(setup: Setup) -> list[Term]:
    if not setup.shape_known:
        return [Term("activations", 0, "activations", "unknown: give --hidden-size --layers --heads ...")]
    t, lay = setup.cfg.train, setup.layout
    mode = t.activation_checkpointing
    mode_note = f"selective, every {t.checkpoint_every_k}" if mode == "selective" else mode
    tokens = f"{t.seq_len} tokens" if lay.sp == 1 else f"{t.seq_len} / sp {lay.sp} tokens"
    split = f"; attention and MLP inner activations / tp {lay.tp}" if lay.tp > 1 else ""
    if t.cpu_checkpointing:
        split += "; checkpointed blocks' inputs in host memory"
    elif t.partition_activations:
        split += f"; checkpointed blocks' inputs partitioned / tp {lay.tp}"
    peak = activation_peak_stage(setup) if lay.pp > 1 else 0
    terms = [
        Term(
            "activations",
            stage_activations(setup, peak),
            "activations",
            f"saved for backward, micro-batch {t.micro_batch} x {tokens}, checkpointing {mode_note}{split}"
            + _in_flight_note(setup, peak),
        ),
        Term(
            "backward working set", backward_working_bytes(setup), "transient", "recompute + activation grads"
        ),
        Term(
            "logits and loss",
            loss_chunk_bytes(setup),
            "transient",
            f"fused with lm_head, chunks of {LOSS_CHUNK_ROWS} rows: fp32 logits never whole"
            + ("; last stage only" if lay.pp > 1 else ""),
        ),
    ]
    if lay.sp > 1:
        note = f"q, k, v in and output back, one attention layer at a time, sp {lay.sp}"
        terms.append(Term("Ulysses all-to-all buffers", ulysses_buffer_bytes(setup), "transient", note))
    return terms


def _in_flight_note(setup: Setup, stage: int) -> str:
    """Which stage the activations are of and how many micro-batches it holds, for their note."""
    lay = setup.layout
    if lay.pp == 1:
        return ""
    span, held = setup.spans[stage], setup.in_flight(stage)
    return (
        f"; stage {stage} of {lay.pp}, the peak: {span.blocks} blocks x {held} micro-batch"
        f"{'es' if held > 1 else ''} in flight ({setup.cfg.parallel.pp_schedule}, "
        f"{setup.accumulation_steps} per step)"
    )


def _pipeline_terms(setup: Setup) -> list[Term]:
    """DeepSpeed's pipeline receive buffers, allocated at the first exchange and kept: one activation
    from the previous stage and one gradient from the next (a middle stage has both, an end stage one)."""
    lay = setup.layout
    if lay.pp == 1 or not setup.shape_known:
        return []
    buffers = 1 if lay.pp == 2 else 2
    size = hidden_state_bytes(setup)
    note = (
        "one micro-batch's received activation and gradient"
        if buffers == 2
        else "one micro-batch's received activation (last stage) or gradient (first stage)"
    )
    return [Term("pipeline receive buffers", buffers * size, "always", note)]


def _largest_param(setup: Setup) -> int:
    """The largest parameter tensor a rank holds: under pp, its stage's."""
    if not setup.shape_known:
        return 0
    if setup.layout.pp > 1:
        return setup.state_span.largest_tensor
    return max(parameter_tensors(setup.cfg.model, setup.layout.tp))


def _buffer_terms(setup: Setup) -> list[Term]:
    z, b, p = setup.zero, setup.lp_bytes, setup.rank_params
    if setup.stage == 0:
        bucket = min(p, STAGE0_ALLREDUCE_BUCKET)
        return [Term("allreduce bucket", b * bucket, "step", "engine's flattened allreduce (5e8 elements)")]
    terms: list[Term] = []
    if setup.stage in (1, 2):
        copies = 2 if z.get("overlap_comm") else 1
        terms.append(
            Term(
                "reduce buckets",
                copies * b * min(p, z["reduce_bucket_size"]),
                "always",
                f"{copies} x reduce_bucket_size {z['reduce_bucket_size']:,} elements",
            )
        )
        terms.append(
            Term(
                "allgather bucket",
                b * min(p, z["allgather_bucket_size"]),
                "step",
                f"allgather_bucket_size {z['allgather_bucket_size']:,} elements",
            )
        )
        if setup.offload == "cpu":
            terms.append(
                Term("offload grad staging", b * _largest_param(setup), "always", "largest parameter")
            )
        elif setup.grad_accum_bytes != FP32:  # fp16: the step builds an fp32 copy of the grad partition
            terms.append(Term("fp32 grad partition", round(FP32 * p / setup.zero_group), "step", "at step"))
        return terms
    live = z["stage3_max_live_parameters"] + z["stage3_prefetch_bucket_size"]
    return [
        Term(
            "reduce bucket",
            b * min(p, z["reduce_bucket_size"]),
            "always",
            f"reduce_bucket_size {z['reduce_bucket_size']:,} elements",
        ),
        Term(
            "gathered parameters",
            b * min(p - persistent_elements(setup), live),
            "activations",
            f"up to stage3_max_live_parameters {z['stage3_max_live_parameters']:,} "
            f"+ prefetch {z['stage3_prefetch_bucket_size']:,} elements",
        ),
    ]


# The offloaded states' notes per engine: FSDP2 offloads its fp32 shards, which are the masters.
_HOST_NOTES = {
    "deepspeed": ("pinned, per node", "fp32 partitions, pinned", "fp32 master + moments"),
    "fsdp2": ("fp32 shards (the masters), pinned", "fp32 shards, pinned", "AdamW moments"),
}


def _host_terms(setup: Setup, s: ModelStates) -> tuple[list[Term], list[Term]]:
    g, b = setup.cfg.launch.gpus, setup.lp_bytes
    params_note, grads_note, optim_note = _HOST_NOTES[setup.engine]
    cpu = [
        Term("offloaded parameters", g * s.params_cpu, "always", params_note),
        Term("offloaded gradients", g * s.grads_cpu, "always", grads_note),
        Term("offloaded optimizer states", g * s.optim_cpu, "always", optim_note),
    ]
    if setup.cfg.train.cpu_checkpointing and setup.shape_known:
        peak = activation_peak_stage(setup) if setup.layout.pp > 1 else 0
        held = setup.in_flight(peak) * checkpointed_input_bytes(setup, peak)
        split = f" / tp {setup.layout.tp}" if setup.cfg.train.partition_activations else ""
        note = f"checkpointed blocks' inputs{split} (--cpu-checkpointing), per GPU x {g}"
        cpu.append(Term("checkpointed activations", g * held, "always", note))
    if setup.engine == "deepspeed" and setup.stage in (1, 2) and setup.offload == "cpu":
        staging = round(b * setup.rank_params / setup.zero_group) + b * _largest_param(setup)
        cpu.append(Term("pinned staging buffers", g * staging, "always", "bit16 partition + largest grad"))
    nvme: list[Term] = []
    if setup.offload == "nvme":
        cpu.append(_swap_buffers(setup))
        nvme = [
            Term("parameters on NVMe", g * s.params_nvme, "always", "bit16 partitions"),
            Term("optimizer states on NVMe", g * s.optim_nvme, "always", "fp32 master + moments"),
        ]
    return [t for t in cpu if t.bytes], nvme


def _swap_buffers(setup: Setup) -> Term:
    """NVMe offload's pinned aio buffers, per node: per GPU, offload_param.buffer_count buffers of
    buffer_size elements in the model dtype and offload_optimizer.buffer_count fp32 sub-groups."""
    z = setup.zero
    params, optim = z["offload_param"], z["offload_optimizer"]
    param_buffer = params.get("buffer_size", NVME_PARAM_BUFFER_SIZE) * setup.lp_bytes
    sub_group = min(z.get("sub_group_size", SUB_GROUP_SIZE), round(setup.rank_params / setup.zero_group))
    swap = params["buffer_count"] * param_buffer + optim["buffer_count"] * FP32 * sub_group
    note = f"{params['buffer_count']} param + {optim['buffer_count']} optimizer aio buffers per GPU"
    return Term("pinned swap buffers", setup.cfg.launch.gpus * swap, "always", note)
