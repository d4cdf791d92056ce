"""The safetensors files of a Hugging Face model directory: where they are and what they hold.

Why a table first: a sharded load must know every key's shape and dtype before it reads a byte, so
that a missing file, a missing key, a wrong shape or a damaged (truncated) file is one clear error,
raised on every rank alike before any rank has copied anything. safetensors' own parser reads the
headers (`safe_open`: keys, dtypes, shapes, ``__metadata__``) and checks that each file is whole;
a key's byte offset follows from the format (the tensors cover the byte buffer without holes, in
``offset_keys`` order, up to the end of the file).

Why the reads stay ours -- ``os.preadv`` of the rows a rank owns straight into its shard -- and not
``safe_open(...).get_slice(key)[rows]``: 2 ranks loading a 1.0 GB fp32 Qwen3 (254 M parameters, a
485 MiB FSDP2 shard each, page cache warm; `benchmarks/libraries_weights.py`, issue 39): preadv
+0-2 MiB peak RSS above the shards; `get_slice` on safetensors' default mmap backend 1.1-1.3x the
time and +565-610 MiB (the file pages a rank touches stay mapped in its RSS: peak 2.2x the rank's
weight memory); on its ``backend="pread"`` 3.9-5.7x the time and +200-211 MiB (each slice is a
tensor of its own, copied once more into the shard). The table through `safe_open` costs 1.2-3.7x
the hand-written JSON parse it replaced, 0.05-0.6 ms more per file against a load of 0.15-0.5 s:
kept for the check that a file is whole (a truncated shard fails before any rank reads).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open

from hyperacc.errors import WeightsError  # noqa: F401 - defined with every error class

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MARK_KEY = "hyperacc_export"        # header / index metadata key: which hyperacc export wrote the file

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
SAFETENSORS_DTYPE = {dtype: name for name, dtype in _DTYPES.items()}


def resolve_model_dir(path_or_id: str) -> str:
    """A local directory for ``path_or_id``: the directory itself, or the snapshot of a hub id that
    is already in the local Hugging Face cache (``HF_HUB_CACHE``). Nothing is downloaded."""
    if os.path.isdir(path_or_id):
        return os.path.abspath(path_or_id)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(path_or_id, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError) as err:
        raise WeightsError(f"{path_or_id!r} is neither a local directory nor a model in the local Hugging Face "
                           f"cache ({type(err).__name__}); download it first (huggingface-cli download "
                           f"{path_or_id}) or pass the directory that holds its config.json and *.safetensors."
                           ) from None


def has_safetensors(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, INDEX_FILE)) or os.path.isfile(os.path.join(directory, SINGLE_FILE))


class WeightFiles:
    """Key -> (file, dtype, shape) of a model directory's safetensors, and slice reads."""

    def __init__(self, directory: str):
        self.directory = directory
        self.entries: Dict[str, Tuple[str, torch.dtype, Tuple[int, ...]]] = {}
        self._offsets: Dict[str, int] = {}
        self._fds: Dict[str, int] = {}
        index = os.path.join(directory, INDEX_FILE)
        if os.path.isfile(os.path.join(directory, SINGLE_FILE)):     # first, as from_pretrained reads them
            weight_map, files = None, [SINGLE_FILE]
        elif os.path.isfile(index):
            with open(index) as handle:
                try:
                    weight_map = json.load(handle)["weight_map"]
                except (ValueError, KeyError) as err:
                    raise WeightsError(f"{index} is not a safetensors index ({err}); re-export the model.") from None
            files = sorted(set(weight_map.values()))
        else:
            raise WeightsError(f"{directory} holds no {SINGLE_FILE} or {INDEX_FILE} (hyperacc loads safetensors "
                               "weights only; convert *.bin weights with transformers' save_pretrained).")
        for name in files:
            file = os.path.join(directory, name)
            if not os.path.isfile(file):
                raise WeightsError(f"shard file {name} listed in {INDEX_FILE} is missing from {directory}; "
                                   "copy the complete model directory.")
            for key, (dtype, shape, offset) in _header(file).items():
                self.entries[key] = (name, dtype, shape)
                self._offsets[key] = offset
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.entries.get(key, (name,))[0] != name:
                    raise WeightsError(f"{INDEX_FILE} in {directory} puts key {key!r} in {name}, but that file "
                                       "does not hold it; the index does not match the shard files.")

    def shape(self, key: str) -> Optional[Tuple[int, ...]]:
        entry = self.entries.get(key)
        return None if entry is None else entry[2]

    def read(self, key: str, index) -> torch.Tensor:
        """``key[index]`` (a tuple of slices, one per dim). Reads only the rows ``index`` spans."""
        rows, rest = self._rows(key, index)
        return rows[(slice(None),) + rest]

    def read_into(self, key: str, index, dest: torch.Tensor) -> bool:
        """Read ``key[index]`` straight into ``dest`` when it is one contiguous byte range of the
        file and ``dest`` is contiguous and of the same dtype; False (nothing read) otherwise."""
        name, dtype, shape = self.entries[key]
        a, b, rest = _row_range(shape, index)
        if dtype != dest.dtype or not dest.is_contiguous() or any(
                (s.start, s.stop) != (0, n) for s, n in zip(rest, shape[1:])) or dest.numel() != (b - a) * _numel(shape[1:]):
            return False
        self._pread(name, self._offsets[key] + a * _numel(shape[1:]) * dest.element_size(), dest)
        return True

    def _rows(self, key, index):
        name, dtype, shape = self.entries[key]
        a, b, rest = _row_range(shape, index)
        rows = torch.empty((b - a,) + tuple(shape[1:]), dtype=dtype)
        self._pread(name, self._offsets[key] + a * _numel(shape[1:]) * rows.element_size(), rows)
        return rows, rest

    def _pread(self, name: str, offset: int, dest: torch.Tensor) -> None:
        """Fill contiguous ``dest`` with the file's bytes from ``offset`` (os.preadv: no extra copy,
        no mapping that would keep the file's pages in this process's RSS)."""
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(os.path.join(self.directory, name), os.O_RDONLY)
        view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise WeightsError(f"{os.path.join(self.directory, name)} ends early (truncated download or copy).")
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _row_range(shape, index):
    """(first row, end row, slices of the other dims) of ``index`` over a tensor of ``shape``."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if not shape:
        return 0, 1, ()
    first = index[0].indices(shape[0])
    rest = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index[1:], shape[1:]))
    return first[0], first[1], rest


def header_metadata(file: str) -> Optional[Dict[str, str]]:
    """The ``__metadata__`` of a safetensors file (None when it has none, or the file is missing,
    damaged or truncated): reading it costs the header only, whatever the file's size."""
    try:
        with safe_open(file, framework="pt") as handle:
            meta = handle.metadata()
    except (SafetensorError, OSError):
        return None
    return meta if isinstance(meta, dict) else None


def _header(file: str) -> Dict[str, Tuple[torch.dtype, Tuple[int, ...], int]]:
    """The tensors of one safetensors file: key -> (dtype, shape, absolute byte offset of its data).
    safetensors checks the header and that the file is whole; the offsets follow from the format."""
    try:
        with safe_open(file, framework="pt") as handle:
            infos = [(key, handle.get_slice(key)) for key in handle.offset_keys()]
            infos = [(key, info.get_dtype(), tuple(info.get_shape())) for key, info in infos]
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{file} is not a readable safetensors file ({err}); the download or copy is damaged "
                           "or incomplete: copy or download it again.") from None
    sizes = []
    for key, dtype, shape in infos:
        if dtype not in _DTYPES:
            raise WeightsError(f"{file}: key {key!r} has dtype {dtype}, which hyperacc does not load.")
        sizes.append(_numel(shape) * _DTYPES[dtype].itemsize)
    offset = os.path.getsize(file) - sum(sizes)          # the byte buffer ends where the file ends
    out = {}
    for (key, dtype, shape), size in zip(infos, sizes):
        out[key] = (_DTYPES[dtype], shape, offset)
        offset += size
    return out
