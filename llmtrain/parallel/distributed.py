"""Process-group set-up and the few collectives the trainer needs."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.errors import RunFailure
from llmtrain.parallel import ports, shm, traffic
from llmtrain.parallel.accelerator import select_accelerator
from llmtrain.parallel.node import inside_launcher, node_name
from llmtrain.quiet import held_stdout


def share_cores(local_ranks: int) -> None:
    """On a CPU, give each of a node's `local_ranks` processes an equal share of its cores as torch
    threads (at least one), unless OMP_NUM_THREADS says otherwise. Torch's default, every core per
    process, oversubscribes the cores: a rank's second thread waits at each kernel's barrier while
    another rank runs (4 ranks on 2 cores, measured: a 64x64 fp32 matmul slowed from 10 us to over
    5 ms). torchrun and DeepSpeed's --bind_cores_to_rank divide the cores the same way."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, usable_cores() // max(1, local_ranks)))


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which a node's CPU ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_ranks() -> int:
    """This node's process count, as the launcher exported it (DeepSpeed: LOCAL_SIZE; torchrun:
    LOCAL_WORLD_SIZE; Slurm: SLURM_NTASKS_PER_NODE); 1 when none did."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    accelerator: str
    local_world_size: int  # this node's processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.accelerator == "cuda" else torch.device("cpu")


def init(timeout_s: float = 600.0) -> World:
    """Join (or create) the process group. A single process gets a world of one on a free port."""
    accelerator = select_accelerator()
    if not inside_launcher():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(ports.free_port()))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = local_ranks()
    if accelerator == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        share_cores(local_world_size)
    # Before the process group and DeepSpeed's backend exist: they keep references to the collectives.
    traffic.install(local_world_size)
    if not dist.is_initialized():
        import deepspeed

        if local_rank == 0:
            # Before this rank joins the group, so no peer on this node can open a dead run's buffer
            # of the same name (a reused port) and keep it while this rank creates a new one.
            shm.sweep_dead_buffers()
        backend, timeout = ("nccl" if accelerator == "cuda" else "gloo"), timedelta(seconds=timeout_s)
        store = _elastic_attempt_store(world_size, timeout)
        if store is not None:
            device = torch.device("cuda", local_rank) if accelerator == "cuda" else None
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device
            )
        # Creates the process group, or (under torchrun) adopts the one just made. On a CPU its shm
        # all-reduce op is loaded here, and its builder prints that it was.
        with held_stdout():
            deepspeed.init_distributed(
                dist_backend=backend, timeout=timeout, rank=rank, world_size=world_size
            )
    _register_process(rank)
    return World(rank, local_rank, world_size, accelerator, local_world_size)


def _elastic_attempt_store(world_size: int, timeout: timedelta) -> Any:
    """torchrun's agent keeps one key-value store across restarts, and torch's process group reads
    the peers' addresses from it: after a restart a fast rank can read the previous attempt's address
    of a slow one and fail to connect ("Connection refused"). A prefix per attempt keeps them apart.
    None outside torchrun (then the usual env:// rendezvous applies)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"llmtrain/attempt_{attempt}", agent_store)


def shutdown(barrier: bool = True) -> None:
    """Barrier then destroy: without them gloo runs abort at exit now and then (SIGABRT). Without the
    barrier when a peer may be gone (a failed run: the launcher ends the others)."""
    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        shm.remove_own_buffer(rank)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over all ranks in one collective (NaN propagates, which the guard wants)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.tolist()]


def device_peak_bytes(world: World) -> int | None:
    """The most GPU memory any rank's tensors have held so far (torch.cuda's allocator peak, the
    heaviest rank's: a pipeline's stages differ); None on a CPU, which has no allocator peak."""
    if world.accelerator != "cuda":
        return None
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(world.device)], dtype=torch.float64, device=world.device
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


# ---------------------------------------------------------------- who failed: naming the rank
#
# A collective that fails (a peer died, or one is stuck and the gloo timeout fired) raises on the ranks
# still waiting in it, but the error names no rank. Each rank leaves its node, host, pid, a liveness
# address and the step it last reached in the process group's key-value store, so the ranks that notice
# can say which one it was. The liveness address is a listening socket nobody accepts on: the kernel
# completes a connection to it while the process lives and refuses one once it has died, so a rank on
# another node can tell a dead peer from a stuck one, and a node that went away from both.

_PROCESS_KEY = "llmtrain/process/{rank}"
_PROGRESS_KEY = "llmtrain/progress/{rank}"
_STORE_QUERY_TIMEOUT = timedelta(seconds=5)
_PROBE_TIMEOUT_S = 3.0
# A killed process closes its sockets while the kernel tears it down, a moment before it shows as dead
# (a zombie, or a refused probe): a peer that lost contact looks again for this long before calling
# the other rank alive.
_DYING_GRACE_S = 2.0
_TIMEOUT_TEXT = ("timed out", "timeout")
_LOST_TEXT = ("connection closed", "connection reset", "broken pipe", "connection refused")
_liveness: list[socket.socket] = []  # kept open for the life of the process


class CollectiveFailed(RunFailure):
    """A collective failed because another rank died or is stuck (exit code 1); names the rank."""


def _store() -> Any:
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private helper of torch: without it, errors just name fewer ranks
        return None


def _register_process(rank: int) -> None:
    store = _store()
    if store is not None:
        process = {"node": node_name(), "host": socket.gethostname(), "pid": os.getpid()}
        store.set(_PROCESS_KEY.format(rank=rank), json.dumps({**process, "probe": _open_liveness_probe()}))


def _open_liveness_probe() -> list[Any] | None:
    """[address, port] the other ranks can connect to while this process lives (None if none can be had)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:  # no packet sent: picks the route
            route.connect(
                (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "1")))
            )
            address = route.getsockname()[0]
        probe = socket.create_server(("", 0), backlog=64)
    except OSError:
        return None
    _liveness.append(probe)
    return [address, probe.getsockname()[1]]


def note_progress(rank: int, step: int) -> None:
    """Record that `rank` reached `step`'s first collective (one small store write per step)."""
    store = _store()
    if store is not None:
        store.set(_PROGRESS_KEY.format(rank=rank), str(step))


def collective_failure(
    exc: BaseException, rank: int, step: int | None, timeout_s: float
) -> CollectiveFailed | None:
    """A CollectiveFailed naming the ranks at fault when `exc` is a failed collective, else None."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).lower()
    where = f"at step {step}" if step is not None else "while starting"
    if any(t in text for t in _TIMEOUT_TEXT):
        what = f"a collective timed out after {timeout_s:g}s {where} (--collective-timeout)"
    elif any(t in text for t in _LOST_TEXT):
        what = f"lost contact with another rank {where}"
    else:
        return None
    culprits = _describe_peers(rank, step) or "another rank died or is stuck"
    return CollectiveFailed(f"rank {rank}: {what}: {culprits}")


def _describe_peers(rank: int, step: int | None) -> str:
    try:
        store = _store()
        if store is None:
            return ""
        store = store.clone()
        store.set_timeout(_STORE_QUERY_TIMEOUT)
        deadline = time.monotonic() + _DYING_GRACE_S
        peers = [peer for peer in range(dist.get_world_size()) if peer != rank]
        notes = [_describe_peer(store, peer, step, deadline) for peer in peers]
    except Exception:  # the store lives in rank 0's process: gone with it
        return "rank 0 (which holds the job's key-value store) is unreachable"
    return "; ".join(n for n in notes if n)


def _describe_peer(store: Any, peer: int, step: int | None, deadline: float) -> str:
    process_key, progress_key = _PROCESS_KEY.format(rank=peer), _PROGRESS_KEY.format(rank=peer)
    if store.check([process_key]):
        process = json.loads(store.get(process_key).decode())
        where = f"rank {peer} on {process['node']} (pid {process['pid']})"
        state = _settled_state(process, deadline)
        if state == "dead":
            return f"{where} has died (crashed or killed)"
        if state == "unreachable":
            return f"{where} cannot be reached: its node is down or the network to it failed"
    if step is not None:
        reached = int(store.get(progress_key).decode()) if store.check([progress_key]) else 0
        if reached < step:
            return f"rank {peer} is stuck: it never reached step {step} (last at step {reached})"
    return ""


def _settled_state(process: dict[str, Any], deadline: float) -> str:
    """The peer's state, looked at again until `deadline` while it still seems alive."""
    while (state := _peer_state(process)) == "alive" and time.monotonic() < deadline:
        time.sleep(0.1)
    return state


def _peer_state(process: dict[str, Any]) -> str:
    """'alive', 'dead' or 'unreachable' (or 'unknown': no probe and on another host)."""
    if process["host"] == socket.gethostname():
        return "alive" if _alive(int(process["pid"])) else "dead"
    if not process.get("probe"):
        return "unknown"
    try:
        socket.create_connection(tuple(process["probe"]), timeout=_PROBE_TIMEOUT_S).close()
    except ConnectionRefusedError:
        return "dead"
    except OSError:
        return "unreachable"
    return "alive"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
