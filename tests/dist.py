"""Run a test function in N fresh gloo processes (OLMo-core's run_distributed_test, for CPU).

`run_distributed(fn, world_size, *args)` starts `world_size` spawned processes, each with RANK,
LOCAL_RANK, WORLD_SIZE and a free MASTER_PORT set and a gloo process group initialised, calls
`fn(rank, world_size, *args)` and returns the per-rank results. Every process ends with a barrier and
`destroy_process_group()`: without them DeepSpeed runs on gloo abort at exit now and then (SIGABRT).
The same function runs on NCCL when `backend="nccl"` on a GPU machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from llmtrain.parallel.ports import free_port


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, queue: Any
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        from llmtrain.parallel.distributed import shutdown

        shutdown()  # barrier, destroy, and DeepSpeed's shared-memory buffer removed


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, backend: str = "gloo"
) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, backend, fn, args, queue))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"distributed test timed out after {timeout}s ({type(exc).__name__})")
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"worker exit codes {[p.exitcode for p in procs]}")
    return [results[r] for r in range(world_size)]
