"""Resuming with a different world size: DeepSpeed's universal checkpoint, made once and committed like a tag.

ZeRO-1/2/3 shard the optimizer state per rank, so a checkpoint saved by N processes cannot be loaded by M.
DeepSpeed's ds_to_universal rewrites it per parameter; here it runs on rank 0 only, in the staging area,
after the pickle scan and under weights-only loads, and the result gets llmtrain's state files and a
manifest so it verifies, loads and is pruned like any other checkpoint (`step_N_universal`).

The same conversion carries a run to another tp or pp degree: each tensor's tp slices are merged by the
split the checkpoint records (client_state), and a pipeline's layer-indexed parameter names become the
one-process model's, so an engine of any layout finds every parameter by the name it knows.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from llmtrain.checkpoint.collective import broadcast
from llmtrain.checkpoint.common import (
    FORMAT,
    MANIFEST,
    STAGING,
    STATE_FILE,
    UNIVERSAL_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    files_in,
    fsync_file,
    replace_dir,
    sha256,
)
from llmtrain.checkpoint.consolidate import model_name
from llmtrain.checkpoint.reading import checkpoint_dir, read_info
from llmtrain.checkpoint.safeload import scan_pickles, weights_only_loads
from llmtrain.fsutil import write_atomic
from llmtrain.planning import partition


def client_state() -> dict[str, Any]:
    """What ds_to_universal needs to merge a tensor-parallel checkpoint's slices, from planning.partition's
    table (saved with every checkpoint as DeepSpeed's `universal_checkpoint_info`): the row-parallel
    weights are concatenated along dim 1, the column-parallel ones and the vocabulary's rows along
    dim 0 (its default), and the weights every tp rank holds whole are taken once. The patterns match
    model.py's names and a pipeline's layer-indexed ones alike; on load DeepSpeed slices each tensor
    again along the recorded dim for the new tp rank."""
    from deepspeed.checkpoint import constants as uc

    split = partition.TP_SPLIT_DIM
    info = {
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [
            rf"(.*\.)?{name}\.weight$" for name, dim in split.items() if dim == partition.ROW
        ],
        uc.TP_REPLICATED_PARAMETER_PATTERNS: [rf"(.*\.)?{name}\.weight$" for name in partition.WHOLE],
    }
    return {uc.UNIVERSAL_CHECKPOINT_INFO: info}


def convert_to_universal(ckpt_root: Path, tag: str, workers: int = 1) -> Path:
    """`ckpt_root/{tag}_universal` via DeepSpeed's ds_to_universal: once, atomically, by rank 0.

    Every rank must call it; others wait at a barrier. Raises CheckpointError on every rank when the
    conversion fails. `workers` > 1 forks DeepSpeed's process pools (faster for big models).
    """
    ckpt_root = Path(ckpt_root)
    out = ckpt_root / f"{tag}{UNIVERSAL_SUFFIX}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0 and read_info(out) is None:
        error = _convert(ckpt_root, tag, out, workers)
    error = broadcast(error)
    if error:
        raise CheckpointError(error)
    return out


def _convert(ckpt_root: Path, tag: str, out: Path, workers: int) -> str | None:
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    source = checkpoint_dir(ckpt_root, tag)
    info = read_info(source)
    if info is None or not info.partitioned:
        return f"{source}: not a complete checkpoint with sharded optimizer state; nothing to convert"
    work = ckpt_root / STAGING / f"convert_{tag}"
    shutil.rmtree(work, ignore_errors=True)
    # ds_to_universal writes `latest_universal` next to its output folder: keep it inside `work`.
    inner = work / out.name
    args = Namespace(
        input_folder=str(source),
        output_folder=str(inner),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        scan_pickles(source)
        with weights_only_loads():
            unsplit = _saved_without_split(source)
            if unsplit:
                return unsplit
            ds_to_universal.main(args)
        _name_as_one_process_model(inner / "zero")
        _finish_universal(source, inner, info)
        replace_dir(inner, out)
    except Exception as exc:
        return f"cannot convert {source} to a universal checkpoint for a new world size: {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return None


def _saved_without_split(source: Path) -> str | None:
    """A model-parallel checkpoint saved without client_state's split (by an earlier llmtrain): its tp
    slices cannot be merged, and DeepSpeed would fail on the load with a shape error instead."""
    import torch
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    if not (source / "mp_rank_01_model_states.pt").exists():
        return None
    state = torch.load(source / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    if UNIVERSAL_CHECKPOINT_INFO in state:
        return None
    return (
        f"{source}: saved without the split of its model-parallel slices (by an earlier llmtrain), so it "
        "cannot be re-partitioned; resume it on the number of processes it was saved on"
    )


_PIPELINE_NORM = re.compile(r"(\d+)\.norm\.weight")


def _name_as_one_process_model(zero: Path) -> None:
    """A pipeline's per-parameter folders (`3.self_attn.q_proj.weight`, by DeepSpeed's layer index)
    renamed to model.py's names (`layers.2.self_attn.q_proj.weight`), the names every layout's engine
    loads by (engine.pipeline maps its own). The blocks are counted from the final norm's layer index,
    L + 1; a tied embedding (`tied_modules.embed.*`) is the embedding's one folder."""
    names = sorted(p.name for p in zero.iterdir() if p.is_dir())
    norms = [int(m.group(1)) for name in names if (m := _PIPELINE_NORM.fullmatch(name))]
    if not norms:
        return  # saved without a pipeline: the names are model.py's already
    for name in names:
        (zero / name).rename(zero / model_name(name, norms[0] - 1))


def _finish_universal(source: Path, inner: Path, info: CheckpointInfo) -> None:
    """Copy the llmtrain state files and write a manifest, so the result verifies and loads like a tag."""
    for state in source.glob(STATE_FILE.format(rank="*")):
        shutil.copy2(state, inner / state.name)
    files = files_in(inner)
    for rel in files:
        fsync_file(inner / rel)
    manifest = {
        "format": FORMAT,
        "tag": inner.name,
        "universal_of": info.tag,
        "step": info.step,
        "world_size": info.world_size,
        "zero_stage": info.zero_stage,
        **({"layout": info.layout} if info.layout else {}),
        "kv_replicas": info.kv_replicas,
        "partitioned": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": [
            {"path": rel, "size": (inner / rel).stat().st_size, "sha256": sha256(inner / rel)}
            for rel in files
        ],
    }
    write_atomic(inner / MANIFEST, json.dumps(manifest, indent=1))
