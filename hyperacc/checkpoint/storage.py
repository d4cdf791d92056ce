"""Reading and writing checkpoint files: DCP payloads, per-rank extra state, the sentinel file.

Nothing here executes code from a checkpoint: DCP's ``.metadata`` is read with a restricted
unpickler that admits only DCP's own metadata classes, non-tensor DCP items and extra state are
read with ``torch.load(weights_only=True)``, and the sentinel is JSON.
"""
from __future__ import annotations

import copy
import io
import json
import os
import pickle
import warnings
from contextlib import contextmanager
from concurrent.futures import Future
from typing import Iterable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from hyperacc.checkpoint import _comm, containment, integrity
from hyperacc.errors import UnsafeCheckpointError  # noqa: F401 - defined with every error class

SENTINEL_FILE = "hyperacc_checkpoint.json"
# The sentinel's flag for "trainable tensors only, the frozen base is not in this checkpoint" (a model kind's
# `saves_trainable_only`). Its name is the on-disk format's since the first adapter runs: kept as it is.
TRAINABLE_ONLY_KEY = "peft"
EXTRA_STATE_DIR = "extra_state"
EMBEDDED_EXTRA_KEY = "hyperacc_extra_state"
FORMAT_VERSION = 2   # 2: a manifest of file digests is written (unless integrity is off)


def extra_state_path(path: str, rank: int) -> str:
    return os.path.join(path, EXTRA_STATE_DIR, f"extra_state_rank_{rank}.pt")


# --------------------------------------------------------------------------- safe deserialisation


def load_weights_only(source, what: str):
    """``torch.load(weights_only=True)`` with a clear error when the file holds arbitrary objects."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"Refusing to load {what}: it holds objects other than tensors and plain Python values, "
            f"and checkpoints are never unpickled with code execution ({err}).") from None


def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_to_obj(tensor: torch.Tensor, what: str):
    return load_weights_only(io.BytesIO(tensor.numpy().tobytes()), what)


def atomic_save(obj, path: str) -> dict:
    """``torch.save`` all or nothing, never through a link; returns the bytes' digest."""
    data = dumps(obj)
    containment.atomic_write(path, data, fsync=False)
    return integrity.digest_bytes(data)


_ALLOWED_BUILTINS = {"set", "frozenset", "slice", "object", "complex", "bytearray"}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch.Size and dtypes, and inert containers only."""

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if (module, name) in (("collections", "OrderedDict"), ("copyreg", "__newobj__"),
                              ("copyreg", "_reconstructor"), ("torch.serialization", "_get_layout"),
                              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")):
            return super().find_class(module, name)
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"DCP metadata references {module}.{name}, which a checkpoint's "
                                    "metadata never needs; refusing to load it.")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is read with a restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        # FileSystemReader has no public accessor for its .metadata path (per-rank names included);
        path = self._get_metadata_path(kwargs.get("rank"))  # private: read_metadata's own helper, see above
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_dcp_metadata(path: str):
    return SafeFileSystemReader(path).read_metadata()


# --------------------------------------------------------------------------- load planner
class CheckpointLoadPlanner(DefaultLoadPlanner):
    """Strict on model keys, lenient on everything else, never unpickles with code execution.

    ``strict_prefixes``: flattened-key prefixes (``"model."``) whose every key must be present in
    the checkpoint; other keys (optimizer state) missing from the checkpoint are left as they are.
    """

    def __init__(self, strict_prefixes: Iterable[str] = ()):
        super().__init__(allow_partial_load=True)
        self.strict_prefixes = tuple(strict_prefixes)

    def create_local_plan(self):
        available = self.metadata.state_dict_metadata
        missing = [key for key in self.state_dict
                   if key.startswith(self.strict_prefixes) and key not in available]
        if missing:
            raise RuntimeError(f"missing model key(s) in checkpoint: {missing[:8]}"
                               f"{' ...' if len(missing) > 8 else ''}")
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_weights_only(value, f"checkpoint item {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            # DCP has no public setter for a flattened key; DefaultLoadPlanner.load_bytes uses this one.
            from torch.distributed.checkpoint._traverse import set_element  # private: no public equivalent
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# --------------------------------------------------------------------------- DCP save / load
@contextmanager
def _single_process_quiet():
    """DCP warns on every single-process call; one process without a process group is supported."""
    if _comm.distributed():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_save(state_dict: dict, path: str, *, process_group=None, storage_writer=None) -> None:
    with _single_process_quiet():
        dcp.save(state_dict, checkpoint_id=path, storage_writer=storage_writer, process_group=process_group,
                 no_dist=not _comm.distributed())


class ReusableCpuStager(AsyncStager):
    """Stages a state dict into CPU buffers that are kept and reused by the next save.

    The first save deep-copies (DCP's own staging); later saves with the same structure copy into
    the same buffers, which avoids allocating (and page-faulting) the whole payload every time.
    Reuse is safe because a new save starts only after the previous one was written.
    """

    _synchronize_after_execute = False

    def __init__(self):
        self._cache = None

    def stage(self, state_dict, **kwargs):
        if self._cache is not None:
            try:
                return _copy_into(state_dict, self._cache)
            except _StructureChanged:
                self._cache = None
        options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=False)
        self._cache = DefaultStager(options).stage(state_dict)
        return self._cache

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._cache = None


class _StructureChanged(Exception):
    pass


_IMMUTABLE = (int, float, str, bytes, bool, type(None), torch.dtype, torch.device)


@torch.no_grad()
def _copy_into(src, dst):
    """A state dict shaped like ``src`` whose tensors are ``dst``'s buffers holding ``src``'s values."""
    from torch.distributed.tensor import DTensor

    if isinstance(src, DTensor):
        if not isinstance(dst, DTensor) or dst.shape != src.shape or dst.placements != src.placements:
            raise _StructureChanged
        local, target = src.to_local(), dst.to_local()
        if local.shape != target.shape or local.dtype != target.dtype:
            raise _StructureChanged
        target.copy_(local)
        return dst
    if isinstance(src, torch.Tensor):
        if type(dst) is not torch.Tensor or dst.shape != src.shape or dst.dtype != src.dtype:
            raise _StructureChanged
        dst.copy_(src)
        return dst
    if isinstance(src, dict):
        if not isinstance(dst, dict) or dst.keys() != src.keys():
            raise _StructureChanged
        return {key: _copy_into(value, dst[key]) for key, value in src.items()}
    if isinstance(src, (list, tuple)):
        if not isinstance(dst, (list, tuple)) or len(dst) != len(src):
            raise _StructureChanged
        return type(src)(_copy_into(a, b) for a, b in zip(src, dst))
    return src if isinstance(src, _IMMUTABLE) else copy.deepcopy(src)


def dcp_async_save(state_dict: dict, path: str, *, process_group=None, stager=None, storage_writer=None) -> Future:
    """Stage ``state_dict`` to CPU memory (a copy: the caller may mutate its tensors as soon as this
    returns) and write it in a background thread. Returns the upload future."""
    with _single_process_quiet():
        result = dcp.async_save(state_dict, checkpoint_id=path, storage_writer=storage_writer,
                                process_group=process_group, async_stager=stager,
                                no_dist=not _comm.distributed())
    return getattr(result, "upload_completion", result)


def dcp_load(state_dict: dict, path: str, *, strict_prefixes=(), process_group=None, no_dist=None) -> None:
    """DCP load; a failure is one line naming the checkpoint (DCP's own error is per rank and
    dozens of lines long; it stays attached as the cause)."""
    no_dist = not _comm.distributed() if no_dist is None else no_dist
    try:
        with _single_process_quiet():
            dcp.load(state_dict, storage_reader=SafeFileSystemReader(path),
                     planner=CheckpointLoadPlanner(strict_prefixes), process_group=process_group,
                     no_dist=no_dist)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - summarised below, chained for debugging
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        first = next((line for line in lines if "Error" in line and "Traceback" not in line),
                     lines[0] if lines else "")
        raise RuntimeError(f"could not read checkpoint {path}: {type(err).__name__}: {first[:300]} "
                           "(a damaged or incomplete checkpoint; load another one).") from err


# --------------------------------------------------------------------------- sentinel
def write_sentinel(path: str, info: dict) -> dict:
    """Write the JSON description of the checkpoint; returns its digest (for the manifest)."""
    os.makedirs(path, exist_ok=True)
    data = json.dumps({"format_version": FORMAT_VERSION, **info}, indent=1, sort_keys=True).encode()
    containment.atomic_write(os.path.join(path, SENTINEL_FILE), data, fsync=False)
    return integrity.digest_bytes(data)


def read_sentinel(path: str) -> Optional[dict]:
    file = os.path.join(path, SENTINEL_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as handle:
        return json.load(handle)
