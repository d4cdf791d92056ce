"""Writing Hugging Face safetensors files one tensor at a time, and planning which file (and
which rank) gets which tensor.

Why stream: ``safetensors.torch.save_file`` needs every tensor of a file in memory at once, so a
10 GB shard costs 10 GB of host memory. The safetensors format is a JSON header (names, dtypes,
shapes, byte offsets) followed by the raw bytes; when the shapes are known up front the header is
written first and each tensor's bytes are appended as soon as the tensor exists, so an export or
a conversion holds one tensor at a time whatever the file size. (torch DCP's Hugging Face writer,
measured against this export: `hyperacc.weights.export`.)
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import torch

from hyperacc.weights.files import INDEX_FILE, MARK_KEY, SAFETENSORS_DTYPE, SINGLE_FILE


@dataclasses.dataclass
class Entry:
    """One key of the output: its dtype and shape (bytes follow from them)."""

    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for size in self.shape:
            n *= size
        return n


@dataclasses.dataclass
class FilePlan:
    name: str
    rank: int
    entries: List[Entry]


def plan_files(groups: Sequence[List[Entry]], world: int, max_bytes: int, *,
               avoid: Collection[str] = ()) -> List[FilePlan]:
    """Which rank writes which keys into which file. Deterministic: every rank computes the same plan.

    A model of at most ``max_bytes`` is one ``model.safetensors`` written by rank 0, as
    ``save_pretrained`` writes it (readers and the Hub expect no index then). A bigger one is spread
    over the ``world`` ranks by bytes (greedy, in order, so every rank writes at the same time),
    each rank's list cut into files of at most ``max_bytes``, with an index. ``groups`` (the keys of
    one model tensor each) stay together. ``avoid``: shard names in use by the export being
    replaced; when a standard name is among them every shard takes the alternate name (see
    `shard_names`), so no file an old index points to is ever written over."""
    total_bytes = sum(e.nbytes for group in groups for e in group)
    if total_bytes <= max_bytes:
        return [FilePlan(SINGLE_FILE, 0, [e for group in groups for e in group])]
    loads, owned = [0] * world, [[] for _ in range(world)]
    for group in groups:
        rank = min(range(world), key=lambda r: (loads[r], r))
        owned[rank].append(group)
        loads[rank] += sum(e.nbytes for e in group)
    raw = []
    for rank in range(world):
        current, size = [], 0
        for group in owned[rank]:
            nbytes = sum(e.nbytes for e in group)
            if current and size + nbytes > max_bytes:
                raw.append((rank, current))
                current, size = [], 0
            current.extend(group)
            size += nbytes
        if current:
            raw.append((rank, current))
    if len(raw) == 1:           # one tensor bigger than max_bytes: still one file, as transformers does
        return [FilePlan(SINGLE_FILE, raw[0][0], raw[0][1])]
    names = shard_names(len(raw), avoid)
    return [FilePlan(name, rank, entries) for name, (rank, entries) in zip(names, raw)]


def shard_names(count: int, avoid: Collection[str] = ()) -> List[str]:
    """``model-0000k-of-0000n.safetensors`` (transformers' names), or, when one of those is in
    ``avoid``, ``model-0000k-of-0000n-b.safetensors``. Saving the same model into the same directory
    again thus alternates between the two sets: the new shards never replace a file that the
    current index (or a reader that has just read it) still points to."""
    standard = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    if not set(standard) & set(avoid):
        return standard
    return [name.replace(".safetensors", "-b.safetensors") for name in standard]


def write_index(directory: str, files: List[FilePlan], *, mark: Optional[str] = None) -> None:
    """``model.safetensors.index.json`` (only when there are several files, as transformers does).
    ``mark``: hyperacc's export mark, kept in the index metadata (`hyperacc.weights.publish`)."""
    if len(files) == 1:
        return
    weight_map = {e.key: f.name for f in files for e in f.entries}
    metadata = {"total_size": sum(e.nbytes for f in files for e in f.entries)}
    if mark is not None:
        metadata[MARK_KEY] = mark
    with open(os.path.join(directory, INDEX_FILE), "w") as handle:
        json.dump({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}, handle, indent=2)


class StreamingFile:
    """A safetensors file whose header is written first; `write` appends tensors in plan order."""

    def __init__(self, path: str, entries: List[Entry], mark: Optional[str] = None):
        header, offset = {"__metadata__": {"format": "pt", **({MARK_KEY: mark} if mark else {})}}, 0
        for entry in entries:
            if entry.dtype not in SAFETENSORS_DTYPE:
                raise ValueError(f"key {entry.key!r}: dtype {entry.dtype} cannot be stored in safetensors.")
            header[entry.key] = {"dtype": SAFETENSORS_DTYPE[entry.dtype], "shape": list(entry.shape),
                                 "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
        data = json.dumps(header, separators=(",", ":")).encode()
        data += b" " * (-len(data) % 8)          # the format aligns the byte buffer to 8
        self._pending = list(entries)
        self._handle = open(path, "wb")
        self._handle.write(len(data).to_bytes(8, "little") + data)
        self.path = path

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected = self._pending.pop(0)
        if expected.key != key or tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
            raise RuntimeError(f"{self.path}: got {key} {list(tensor.shape)} {tensor.dtype}, expected "
                               f"{expected.key} {list(expected.shape)} {expected.dtype} (writer out of order).")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(memoryview(flat.numpy()))

    @property
    def done(self) -> bool:
        return not self._pending

    def close(self) -> None:
        if self._pending:
            self._handle.close()
            raise RuntimeError(f"{self.path}: {len(self._pending)} tensor(s) never written (first: "
                               f"{self._pending[0].key}).")
        self._handle.close()


class RankWriter:
    """This rank's files of a plan: `write(key, tensor)` opens each file at its first key and
    closes it after its last. ``mark``: hyperacc's export mark, kept in each file's header metadata."""

    def __init__(self, directory: str, files: List[FilePlan], rank: int, *, mark: Optional[str] = None):
        self.directory = directory
        self._mark = mark
        self._file_of: Dict[str, FilePlan] = {e.key: f for f in files if f.rank == rank for e in f.entries}
        self._open: Dict[str, StreamingFile] = {}

    def owns(self, key: str) -> bool:
        return key in self._file_of

    def write(self, key: str, tensor: torch.Tensor) -> None:
        plan = self._file_of[key]
        stream = self._open.get(plan.name)
        if stream is None:
            stream = self._open[plan.name] = StreamingFile(os.path.join(self.directory, plan.name), plan.entries,
                                                          self._mark)
        stream.write(key, tensor)
        if stream.done:
            stream.close()
            del self._open[plan.name]

    def close(self) -> None:
        for stream in list(self._open.values()):
            stream.close()
        self._open.clear()
