"""The time model: one optimizer step of a layout on a cluster, term by term (a StepTime).

A step is what the slowest rank does: its micro-batches' compute, the collectives it waits for, the
pipeline's fill and drain, the optimizer step, and offload's transfers and host Adam. Each term is
derived from the same Setup the memory model reads (model shape, layout, engine, ZeRO stage, offload,
precision, micro-batch and accumulation as DeepSpeed's dict has them) and from the Cluster's numbers:

* Compute: the rank's matmul FLOPs (6 per weight per token, + 2 for each recomputed block) at the
  device's peak times the matmul efficiency, which falls as the smallest matmul dimension shrinks
  (d / (d + matmul_half_dim)), plus a fixed cost per product (matmul_overhead_s: dispatch, launch);
  attention scores and values at the attention efficiency; and the
  elementwise kernels (norms, residual adds, rotary, SwiGLU), which move bytes rather than compute, at
  the device's memory bandwidth.
* Collectives, as ring algorithms move bytes: an all-reduce sends 2 (n - 1) / n of the tensor per rank,
  a reduce-scatter or all-gather (n - 1) / n, an all-to-all (n - 1) / n of the rank's buffer; each at
  the bandwidth of the slowest link its group crosses (ranks are placed tp innermost, pp outermost, as
  the mesh places them: a group whose ranks share a node uses NVLink, else the NIC), times the link
  efficiency, plus one latency per ring step.
* What each collective overlaps: ZeRO's gradient reductions hide under backward and ZeRO-3's/FSDP2's
  all-gathers under forward and backward (prefetch) as far as that compute lasts; tensor-parallel
  all-reduces, Ulysses' all-to-alls and the pipeline's sends sit on the critical path. ZeRO++ hpZ
  gathers over the whole ZeRO group once per step, then inside the node.
* A pipeline runs m + pp - 1 micro-batch slots per step on every stage; the pp - 1 it idles is the
  bubble (both schedules have the same), the slots paced by the heaviest stage. Where the devices are
  processes sharing a host's cores, a stage that waits hands its cores to the stage at work (as much as
  plan --calibrate measured: core_handoff): the bubble loses only the rest, and the heaviest stage's
  slots shrink towards the stages' mean.
* The optimizer step reads and writes the rank's fp32 partition (master weights, two moments, the
  gradient) at memory bandwidth; offloaded, the gradients go to the host and the weights come back over
  PCIe, and CPU Adam updates every rank's partition of a node at the node's rate (or the moments are
  read from and written to NVMe).

Pure functions, torch-free, like the memory model: predicting a 70B run costs microseconds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from llmtrain.planning import traffic
from llmtrain.planning.flops import (
    attention_width,
    block_elementwise_elements,
    block_matmul_parameters,
    flops_per_token,
)
from llmtrain.planning.hardware import Cluster
from llmtrain.planning.layout import Layout
from llmtrain.planning.memory.activations import hidden_state_bytes, rank_tokens, recomputed_blocks
from llmtrain.planning.memory.pipeline import StageSpan
from llmtrain.planning.memory.setup import Setup

FP32 = 4
# Bytes per parameter the optimizer step touches on the device: fp32 master, exp_avg and exp_avg_sq read
# and written (24), the fp32 gradient read (4), the low-precision weight written (2).
ADAM_BYTES_PER_PARAMETER = 30
# Bytes per logit the fused loss moves in fp32: written by the matmul, read for the log-sum-exp, read and
# rewritten as its gradient (+ its low-precision copy written and read by both gradient matmuls).
LOSS_BYTES_PER_LOGIT = 16
# Parameters an offloaded step moves from NVMe and back: the fp32 master and Adam's two moments.
NVME_BYTES_PER_PARAMETER = 2 * 12
# How much of a phase's compute hides the collectives that overlap it, per engine: DeepSpeed's ZeRO
# hooks launch bucketed reductions and prefetches from Python; FSDP2 overlaps each unit's all-gather and
# reduce-scatter with its neighbour's compute. Assumed until measured (plan --confirm).
OVERLAP = {"deepspeed": 0.8, "fsdp2": 0.9}


@dataclass(frozen=True)
class TimeTerm:
    name: str
    seconds: float
    note: str


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's predicted time, term by term, for `setup` on `cluster`."""

    setup: Setup
    cluster: Cluster
    terms: tuple[TimeTerm, ...]

    @property
    def seconds(self) -> float:
        return sum(term.seconds for term in self.terms)

    @property
    def tokens_per_step(self) -> int:
        return self.setup.cfg.global_batch * self.setup.cfg.train.seq_len

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.seconds

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_second / self.setup.world_size

    @property
    def mfu(self) -> float:
        """Useful FLOPs (flops_per_token: no recompute) over the devices' peak in the run's precision."""
        per_token = flops_per_token(self.setup.cfg.model, self.setup.cfg.train.seq_len)
        peak = self.cluster.device.peak(self.setup.precision) * self.setup.world_size
        return self.tokens_per_second * per_token / peak

    @property
    def dominant(self) -> TimeTerm:
        return max(self.terms, key=lambda term: term.seconds)


def step_time(setup: Setup, cluster: Cluster) -> StepTime:
    """The predicted step of `setup` (its world size laid out on `cluster`'s nodes, devices_per_node
    ranks each)."""
    micro = _micro_batch_compute(setup, cluster)
    m, pp = setup.accumulation_steps, setup.layout.pp
    sends = _pipeline_send_seconds(setup, cluster)
    model_parallel = _model_parallel_terms(setup, cluster, m)
    terms = [
        TimeTerm("compute", m * micro.total, micro.note(m) + _pace_note(setup, cluster)),
        *model_parallel,
        *_sharding_terms(setup, cluster, micro, m),
    ]
    if pp > 1:
        # One slot: a micro-batch's compute, its sends and its share of the model-parallel collectives.
        slot = micro.total + sends + sum(term.seconds for term in model_parallel) / m
        terms += [
            TimeTerm(
                "pipeline sends", m * sends, f"{m} micro-batches' activations and gradients, stage to stage"
            ),
            _bubble(setup, cluster, slot),
        ]
    terms += _optimizer_terms(setup, cluster)
    terms += _engine_overhead(setup, cluster)
    return StepTime(setup, cluster, tuple(t for t in terms if t.seconds > 0))


def _bubble(setup: Setup, cluster: Cluster, slot: float) -> TimeTerm:
    """The pp - 1 slots each stage idles while the pipeline fills and drains, less the share of the
    idle ranks' cores the stages at work take up where the devices are processes sharing a host's cores."""
    m, pp = setup.accumulation_steps, setup.layout.pp
    note = f"{pp - 1} of {m + pp - 1} slots idle while it fills and drains"
    lost = 1 - _handed_over(setup, cluster)
    if cluster.shares_cores:
        note += f"; {lost:.0%} of it lost, the idle ranks' {cluster.host_cores} cores going to the others"
    return TimeTerm("pipeline bubble", (pp - 1) * slot * lost, note)


def _pace_note(setup: Setup, cluster: Cluster) -> str:
    if setup.layout.pp == 1:
        return ""
    handed_over = _handed_over(setup, cluster)
    if handed_over == 0:
        return ", at the heaviest stage's pace"
    return f", the heaviest stage's pace {handed_over:.0%} of the way to the stages' mean (cores handed over)"


def _handed_over(setup: Setup, cluster: Cluster) -> float:
    """The share of a waiting pipeline stage's cores that the stage at work takes up: none where each
    device computes on its own (a GPU); where the devices are processes sharing a host's cores, what the
    calibration measured (core_handoff), up to the cores one stage's ranks can fill."""
    if not cluster.shares_cores or setup.layout.pp == 1:
        return 0.0
    working = cluster.devices_per_node // setup.layout.pp  # a node's ranks of one stage
    return cluster.core_handoff * min(1.0, working / cluster.host_cores)


# ---------------------------------------------------------------- compute


@dataclass(frozen=True)
class MicroBatchCompute:
    """One micro-batch's forward + backward (+ recompute) on a stage's rank, in seconds."""

    matmul: float
    attention: float
    elementwise: float
    efficiency: float  # the matmul efficiency reached at this shape

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.elementwise

    def paced(self, seconds: float) -> MicroBatchCompute:
        """The same micro-batch taking `seconds` in all, each part in proportion."""
        scale = seconds / self.total
        return replace(self, matmul=self.matmul * scale, attention=self.attention * scale,
                       elementwise=self.elementwise * scale)  # fmt: skip

    def note(self, micro_batches: int) -> str:
        return (
            f"{micro_batches} micro-batches x {self.total * 1e3:.3g} ms (matmuls at "
            f"{self.efficiency:.0%} of peak, attention, elementwise)"
        )


def _micro_batch_compute(setup: Setup, cluster: Cluster) -> MicroBatchCompute:
    """The slowest stage's micro-batch, which paces every stage's slot: less, where the stages share a
    host's cores, the cores the lighter stages hand it while they wait (all of them: the stages' mean)."""
    heaviest = _stage_compute(setup, cluster, _slowest_stage(setup))
    handed_over = _handed_over(setup, cluster)
    if handed_over == 0:
        return heaviest
    mean = statistics.fmean(_stage_compute(setup, cluster, span).total for span in setup.spans)
    return heaviest.paced(heaviest.total - handed_over * (heaviest.total - mean))


def _stage_compute(setup: Setup, cluster: Cluster, span: StageSpan) -> MicroBatchCompute:
    model, lay, device = setup.cfg.model, setup.layout, cluster.device
    tokens, seq = rank_tokens(setup), setup.cfg.train.seq_len
    recomputed = recomputed_blocks(setup, span.index)
    # 6 FLOPs per weight and token trained, 2 more per recomputed block's weight.
    block_weights = block_matmul_parameters(model, lay.tp)
    head_weights = model.vocab_size * model.hidden_size // lay.tp if span.head else 0
    matmul_flops = tokens * (
        6 * (span.blocks * block_weights + head_weights) + 2 * recomputed * block_weights
    )
    # Scores and weighted values: 4 FLOPs per width per key forward (12 with backward); each rank
    # attends with H / (tp x sp) heads over whole sequences.
    width = attention_width(model) // (lay.tp * lay.sp)
    attention_flops = 4 * width * seq * tokens * lay.sp * (3 * span.blocks + recomputed)
    # Elementwise: forward reads and writes once, backward about twice as much.
    elementwise_bytes = (
        block_elementwise_elements(model, lay.tp) * tokens * setup.lp_bytes * (3 * span.blocks + recomputed)
    )
    if span.head:  # the loss's fp32 logits of the rank's V / tp rows: written, read twice, rewritten
        elementwise_bytes += tokens * model.vocab_size // lay.tp * (LOSS_BYTES_PER_LOGIT + 3 * setup.lp_bytes)
    peak = device.peak(setup.precision)
    smallest = min(tokens, attention_width(model) // lay.tp, model.hidden_size)
    efficiency = device.matmul_efficiency * smallest / (smallest + device.matmul_half_dim)
    # Each block multiplies 7 weights forward, 14 products backward, 7 more when recomputed; the head 3.
    products = 21 * span.blocks + 7 * recomputed + (3 if span.head else 0)
    matmul = matmul_flops / (peak * efficiency) + products * device.matmul_overhead_s
    attention = attention_flops / (peak * device.attention_efficiency)
    elementwise = elementwise_bytes / device.memory_bandwidth
    return MicroBatchCompute(matmul, attention, elementwise, efficiency)


def _slowest_stage(setup: Setup) -> StageSpan:
    """The pipeline stage with the most compute (blocks, then the output layer), the only stage without."""
    return max(setup.spans, key=lambda span: (span.blocks, span.head))


# ---------------------------------------------------------------- collectives


def _group_bandwidth(group: list[int], cluster: Cluster) -> tuple[float, float, int]:
    """(bytes/s, seconds per ring step, size) of the group of ranks `group`. Inside a node: NVLink.
    Across nodes, NCCL runs one ring per NIC, so a group with k ranks on each node crosses at k NICs'
    bandwidth (at most NVLink's): all of a node's when the group holds the whole node, one NIC's when
    each node holds one of its ranks."""
    per_node = cluster.devices_per_node
    nodes = {rank // per_node for rank in group}
    if len(nodes) == 1:
        return cluster.intra_node_bandwidth * cluster.link_efficiency, cluster.intra_node_latency, len(group)
    on_first = sum(1 for rank in group if rank // per_node == min(nodes))
    crossing = min(cluster.intra_node_bandwidth, on_first * cluster.inter_node_bandwidth)
    return crossing * cluster.link_efficiency, cluster.inter_node_latency, len(group)


def _collective_seconds(
    kind: str, nbytes: float, layout: Layout, axes: tuple[str, ...], cluster: Cluster
) -> float:
    """One collective over the first group along `axes`: `nbytes` is the whole tensor (all-reduce,
    reduce-scatter's input, all-gather's output) or the rank's buffer (all-to-all)."""
    return _ring_seconds(kind, nbytes, *_group_bandwidth(layout.groups_along(axes)[0], cluster))


def _ring_seconds(kind: str, nbytes: float, bandwidth: float, latency: float, n: int) -> float:
    """A ring collective of `n` ranks at `bandwidth` bytes/s and `latency` seconds per step."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    per_rank = nbytes * steps / n
    return per_rank / bandwidth + steps * latency


def _model_parallel_terms(setup: Setup, cluster: Cluster, micro_batches: int) -> list[TimeTerm]:
    """Tensor parallelism's all-reduces and Ulysses' all-to-alls: inside every block, on the critical
    path, for `micro_batches` micro-batches of the slowest stage."""
    lay, model = setup.layout, setup.cfg.model
    span = _slowest_stage(setup)
    recomputed = recomputed_blocks(setup, span.index)
    hidden = hidden_state_bytes(setup)
    terms = []
    if lay.tp > 1:
        # Two all-reduces per block forward (after attention, after the MLP), two backward, two per
        # recomputed forward; the embedding's lookup one.
        count = 4 * span.blocks + 2 * recomputed + span.embedding
        seconds = micro_batches * count * _collective_seconds("all-reduce", hidden, lay, ("tp",), cluster)
        terms.append(
            TimeTerm("tp all-reduce", seconds, f"{count} all-reduces of one micro-batch's hidden states")
        )
    if lay.sp > 1:
        # q, k, v in and the output back, forward and backward (and in a recomputed forward).
        kv = model.num_key_value_heads * model.head_width
        exchanged = setup.lp_bytes * rank_tokens(setup) * (2 * attention_width(model) + 2 * kv) // lay.tp
        count = 2 * span.blocks + recomputed
        seconds = micro_batches * count * _collective_seconds("all-to-all", exchanged, lay, ("sp",), cluster)
        terms.append(TimeTerm("sp all-to-all", seconds, f"{count} attention exchanges per micro-batch"))
    return terms


def _pipeline_send_seconds(setup: Setup, cluster: Cluster) -> float:
    """One micro-batch's activation forward and gradient back across one stage boundary."""
    if setup.layout.pp == 1:
        return 0.0
    bandwidth, latency, _ = _group_bandwidth(setup.layout.groups_along(("pp",))[0], cluster)
    return 2 * (hidden_state_bytes(setup) / bandwidth + latency)


def _sharding_terms(setup: Setup, cluster: Cluster, micro: MicroBatchCompute, m: int) -> list[TimeTerm]:
    """Data parallelism's gradient reductions and ZeRO-3's / FSDP2's parameter all-gathers, minus what
    the engine hides under compute."""
    found = _sharding_collectives(setup, cluster, m)
    if found is None:
        return []
    comm, what, overlaps = found
    # Sharing cores, a collective's copies take the same cores as the compute: nothing overlaps.
    overlaps = overlaps and not cluster.shares_cores
    hidden = min(comm, OVERLAP[setup.engine] * m * micro.total) if overlaps else 0.0
    note = (
        f"{what}; {hidden * 1e3:.3g} ms of it hidden under compute" if overlaps else f"{what}, after backward"
    )
    return [TimeTerm("data-parallel comm", comm - hidden, note)]


def _sharding_collectives(setup: Setup, cluster: Cluster, m: int) -> tuple[float, str, bool] | None:
    """(seconds, what, whether it overlaps compute) of the ZeRO group's collectives in one step, as the
    engine issues them; None without data parallelism."""
    lay, params, axes = setup.layout, setup.rank_params, ("dp", "sp")

    def seconds(kind: str, element_bytes: int) -> float:
        return _collective_seconds(kind, params * element_bytes, lay, axes, cluster)

    gather, accum = seconds("all-gather", setup.lp_bytes), setup.grad_accum_bytes
    if gather == 0:
        return None
    if setup.engine == "fsdp2":
        found = traffic.fsdp2_collectives(setup)
        gathers = sum(c.count for c in found if c.kind == "all-gather")
        what = f"{gathers} all-gathers, 1 fp32 reduce-scatter"
        if any(c.group == traffic.REPLICA_GROUP for c in found):
            replicas = setup.layout.dp // setup.fsdp_shard_ranks
            what += f" over {setup.fsdp_shard_ranks} ranks, 1 fp32 all-reduce of the shard over {replicas} replicas"
        return _priced(setup, cluster), what, True
    if setup.stage == 3:
        return _zero3_collectives(setup, cluster, m)
    if setup.stage == 0:
        return seconds("all-reduce", accum), "1 all-reduce", False
    if setup.stage == 1 and setup.precision == "bf16" and setup.offload == "none":
        # BF16_Optimizer all-reduces its whole fp32 gradient buffer, then gathers the updated weights.
        return seconds("all-reduce", FP32) + gather, "1 fp32 all-reduce and 1 all-gather", False
    if setup.stage == 2 or setup.zero.get("overlap_comm"):
        comm = m * seconds("reduce-scatter", accum) + gather
        return comm, f"{m} reduce-scatters under backward, 1 all-gather", True
    return seconds("reduce-scatter", accum) + gather, "1 reduce-scatter and 1 all-gather", False


def _priced(setup: Setup, cluster: Cluster) -> float:
    """Seconds of the step's sharding collectives (planning.traffic), each over its group at the link
    that group crosses (hpZ's later gathers and HSDP's shard group inside a node)."""
    return sum(
        c.count
        * _ring_seconds(c.kind, c.nbytes, *_group_bandwidth(traffic.group_ranks(setup, c.group), cluster))
        for c in traffic.sharding_collectives(setup) or []
        if c.nbytes and c.count
    )


def _zero3_collectives(setup: Setup, cluster: Cluster, m: int) -> tuple[float, str, bool]:
    """ZeRO 3's collectives priced, and what they are."""
    comm, ranks_per_node = _priced(setup, cluster), setup.hpz_ranks
    again = traffic.backward_gathered_elements(setup) / setup.rank_params
    if ranks_per_node <= 1:
        return comm, f"{m} x (all-gather, {again:.0%} again for backward, reduce-scatter)", True
    inside = f"{m - 1 + again * m:.3g} weights' worth inside the node (hpZ)"
    return comm, f"1 all-gather over the ZeRO group, {inside}, {m} reduce-scatters", True


# ---------------------------------------------------------------- the engine's own work


def engine_kind(setup: Setup, cluster: Cluster) -> str:
    """The calibrated engine a layout runs on: FSDP2, DeepSpeed's ZeRO 3, DeepSpeed at ZeRO 0-2 over
    tensor-parallel layers where that was calibrated, or else DeepSpeed at ZeRO 0-2 (the pipeline
    engine included), whose per-parameter work is alike."""
    if setup.engine == "fsdp2":
        return "fsdp2"
    if setup.stage == 3:
        return "zero3"
    return "tp" if setup.layout.tp > 1 and "tp" in cluster.engine_overhead else "zero1"


def _engine_overhead(setup: Setup, cluster: Cluster) -> list[TimeTerm]:
    kind = engine_kind(setup, cluster)
    measured = cluster.engine_overhead.get(kind)
    if not measured:
        return []
    m = setup.accumulation_steps
    seconds = (measured["per_step"] + m * measured["per_micro_batch"]) * setup.rank_params
    note = f"{kind}'s own work per parameter, per step and per micro-batch, as calibrated"
    return [TimeTerm("engine overhead", seconds, note)]


# ---------------------------------------------------------------- optimizer


def _optimizer_terms(setup: Setup, cluster: Cluster) -> list[TimeTerm]:
    partition = (
        setup.rank_params / setup.state_shards
        if setup.stage > 0 or setup.engine == "fsdp2"
        else setup.rank_params
    )
    if setup.offload == "none":
        seconds = partition * ADAM_BYTES_PER_PARAMETER / cluster.device.memory_bandwidth
        return [TimeTerm("optimizer step", seconds, "Adam over the rank's fp32 partition, memory-bound")]
    per_node = partition * cluster.devices_per_node
    transfers = partition * (FP32 + setup.lp_bytes) / cluster.host_bandwidth
    terms = [
        TimeTerm("offload transfers", transfers, "fp32 gradients to the host, weights back, over PCIe"),
        TimeTerm(
            "cpu adam", per_node / cluster.cpu_adam_rate, "the node's CPU updates every rank's partition"
        ),
    ]
    if setup.offload == "nvme":
        swap = per_node * NVME_BYTES_PER_PARAMETER / cluster.nvme_bandwidth
        terms.append(
            TimeTerm("nvme swap", swap, "master weights and moments read from NVMe and written back")
        )
    return terms
