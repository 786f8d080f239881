"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), read safely.

A sharded checkpoint is a directory `<name>.ckpt/` holding DCP's shard files and `.metadata` for the
models and optimizers (every rank writes its own shards, in parallel, nothing is gathered), plus
`trainer_state.pt` with everything else (counters, RNG of every rank, data position, schedulers,
callbacks), written by rank zero with `torch.save`. DCP reshards on load, so a checkpoint written by
N ranks loads on M ranks, with FSDP or DDP or on one process.

DCP reads its `.metadata` with plain `pickle.load` and non-tensor items with
`torch.load(weights_only=False)`: either would run code hidden in a hostile file. `SafeReader` and
`SafeLoadPlanner` replace both: metadata may only contain DCP's own metadata dataclasses, torch
dtypes/sizes and plain containers; items are loaded with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.checkpoint_io import TRAINER_STATE

_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.storage",
)
_BUILTINS = frozenset({"set", "frozenset", "slice", "tuple", "list", "dict", "complex", "bytearray"})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES:
            obj = super().find_class(module, name)
            # Only data classes (constructing one just stores its fields), never functions.
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif (
            (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in _BUILTINS)
            or (module == "torch.serialization" and name == "_get_layout")  # a lookup by name, as weights_only
            or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata unpickling is restricted to plain DCP metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = Path(self._get_metadata_path(rank))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"refused to load {str(path)!r}: {exc}") from exc
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_sharded(tensors: dict[str, Any], trainer_state: dict[str, Any], path: Path, is_writer: bool) -> None:
    """Write a sharded checkpoint: every rank calls it (DCP is collective); rank zero (`is_writer`)
    writes `trainer_state.pt` and moves the finished directory into place."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dream_trainer.utils.checkpoint_io import atomic_save

    tmp = path.with_name(f".{path.name}.tmp")  # the same name on every rank
    if is_writer and tmp.exists():
        shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(tensors, checkpoint_id=str(tmp))
    if is_writer:
        atomic_save(trainer_state, tmp / TRAINER_STATE)
        old = path.with_name(f".{path.name}.old")
        if path.exists():  # a directory cannot be replaced in one rename: move the old one aside first
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()


def load_sharded_tensors(tensors: dict[str, Any], path: Path) -> None:
    """Fill `tensors` (the live, possibly sharded state dicts) in place from a sharded checkpoint."""
    import torch.distributed.checkpoint as dcp

    # Read the metadata once up front: DCP would swallow a refusal and retry with other files.
    SafeReader(str(path)).read_metadata()
    with warnings.catch_warnings():
        # Loading a sharded checkpoint into one process is intended here (resharding N -> 1).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(tensors, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())


def load_sharded_model_weights(models: dict[str, torch.nn.Module], path: Path, strict: bool) -> None:
    """Load the models' weights of the sharded checkpoint at `path` into `models` (by name), nothing else:
    DCP reads only the entries asked for, so no optimizer state is read."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from dream_trainer.utils.modules import unwrap

    live = {"models": {n: get_model_state_dict(unwrap(m)) for n, m in models.items()}}
    try:
        load_sharded_tensors(live, path)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot load the models of sharded checkpoint {str(path)!r}: {exc}") from exc
    for name, model in models.items():
        set_model_state_dict(unwrap(model), live["models"][name], options=StateDictOptions(strict=strict))
