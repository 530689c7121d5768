"""Process-group set-up and the few collectives the trainer needs.

DeepSpeed picks its accelerator when first imported; `select_accelerator()` must run before that, so
a CPU machine gets DeepSpeed's `cpu` accelerator and gloo without the user setting DS_ACCELERATOR.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def select_accelerator() -> str:
    """ "cuda" when a GPU is usable, else "cpu"; exported as DS_ACCELERATOR for DeepSpeed."""
    chosen = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ["DS_ACCELERATOR"] = chosen
    return chosen


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    accelerator: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.accelerator == "cuda" else torch.device("cpu")


def inside_launcher() -> bool:
    """True when a launcher (deepspeed, torchrun, Slurm via DeepSpeed) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(timeout_s: float = 600.0) -> World:
    """Join (or create) the process group. A single process gets a world of one on a free port."""
    accelerator = select_accelerator()
    if not inside_launcher():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(
            dist_backend="nccl" if accelerator == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            rank=rank,
            world_size=world_size,
        )
    return World(rank=rank, local_rank=local_rank, world_size=world_size, accelerator=accelerator)


def shutdown() -> None:
    """Barrier then destroy: without them gloo runs abort at exit now and then (SIGABRT)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over all ranks in one collective (NaN propagates, which the guard wants)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.tolist()]


def all_agree(flag: bool, device: torch.device) -> bool:
    """True only if `flag` is true on every rank."""
    t = torch.tensor([0.0 if flag else 1.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return bool(t.item() == 0.0)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True if `flag` is true on at least one rank."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return bool(t.item() > 0.0)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
