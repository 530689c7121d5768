"""The few collectives the checkpoint protocol needs, as no-ops without a process group.

Every rank runs the same save/convert code; with one process (or no initialized group) these return what
a one-member group would, so single-process tools (export, `runs`) share the code path with training.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather(obj: Any) -> list[Any]:
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if distributed():
        dist.barrier()
