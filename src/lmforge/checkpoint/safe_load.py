"""Reading checkpoints from paths a user names without running code from them: DCP's reader and load planner
with restricted unpicklers for the metadata and the non-tensor entries."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from lmforge.checkpoint.layout import CheckpointError

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}  # fmt: skip
"""The globals a DCP `.metadata` file refers to (its dataclasses, torch sizes, dtypes and layouts, paths)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what a checkpoint's `.metadata` holds: DCP's plain data classes and the values inside them. A
    file that names anything else (a function to call, another module to import) is refused before it runs."""

    def find_class(self, module: str, name: str) -> Any:
        """The global `module.name` when a checkpoint's metadata may refer to it, else UnpicklingError."""
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeCheckpointReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata read by `_MetadataUnpickler` instead of `pickle.load`, for
    checkpoints from a path the user names (`--resume.path`, export, sample, eval)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's metadata, refusing a file that would build anything but metadata."""
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"{path}: refused to load the checkpoint's metadata: {err}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with the non-tensor entries (optimizer hyperparameters, names) read by torch's restricted
    unpickler (`weights_only=True`), not the full one."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Place one non-tensor entry, refusing one that holds more than plain values."""
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"refused to load checkpoint entry {read_item.dest_index.fqn}: {err}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
