"""Full fp32 model weights from a checkpoint of any ZeRO stage, in one process (for `llmtrain export`).

DeepSpeed's zero_to_fp32 covers ZeRO-2/3 but not stage 0 (weights live in the model file, the fp32
master copy in the optimizer) nor ZeRO-1 with DeepSpeed's BF16_Optimizer (shards without `zero_stage`):
those two are reassembled here. Every file is pickle-scanned first and loaded weights-only.

With tensor parallelism each tp rank's files (`mp_rank_XX`) hold a data-parallel checkpoint of that
rank's slices: each rank is consolidated as above, then every parameter is rebuilt from its slices along
the dim planning.partition splits it.

A pipeline checkpoint (PipelineEngine, ZeRO 1: `layer_NN-model_states.pt` files) uses `mp_rank_XX` for
the pipeline stage, not a tp rank: each stage's fp32 masters are cut from its optimizer shards and
renamed from DeepSpeed's layer-indexed names to the one-process model's (see `_pipeline_fp32`).

An FSDP2 checkpoint (torch.distributed.checkpoint) holds the sharded fp32 parameters, which are the
masters, under model.py's own names: DCP reassembles them in this one process (`dcp.full_tensors`).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint import dcp
from llmtrain.checkpoint.common import CheckpointError
from llmtrain.checkpoint.reading import checkpoint_dir, read_info
from llmtrain.checkpoint.safeload import scan_pickles, weights_only_loads
from llmtrain.planning import stages
from llmtrain.planning.partition import is_kv_projection, tp_split_dim


def consolidated_fp32_state_dict(ckpt_root: Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights from a checkpoint of any ZeRO stage and tp degree (for `llmtrain export`)."""
    path = checkpoint_dir(ckpt_root, tag)
    info = read_info(path)
    if info is None:
        raise CheckpointError(f"{path}: no manifest, not a complete checkpoint")
    scan_pickles(path)
    # The optimizer's fp32 copies load as tensors that require grad: weights are plain data.
    with weights_only_loads(), torch.no_grad():
        if info.engine == "fsdp2":
            state = {name: t.float() for name, t in dcp.full_tensors(path, prefix="model.").items()}
        elif _is_pipeline_checkpoint(path):
            state = _tp_pipeline_fp32(path, info.partitioned, info.kv_replicas)
        else:
            state = _tp_fp32(path, info.partitioned, info.kv_replicas)
    return {name: tensor.detach() for name, tensor in state.items()}


def _tp_fp32(path: Path, partitioned: bool, kv_replicas: int = 1) -> dict[str, torch.Tensor]:
    """A data- and tensor-parallel checkpoint: each tp rank consolidated, then the slices merged."""
    tp_ranks = _mp_ranks(path, "tp ranks")
    if len(tp_ranks) == 1:
        return _one_tp_rank(path, partitioned)
    with tempfile.TemporaryDirectory(prefix="llmtrain_tp_") as tmp:
        views = [_tp_rank_view(path, rank, len(tp_ranks), 1, Path(tmp)) for rank in tp_ranks]
        return _merge_tp_slices(path, [_one_tp_rank(view, partitioned) for view in views], kv_replicas)


def _one_tp_rank(path: Path, partitioned: bool) -> dict[str, torch.Tensor]:
    """The fp32 weights a checkpoint directory holding one tp rank's files (mp_rank_00) describes."""
    if not partitioned:
        return _unpartitioned_fp32(path)
    if _is_bf16_optimizer_checkpoint(path):
        return _sliced_fp32(path)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    return {k: v.float().contiguous() for k, v in state.items()}


def _mp_ranks(path: Path, kind: str) -> list[int]:
    """The `mp_rank_XX` numbers the checkpoint has files for, in order: tp ranks, or pipeline stages."""
    ranks = sorted(
        {int(m.group(1)) for p in path.glob("*.pt") if (m := re.search(r"mp_rank_(\d+)_", p.name))}
    )
    if not ranks or ranks != list(range(len(ranks))):
        raise CheckpointError(f"{path}: files for {kind} {ranks}, expected 0, 1, ... N-1")
    return ranks


def _tp_rank_view(path: Path, t: int, tp: int, stages_count: int, tmp: Path) -> Path:
    """A directory of links to tp rank `t`'s files, renamed as a checkpoint without tp has them: to
    zero_to_fp32 and the readers here it is a plain data-parallel checkpoint (or pipeline) of that
    rank's slices. Model-parallel rank s * tp + t becomes mp rank s (DeepSpeed numbers a replica's ranks
    stage by stage, tp innermost; one stage without a pipeline), and a pipeline's layer files lose the
    model axis (`layer_NN-model_TT-` -> `layer_NN-`)."""
    view = tmp / f"tp{t}" / path.name
    view.mkdir(parents=True)
    for file in path.glob(f"layer_*-model_{t:02d}-model_states.pt"):
        (view / file.name.replace(f"-model_{t:02d}-", "-")).symlink_to(file.resolve())
    for stage in range(stages_count):
        mp_rank = stage * tp + t
        for file in path.glob(f"*mp_rank_{mp_rank:02d}_*.pt"):
            renamed = file.name.replace(f"mp_rank_{mp_rank:02d}_", f"mp_rank_{stage:02d}_")
            (view / renamed).symlink_to(file.resolve())
    return view


def _merge_tp_slices(
    path: Path, slices: list[dict[str, torch.Tensor]], kv_replicas: int = 1
) -> dict[str, torch.Tensor]:
    """Each parameter rebuilt from its per-tp-rank slices, concatenated in tp-rank order along the dim
    planning.partition splits it (the table the model was sharded by). A parameter every rank holds
    whole must be equal on every rank, and so must the `kv_replicas` consecutive copies of a replicated
    key/value head (one copy is kept), or the checkpoint is refused."""
    out: dict[str, torch.Tensor] = {}
    for name, first in slices[0].items():
        parts = [first, *(state[name] for state in slices[1:])]
        dim = tp_split_dim(name)
        if dim is not None and kv_replicas > 1 and is_kv_projection(name):
            copies = [parts[i : i + kv_replicas] for i in range(0, len(parts), kv_replicas)]
            if not all(torch.equal(group[0], part) for group in copies for part in group[1:]):
                raise CheckpointError(
                    f"{path}: the copies of a key/value head in {name} differ between tp ranks"
                )
            parts = [group[0] for group in copies]
        if dim is not None:
            out[name] = torch.cat(parts, dim)
        elif all(torch.equal(first, part) for part in parts[1:]):
            out[name] = first
        else:
            raise CheckpointError(f"{path}: {name} is whole on every tp rank, yet differs between ranks")
    return out


def _optim_files(path: Path, mp_rank: int = 0) -> list[Path]:
    """The optimizer shards of one mp rank (tp rank or pipeline stage), in data-parallel rank order;
    BF16_Optimizer's are named `bf16_zero_pp_rank_...`, ZeRO's `zero_pp_rank_...`."""

    def rank_of(p: Path) -> int:
        return int(re.search(r"zero_pp_rank_(\d+)_", p.name).group(1))  # type: ignore[union-attr]

    return sorted(path.glob(f"*zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"), key=rank_of)


def _is_bf16_optimizer_checkpoint(path: Path) -> bool:
    """ZeRO-1 with bf16 weights and fp32 accumulation uses DeepSpeed's BF16_Optimizer, whose shards
    carry no `zero_stage`: zero_to_fp32 0.19.8 rejects them ("is not a zero checkpoint")."""
    sd = torch.load(_optim_files(path)[0], map_location="cpu", weights_only=True, mmap=True)
    return "zero_stage" not in sd["optimizer_state_dict"]


def _sliced_fp32(path: Path) -> dict[str, torch.Tensor]:
    """Reassemble each parameter from the per-rank fp32 partitions via their `param_slice_mappings`
    (name -> fragment_address(start, numel) in that rank's flat group), as ds_to_universal does."""
    pieces = _fp32_fragments(_optim_files(path))
    model = torch.load(_single_model_file(path), map_location="cpu", weights_only=True)
    shapes = {name: shape for group in model["param_shapes"] for name, shape in group.items()}
    out = {name: v.float().clone() for name, v in model["module"].items()}  # buffers, untrained params
    for name, parts in pieces.items():
        out[name] = torch.cat(parts).view(shapes[name]).clone()
    for alias, source in (model.get("shared_params") or {}).items():
        out[alias] = out[source]
    return out


def _fp32_fragments(files: list[Path]) -> dict[str, list[torch.Tensor]]:
    """Each parameter's pieces of fp32 master, in the order of `files` (data-parallel ranks): ZeRO-1
    and BF16_Optimizer shards both save the flat partitions and `param_slice_mappings`."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for file in files:
        osd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)["optimizer_state_dict"]
        flats = osd["single_partition_of_fp32_groups"]
        for group, mapping in enumerate(osd["param_slice_mappings"]):
            for name, frag in mapping.items():
                pieces.setdefault(name, []).append(flats[group].narrow(0, frag.start, frag.numel))
    return pieces


def _single_model_file(path: Path) -> Path:
    files = sorted(path.glob("mp_rank_*_model_states.pt"))
    if len(files) != 1:
        raise CheckpointError(f"{path}: expected one mp_rank_*_model_states.pt, found {len(files)}")
    return files[0]


def _unpartitioned_fp32(path: Path) -> dict[str, torch.Tensor]:
    """Stage 0: the module state; in bf16 the fp32 master copy from the optimizer when it maps one-to-one."""
    sd = torch.load(_single_model_file(path), map_location="cpu", weights_only=True)
    module = {k: v for k, v in sd["module"].items() if k not in set(sd.get("buffer_names") or [])}
    master = _fp32_master(sd, module)
    out = {k: v.float() for k, v in sd["module"].items()}
    out.update(master)
    return out


def _fp32_master(sd: dict[str, Any], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 master copy a stage-0 bf16/fp16 optimizer keeps, by name; {} when it does not map.

    DeepSpeed keeps it per parameter (`fp32_groups`, unfused optimizer) or as one flat tensor per group
    (`fp32_groups_flat`), in model.parameters() order: the module state's order, shared ones once.
    """
    optim = sd.get("optimizer")
    if not isinstance(optim, dict):
        return {}
    if optim.get("fp32_groups"):
        masters = [t for group in optim["fp32_groups"] for t in group]
    elif optim.get("fp32_groups_flat") and len(optim["fp32_groups_flat"]) == 1:
        masters = _split_flat(optim["fp32_groups_flat"][0], list(params.values()))
    else:
        return {}
    names = list(params)
    if len(masters) != len(names) or any(
        m.shape != params[n].shape for m, n in zip(masters, names, strict=True)
    ):
        return {}
    return {n: m.float().clone() for n, m in zip(names, masters, strict=True)}


def _split_flat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    if sum(t.numel() for t in like) != flat.numel():
        return []
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


# ---------------------------------------------------------------- pipeline-parallel checkpoints

# PipelineModule saves each layer's state dict (model dtype, the layer's own names) as
# `layer_NN-model_states.pt`; a `-model_XX` suffix would mark tp ranks, which llmtrain refuses with pp.
_LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")
# PipelineModule's parameter names: `<layer index>.<name in the layer>`, or `tied_modules.<key>.<name>`
# for a TiedLayerSpec's module (one per stage that runs any of its layers).
_PIPE_NAME = re.compile(r"(?:(\d+)|tied_modules\.[^.]+)\.(.+)")


_TP_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")


def _is_pipeline_checkpoint(path: Path) -> bool:
    return any(path.glob("layer_*-model_states.pt"))


def _tp_pipeline_fp32(path: Path, partitioned: bool, kv_replicas: int = 1) -> dict[str, torch.Tensor]:
    """A pipeline checkpoint with tensor parallelism inside its stages (layer files named
    `layer_NN-model_TT-`): each tp rank's files seen as a pipeline without tp, consolidated, then the
    slices merged; without tp, the pipeline consolidated as it is."""
    tp_ranks = {int(m.group(2)) for p in path.glob("layer_*") if (m := _TP_LAYER_FILE.fullmatch(p.name))}
    if not tp_ranks:
        return _pipeline_fp32(path, partitioned)
    tp = len(tp_ranks)
    stages_count = len(_mp_ranks(path, "model-parallel ranks")) // tp
    with tempfile.TemporaryDirectory(prefix="llmtrain_tp_pp_") as tmp:
        views = [_tp_rank_view(path, t, tp, stages_count, Path(tmp)) for t in range(tp)]
        return _merge_tp_slices(path, [_pipeline_fp32(view, partitioned) for view in views], kv_replicas)


def _pipeline_fp32(path: Path, partitioned: bool) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a PipelineEngine checkpoint (`mp_rank_XX` = stage XX), by model.py's names.

    Each stage's fp32 masters come from its ZeRO-1 shards. The layer files (memory-mapped, read only
    where needed) check the renaming and give anything the optimizer does not hold (buffers, frozen
    parameters). A tied embedding is on the first and the last stage, copies kept equal by summing
    their gradients: the first stage's is taken, and no `lm_head.weight` is written (DeepSpeed saves
    no layer file for the tied head either; the model re-ties it).
    """
    if not partitioned:
        raise CheckpointError(
            f"{path}: pipeline checkpoint without optimizer shards; llmtrain trains --pp with --zero 1"
        )
    saved, num_blocks = _pipeline_layers(path)
    masters: dict[str, torch.Tensor] = {}
    for stage in _mp_ranks(path, "pipeline stages"):
        for name, tensor in _stage_fp32(path, stage).items():
            masters.setdefault(model_name(name, num_blocks), tensor)
    for name, tensor in masters.items():
        if name not in saved or saved[name].shape != tensor.shape:
            raise CheckpointError(f"{path}: fp32 master {name} {tuple(tensor.shape)} is in no layer file")
    rest = {name: t.to(torch.float32, copy=True) for name, t in saved.items() if name not in masters}
    return {**rest, **masters}


def _pipeline_layers(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Every layer file's tensors by model.py's names (memory-mapped), and the number of blocks."""
    layers = {}
    for file in sorted(path.glob("layer_*-model_states.pt")):
        match = _LAYER_FILE.fullmatch(file.name)
        if match is None:
            raise CheckpointError(f"{file}: not a pipeline layer file (layer_NN-model_states.pt)")
        layers[int(match.group(1))] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    num_blocks = _num_blocks(path, layers)
    saved = {
        model_name(f"{index}.{name}", num_blocks): tensor
        for index, state in layers.items()
        for name, tensor in state.items()
    }
    return saved, num_blocks


def _num_blocks(path: Path, layers: dict[int, dict[str, torch.Tensor]]) -> int:
    """L, from where the final norm sits: layer 0 is the embedding, 1..L the blocks, L+1 the norm
    (NormStage's only parameter is `norm.weight`; a block's norms have longer names)."""
    norms = [index for index, state in layers.items() if "norm.weight" in state]
    if len(norms) != 1:
        raise CheckpointError(f"{path}: expected one layer file holding norm.weight, found {len(norms)}")
    return norms[0] - 1


def model_name(pipe_name: str, num_blocks: int) -> str:
    """PipelineModule's name -> model.py's: `3.self_attn.q_proj.weight` -> `layers.2.self_attn...`.
    A tied module is the embedding stage, whose names are model.py's already."""
    match = _PIPE_NAME.fullmatch(pipe_name)
    if match is None:
        raise CheckpointError(f"pipeline parameter {pipe_name!r}: neither `<layer>.<name>` nor tied")
    index, local = match.groups()
    return local if index is None else stages.layer_prefix(int(index), num_blocks) + local


def _stage_fp32(path: Path, stage: int) -> dict[str, torch.Tensor]:
    """One stage's fp32 masters by PipelineModule's names: every parameter in the stage's
    `param_shapes` (the engine's order) from its fragments in the stage's data-parallel shards."""
    pieces = _fp32_fragments(_optim_files(path, stage))
    model_file = path / f"mp_rank_{stage:02d}_model_states.pt"
    model = torch.load(model_file, map_location="cpu", weights_only=True)
    out = {}
    for name, shape in (item for group in model["param_shapes"] for item in group.items()):
        parts = pieces.pop(name, [])
        if sum(p.numel() for p in parts) != shape.numel():
            raise CheckpointError(f"{model_file}: the optimizer shards hold no full fp32 copy of {name}")
        out[name] = torch.cat(parts).view(shape)
    if pieces:
        raise CheckpointError(f"{model_file}: optimizer fragments of unknown parameters {sorted(pieces)}")
    return out
