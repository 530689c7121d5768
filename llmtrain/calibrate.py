"""`llmtrain plan --calibrate FILE`: this machine's constants for the time model, measured, as a cluster file.

N processes (one per device a run would use: `--gpus`) run side by side as a run's ranks do, on the
accelerator llmtrain would pick, each measuring what one rank gets while the others work too:

* matmul throughput per precision and size (square products of 64 to 1024): a peak and a fixed cost
  per product are fitted to them (a CPU's small products pay threading and dispatch, a GPU's a kernel
  launch);
* memory bandwidth (a 256 MB copy, read and written) and, on a GPU, the host link (pinned host to device);
* attention (scaled dot-product attention, forward and backward, causal) as a share of the peak;
* an all-reduce of 16 MB and of one element over the N ranks (the collective backend llmtrain uses):
  the bus bandwidth and the latency of a ring step;
* where the N processes share fewer cores: how much of a waiting rank's core the computing ranks take
  up (half the ranks compute while the others wait in a collective, against all computing);
* DeepSpeed's CPU Adam over 4M parameters on every rank at once: a node's update rate.

The file is a complete cluster (`devices_per_node` = N, one node); each number's source names the
measurement. Seconds, not minutes: every measurement is a few repetitions after a warm-up.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MATMUL_SIZES = (64, 128, 256, 512, 1024)
# The engines whose own per-step work is measured (a layout maps to one: engine_kind), each at one and two
# micro-batches per step, on a model of many parameters and few tokens (4 `tiny` blocks, 32 tokens):
# its step is mostly what the engine does per parameter, not matmuls.
# "tp" is ZeRO 1 over llmtrain's tensor-parallel layers (tp 2), whose own autograd functions add work per
# block; it is built last (DeepSpeed keeps a process's tp group for good) and only on an even count.
ENGINE_KINDS = {
    "zero1": ("deepspeed", 1),
    "zero3": ("deepspeed", 3),
    "fsdp2": ("fsdp2", 3),
    "tp": ("deepspeed", 1),
}
ENGINE_FLAGS = {"preset": "tiny", "model.num_hidden_layers": 4, "train.seq_len": 32, "train.micro_batch": 1,
                "train.precision": "fp32"}  # fmt: skip
ENGINE_STEPS = 3
ALLREDUCE_BYTES = 16 << 20
# The compute each CPU collective follows: a 1024-square fp32 product, tens of milliseconds per rank,
# about what a block of a small model computes between two of its collectives.
LOADED_MATMUL = 1024
# The compute timed for core_handoff: long enough for the scheduler to settle which rank runs where.
HANDOFF_WINDOW_S = 0.3
COPY_BYTES = 256 << 20
ADAM_PARAMETERS = 4_000_000
REPEATS = 5
WINDOW_S = 0.05
MAX_CALLS = 10_000


def _seconds(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """Seconds per call of `fn`: the median over `repeats` windows of about WINDOW_S each, after one
    untimed warm-up (a GPU synchronised around each call). A window, not one call: where the ranks
    outnumber the cores (gloo processes on a CPU) the scheduler hands each a few milliseconds at a
    time, and one small call timed across another rank's turn reads 100x slow; over a window every
    rank gets its share, as a run's ranks do over a step. Every rank makes the same number of calls
    (the most any rank's warm-up asks for), so a collective `fn` stays matched."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    fn()
    sync()
    wanted = torch.tensor([math.ceil(WINDOW_S / max(time.perf_counter() - started, 1e-6))])
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
    calls = int(min(wanted.item(), MAX_CALLS))
    per_call = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per_call.append((time.perf_counter() - started) / calls)
    return statistics.median(per_call)


def measure_rank(precisions: tuple[str, ...], device: Any) -> dict[str, Any]:
    """What one rank measures on `device` while the others measure too (its process group is up)."""
    import torch
    import torch.distributed as dist

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    matmul: dict[str, dict[int, float]] = {}
    for name in precisions:
        matmul[name] = {}
        for n in MATMUL_SIZES:
            a, b = (torch.randn(n, n, dtype=dtypes[name], device=device) for _ in range(2))
            dist.barrier()
            matmul[name][n] = 2 * n**3 / _seconds(functools.partial(torch.matmul, a, b))
    return {
        "matmul": matmul,
        "memory_bandwidth": _memory_bandwidth(device),
        "host_bandwidth": _host_bandwidth(device),
        "attention": {name: _attention_flops(dtypes[name], device) for name in precisions},
        "allreduce": _allreduce(device),
        "alone_over_all": _alone_over_all(device),
        "adam_rate": _adam_rate(),
        "engines": _engine_steps(device),
    }


def _memory_bandwidth(device: Any) -> float:
    """Bytes/s of a 256 MB copy on `device` (read and write). Its buffers are gone when it returns:
    measured on a 2-core AMD EPYC with 4 ranks, the engine steps timed later with them alive took up to
    twice as long (FSDP2 0.6-0.9 s instead of 0.35-0.45 s, ZeRO 3 at two micro-batches 0.95 s instead of
    0.71 s), and a run's ranks hold no such buffers while they step."""
    import torch
    import torch.distributed as dist

    source = torch.empty(COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    dist.barrier()
    return 2 * COPY_BYTES / _seconds(lambda: target.copy_(source))


def _host_bandwidth(device: Any) -> float | None:
    """Bytes/s of a 256 MB copy from pinned host memory to a GPU (one direction); None on a CPU, whose
    host memory is its device memory."""
    import torch
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    host = torch.empty(COPY_BYTES // 4, pin_memory=True)
    target = torch.empty_like(host, device=device)
    dist.barrier()
    return COPY_BYTES / _seconds(lambda: target.copy_(host, non_blocking=True))


def _attention_flops(dtype: Any, device: Any) -> float:
    """FLOP/s of causal scaled dot-product attention forward + backward (12 per width per key pair,
    halved for the mask: what the time model counts, at batch 1, 8 heads of 64, 512 tokens)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    heads, seq, width = 8, 512, 64
    q, k, v = (
        torch.randn(1, heads, seq, width, dtype=dtype, device=device, requires_grad=True) for _ in range(3)
    )

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    dist.barrier()
    return 12 * heads * width * seq * seq / 2 / _seconds(step)


def _allreduce(device: Any) -> dict[str, float]:
    """Bus bandwidth (bytes/s, as a ring moves them) and seconds per ring step, over every rank. On a
    CPU each collective follows a stretch of compute, as in a step, and is timed as what it adds to
    that compute: there its copies compete with the other ranks' compute for the cores, and a rank
    waits for peers the scheduler has not run yet (measured: 2.5x an all-reduce timed alone)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    if n == 1:
        return {}
    big, small = torch.ones(ALLREDUCE_BYTES // 4, device=device), torch.ones(1, device=device)
    steps = 2 * (n - 1)
    work: Callable[[], Any] = lambda: None  # noqa: E731
    if device.type == "cpu":
        a = torch.randn(LOADED_MATMUL, LOADED_MATMUL)
        work = functools.partial(torch.matmul, a, a)
    alone = _seconds(work)
    seconds = _seconds(lambda: (work(), dist.all_reduce(big))) - alone
    latency = (_seconds(lambda: (work(), dist.all_reduce(small))) - alone) / steps
    latency = max(latency, 0.0)
    return {
        "bus_bandwidth": ALLREDUCE_BYTES * steps / n / max(seconds - steps * latency, 1e-9),
        "latency": latency,
    }


def _alone_over_all(device: Any) -> float | None:
    """Where the ranks outnumber the cores: the time a fixed amount of compute takes on the even ranks
    while the odd ones wait in a gloo barrier (as a pipeline stage waits for its neighbour), over the
    time it takes with every rank computing; None on the odd ranks, on a GPU, or where each rank has a
    core of its own. 1 where a waiting rank's core goes to nobody; cluster_document reads the share
    handed over from it."""
    import torch
    import torch.distributed as dist

    from llmtrain.parallel.distributed import usable_cores

    n = dist.get_world_size()
    if device.type != "cpu" or usable_cores() >= n:
        return None
    a = torch.randn(LOADED_MATMUL, LOADED_MATMUL)
    per_call = torch.tensor([_seconds(functools.partial(torch.matmul, a, a))])
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    calls = max(1, round(HANDOFF_WINDOW_S / per_call.item()))

    def timed(computing: bool) -> float:
        seconds = []
        for _ in range(REPEATS):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(calls if computing else 0):
                torch.matmul(a, a)
            seconds.append(time.perf_counter() - started)
            dist.barrier()  # the waiting ranks sleep here until the others have computed
        return statistics.median(seconds)

    everyone = timed(computing=True)
    alone = timed(computing=dist.get_rank() % 2 == 0)
    return alone / everyone if dist.get_rank() % 2 == 0 else None


def core_handoff(alone_over_all: float, ranks: int, cores: int) -> float:
    """The share of a waiting rank's core the computing ranks took up, from _alone_over_all's ratio:
    0 at a ratio of 1 (nothing handed over), 1 at the ratio a full hand-over gives, where the
    ceil(ranks / 2) computing ranks share the cores all ranks shared (each getting at most one)."""
    computing = -(-ranks // 2)
    full = (cores / ranks) / min(1.0, cores / computing)
    return min(max((1 - alone_over_all) / (1 - full), 0.0), 1.0)


def _adam_rate() -> float:
    """Parameters per second DeepSpeed's CPU Adam updates on this rank while every rank updates."""
    import torch
    import torch.distributed as dist
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    parameter = torch.nn.Parameter(torch.zeros(ADAM_PARAMETERS))
    parameter.grad = torch.ones_like(parameter)
    optimizer = DeepSpeedCPUAdam([parameter], lr=1e-3)
    dist.barrier()
    return ADAM_PARAMETERS / _seconds(optimizer.step)


def engine_config(kind: str, world_size: int, micro_batches: int) -> Any:
    """The TrainConfig of one engine measurement (the same on every rank, and in cluster_document)."""
    from llmtrain.config import resolve

    engine, stage = ENGINE_KINDS[kind]
    tp = 2 if kind == "tp" else 1
    flags = {**ENGINE_FLAGS, "train.engine": engine, "zero.stage": stage, "launch.gpus": world_size,
             "parallel.tp": tp, "train.global_batch": world_size // tp * micro_batches}  # fmt: skip
    return resolve(flags=flags)


def _engine_steps(device: Any) -> dict[str, dict[int, float]]:
    """Seconds of one optimizer step of each engine kind at 1 and 2 micro-batches, a real engine of
    llmtrain's (DeepSpeed's or FSDP2) built as `train` builds it, on random tokens."""
    import torch.distributed as dist

    from llmtrain.parallel.distributed import World

    n = dist.get_world_size()
    world = World(dist.get_rank(), dist.get_rank() if device.type == "cuda" else 0, n, device.type, n)
    kinds = [kind for kind in ENGINE_KINDS if kind != "tp" or n % 2 == 0]
    return {kind: {m: _engine_step(kind, m, world) for m in (1, 2)} for kind in kinds}


def _engine_step(kind: str, micro_batches: int, world: Any) -> float:
    import torch
    import torch.distributed as dist

    from llmtrain.engine.build import build_engine
    from llmtrain.engine.build import engine_config as settings

    cfg = engine_config(kind, world.world_size, micro_batches)
    engine = build_engine(cfg, world, settings(cfg, world))
    tokens = torch.randint(
        cfg.model.vocab_size, (1, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    batches = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}] * micro_batches
    dist.barrier()
    return _seconds(
        functools.partial(engine.run_step, batches, lambda loss: loss, lambda _l, _n: False),
        repeats=ENGINE_STEPS,
    )


def fit_matmul(throughput: dict[int, float]) -> tuple[float, float]:
    """(peak FLOP/s, seconds of overhead per product) with which a square product of size d takes
    overhead + 2 d^3 / peak, fitted to the measured sizes by least squares in relative error (each
    size's time weighted by its inverse). A peak no fit can give (the small products as fast per FLOP
    as the large) falls back to the best measured and no overhead."""
    flops = {d: 2 * d**3 for d in throughput}
    times = {d: flops[d] / rate for d, rate in throughput.items()}
    # Weighted least squares of t = c + F / peak with weights 1 / t^2: the normal equations.
    w = {d: 1 / times[d] ** 2 for d in times}
    sw = sum(w.values())
    sx, sy = sum(w[d] * flops[d] for d in w), sum(w[d] * times[d] for d in w)
    sxx, sxy = sum(w[d] * flops[d] ** 2 for d in w), sum(w[d] * flops[d] * times[d] for d in w)
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    overhead = (sy - slope * sx) / sw
    if slope <= 0:
        return max(throughput.values()), 0.0
    return 1 / slope, max(overhead, 0.0)


def cluster_document(
    ranks: list[dict[str, Any]], devices: int, device_name: str, memory_bytes: int, host_cores: int = 0
) -> dict[str, Any]:
    """The cluster file from every rank's measurements: the slowest rank's figure of each (a step waits
    for the slowest). `host_cores`: the cores the ranks shared (a CPU), 0 on GPUs."""
    precisions = list(ranks[0]["matmul"])
    slowest = {
        p: {d: min(r["matmul"][p][d] for r in ranks) for d in ranks[0]["matmul"][p]} for p in precisions
    }
    fits = {p: fit_matmul(slowest[p]) for p in precisions}
    first = precisions[0]  # fp32: the curve's shape and attention's share are read in it
    attention = min(min(r["attention"][first] for r in ranks) / fits[first][0], 1.0)
    bandwidth = min(r["memory_bandwidth"] for r in ranks)
    device = {
        "name": device_name,
        "peak_flops": {p: float(f"{fit[0]:.4g}") for p, fit in fits.items()},
        "memory_bytes": memory_bytes,
        "memory_bandwidth": float(f"{bandwidth:.4g}"),
        "matmul_efficiency": 1.0,
        "matmul_half_dim": 1,
        "matmul_overhead_s": float(f"{fits[first][1]:.3g}"),
        "attention_efficiency": round(attention, 3),
    }
    doc: dict[str, Any] = {
        "devices_per_node": devices,
        "nodes": 1,
        "device": device,
        "host_bandwidth": float(f"{_slowest_host_link(ranks) or bandwidth:.4g}"),
        "cpu_adam_rate": float(f"{sum(r['adam_rate'] for r in ranks):.4g}"),
        "link_efficiency": 1.0,
    }
    if host_cores:
        doc["host_cores"] = host_cores
        ratios = [r["alone_over_all"] for r in ranks if r.get("alone_over_all") is not None]
        if ratios:
            doc["core_handoff"] = round(core_handoff(statistics.fmean(ratios), devices, host_cores), 2)
    links = [r["allreduce"] for r in ranks if r["allreduce"]]
    if links:
        bus = min(link["bus_bandwidth"] for link in links)
        latency = max(link["latency"] for link in links)
        doc |= {
            "intra_node_bandwidth": float(f"{bus:.4g}"),
            "inter_node_bandwidth": float(f"{bus:.4g}"),  # one node measured: loopback, as between nodes here
            "intra_node_latency": float(f"{latency:.3g}"),
            "inter_node_latency": float(f"{latency:.3g}"),
        }
    else:  # one process: no link measured; the device's memory stands in, which no collective crosses
        doc |= {"intra_node_bandwidth": bandwidth, "inter_node_bandwidth": bandwidth}
    doc["engine_steps"] = {
        kind: {m: max(float(r["engines"][kind][m]) for r in ranks) for m in (1, 2)}
        for kind in ranks[0]["engines"]
    }
    doc["engine_overhead"] = engine_overhead(doc)
    return doc


def engine_overhead(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Seconds per parameter of the rank that each engine kind spends per step and per micro-batch
    beyond what the time model counts on this cluster: the measured step (`doc`'s engine_steps, the
    slowest rank's) minus the predicted (from `doc` without engine_overhead), at one and two
    micro-batches. A new time model derives them again from the same steps."""
    import copy

    from llmtrain.planning import memory
    from llmtrain.planning.hardware import cluster_from_dict
    from llmtrain.planning.timing import step_time

    without = {key: value for key, value in doc.items() if key != "engine_overhead"}
    cluster = cluster_from_dict(copy.deepcopy(without), "the calibration")
    devices = doc["devices_per_node"]
    overhead = {}
    for kind, steps in doc["engine_steps"].items():
        residual, params = {}, 0
        for m in (1, 2):
            setup = memory.setup_from_config(engine_config(kind, devices, m))
            residual[m], params = float(steps[m]) - step_time(setup, cluster).seconds, setup.rank_params
        per_micro_batch = max(residual[2] - residual[1], 0.0)
        per_step = max(residual[1] - per_micro_batch, 0.0)
        overhead[kind] = {
            "per_step": float(f"{per_step / params:.3g}"),
            "per_micro_batch": float(f"{per_micro_batch / params:.3g}"),
        }
    return overhead


def _slowest_host_link(ranks: list[dict[str, Any]]) -> float | None:
    links = [r["host_bandwidth"] for r in ranks if r["host_bandwidth"]]
    return min(links) if links else None


def memory_per_rank(devices: int) -> int:
    """A GPU's memory, or on a CPU the host's shared by the ranks."""
    import psutil
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(psutil.virtual_memory().total // devices)


def write_cluster(path: Path, doc: dict[str, Any], what: str) -> None:
    """The cluster file, headed by what measured it (`what`: the machine and the process count)."""
    import yaml

    from llmtrain.fsutil import write_atomic

    write_atomic(
        path, f"# measured by llmtrain plan --calibrate: {what}\n" + yaml.safe_dump(doc, sort_keys=False)
    )


def _worker(rank: int, devices: int, port: int, precisions: tuple[str, ...], queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(devices), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One node: the local rank is the rank (DeepSpeed's engine asks for it, as its launcher sets it).
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(devices))
    from llmtrain.run.launch import quiet_worker_output

    quiet_worker_output()  # the engines' steps warn as a run's workers would
    import torch
    import torch.distributed as dist

    from llmtrain.parallel.distributed import share_cores

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        share_cores(devices)  # as a run's ranks share them
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=devices)
    try:
        measured = measure_rank(precisions, device)
    except Exception as exc:  # the parent says which rank failed and how, instead of waiting out its timeout
        queue.put(f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0])
        raise
    gathered: list[Any] = [None] * devices
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        queue.put(gathered)
    from llmtrain.parallel.distributed import shutdown

    shutdown()  # barrier, destroy, and DeepSpeed's shared-memory buffer removed


def measure(devices: int, precisions: tuple[str, ...], timeout: float = 600.0) -> list[dict[str, Any]]:
    """Every rank's measurements, from `devices` processes run side by side."""
    import multiprocessing as mp
    import queue as queue_module

    from llmtrain.errors import RunFailure
    from llmtrain.parallel.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, devices, port, precisions, queue)) for r in range(devices)]
    for proc in procs:
        proc.start()
    ranks: list[dict[str, Any]] | str
    try:
        ranks = queue.get(timeout=timeout)
    except queue_module.Empty:
        raise RunFailure(
            f"--calibrate: the {devices} measuring processes did not finish in {timeout:.0f} s"
        ) from None
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if isinstance(ranks, str):
        raise RunFailure(f"--calibrate: a measuring process failed ({ranks})")
    return ranks
