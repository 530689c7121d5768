"""FSDP2's checkpoint format: PyTorch distributed checkpoints (torch.distributed.checkpoint, DCP).

Every rank writes its shards of the model and optimizer states into the staging dir
(`__<rank>_0.distcp`), the coordinator writes `.metadata`; loading reshards by itself, so a run saved
on N processes loads on M with no conversion. llmtrain's commit protocol wraps it like DeepSpeed's
files. Loading runs no pickled code: DCP's `.metadata` is a plain pickle, read here with an unpickler
that admits only DCP's metadata records; its byte items (the optimizer's hyper-parameters) and tensors
load weights-only.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint.common import CheckpointError
from llmtrain.checkpoint.safeload import weights_only_loads

METADATA = ".metadata"

# What DCP 2.13's `.metadata` pickle names (found by saving FSDP2 models and their AdamW states and
# listing the pickle's globals): its own metadata records, torch.Size, a dtype, a layout by name, and
# the checkpoint id as a path. Each is inert data.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module == "torch" else None
        if (module, name) in _METADATA_GLOBALS or isinstance(found, torch.dtype):
            return found if found is not None else super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _reader(path: Path) -> Any:
    """A FileSystemReader whose metadata comes through the allow-listed unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata_path = Path(self.path) / METADATA
            try:
                metadata = _MetadataUnpickler(io.BytesIO(metadata_path.read_bytes())).load()
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"{metadata_path}: refusing to load, it holds objects DCP metadata does not: {exc}"
                ) from None
            except (OSError, EOFError, ValueError) as exc:
                raise CheckpointError(f"{metadata_path}: unreadable ({type(exc).__name__}: {exc})") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def write(state: dict[str, Any], directory: Path) -> tuple[list[str], list[Path]]:
    """Save `state` (every rank's shards) into `directory`, a collective: (errors, files written).

    DCP gathers every rank's write result and raises the same CheckpointException on all of them
    (catching it keeps the ranks on one sequence of collectives); each rank reports only its own
    failure, so the commit's message names the rank that failed once. DCP's writer fsyncs each file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        directory.mkdir(parents=True, exist_ok=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))
    except CheckpointException as exc:
        own = exc.failures.get(dist.get_rank())
        return ([_describe(directory, own[0] if isinstance(own, tuple) else own)] if own else []), []
    except Exception as exc:
        return [_describe(directory, exc)], []
    return [], []


def read(state: dict[str, Any], directory: Path) -> None:
    """Load a checkpoint into `state` in place (resharded to the tensors' layout), a collective."""
    import torch.distributed.checkpoint as dcp

    if not (directory / METADATA).is_file():
        raise CheckpointError(f"{directory}: no {METADATA}; not a distributed (FSDP2) checkpoint")
    # Checked here, on every rank, before the collective load: inside it DCP would wrap the refusal
    # in an exception of its own.
    _reader(directory).read_metadata()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with weights_only_loads():
            dcp.load(state, storage_reader=_reader(directory))
    except CheckpointException as exc:  # the same on every rank: each raises it as one line
        rank, failure = next(iter(exc.failures.items()))
        failed = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(f"rank {rank}: {_describe(directory, failed)}") from None


def is_dcp_checkpoint(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def full_tensors(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor saved under `prefix` (e.g. "model."), whole, in this one process (no process
    group): for export, generate and eval. Names lose the prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(directory)
    metadata = reader.read_metadata()
    flat = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not flat:
        raise CheckpointError(f"{directory}: the distributed checkpoint holds no tensors under {prefix!r}")
    with weights_only_loads(), warnings.catch_warnings():
        # One process by design: DCP's "assuming the intent is to load in a single process" is noise.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(flat, storage_reader=_reader(directory), no_dist=True)
    return {name.removeprefix(prefix): tensor for name, tensor in flat.items()}


def _describe(directory: Path, exc: BaseException) -> str:
    """`path: OSError: [Errno 27] File too large`, naming the file where the error does."""
    where = getattr(exc, "filename", None) or directory
    text = (getattr(exc, "strerror", None) or str(exc)).strip()
    first = text.splitlines()[0] if text else ""
    return f"{where}: {type(exc).__name__}: {first}" if first else f"{where}: {type(exc).__name__}"
