"""Integrity: a checksum of every file a checkpoint holds, recorded at save, verified at load.

Why: DCP trusts the bytes it reads. A flipped bit in a ``.distcp`` file loads silently as a wrong
weight, and a truncated shard fails deep inside DCP with per-rank tracebacks that name neither
the checkpoint nor the file. So every file is hashed (xxh3-128, several GB/s) while it is written
-- inside DCP's writer, hence in the background thread for async saves, with no second read --
and the digests travel with DCP's own write results to the coordinator, which writes
``hyperacc_manifest.json`` *before* ``.metadata``: a complete checkpoint always has its manifest.

At load every file is re-hashed once, the files split across ranks (each rank hashes
``files[rank::world]``), and the verdicts are all-gathered, so every rank raises the same one-line
error naming the checkpoint directory, the file and what is wrong -- before DCP reads a byte.
"""
from __future__ import annotations

import io
import json
import os
import threading
from contextlib import contextmanager
from typing import Dict, List, Optional

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from hyperacc.checkpoint import _comm, containment
from hyperacc.errors import IntegrityError  # noqa: F401 - defined with every error class

ALGORITHM = "xxh3_128"
MANIFEST_FILE = "hyperacc_manifest.json"
_DIGEST_FQN = "__hyperacc_file_digest__/"   # marks the write results that carry digests, not data
_CHUNK = 8 << 20


def digest_bytes(data) -> dict:
    return {"size": len(data), ALGORITHM: xxhash.xxh3_128_hexdigest(data)}


def digest_file(path: str) -> dict:
    hasher, size = xxhash.xxh3_128(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return {"size": size, ALGORITHM: hasher.hexdigest()}


# --------------------------------------------------------------------------- save side
class _HashingStream(io.RawIOBase):
    """A write-only file that hashes every byte on its way to disk (DCP only writes, tells,
    flushes and fsyncs its streams; it never seeks back)."""

    def __init__(self, handle):
        super().__init__()
        self._handle = handle
        self._hasher = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self.size += len(view)
        return self._handle.write(view)

    def tell(self) -> int:
        return self._handle.tell()

    def fileno(self) -> int:
        return self._handle.fileno()

    def flush(self) -> None:
        if not self._handle.closed:
            self._handle.flush()

    def close(self) -> None:
        if not self.closed:
            self._handle.close()
        super().close()

    def digest(self) -> dict:
        return {"size": self.size, ALGORITHM: self._hasher.hexdigest()}


class _HashingFileSystem(FileSystem):
    """DCP's local file system, except that files opened for writing are created without following
    a symlink planted at their name and are hashed as they are written."""

    def __init__(self, digests: Optional[Dict[str, dict]], lock: threading.Lock):
        super().__init__()
        self._digests = digests
        self._lock = lock

    def create_stream(self, path, mode):
        if "w" not in mode:
            return super().create_stream(path, mode)
        return self._hashed_stream(path)

    def _hashed_stream(self, path):
        @contextmanager
        def stream():
            containment.refuse_foreign(os.fspath(path), "writes")
            handle = containment.open_new_file(os.fspath(path))
            if self._digests is None:   # integrity off: safe creation only
                with handle:
                    yield handle
                return
            raw = _HashingStream(handle)
            try:
                yield raw
            finally:
                raw.close()
                with self._lock:
                    self._digests[os.path.basename(os.fspath(path))] = raw.digest()
        return stream()


class IntegrityWriter(FileSystemWriter):
    """FileSystemWriter that records a digest of each file it writes and writes the manifest.

    ``extra_files``: digests of files this rank wrote itself next to DCP's (extra state, sentinel,
    config), keyed by their path relative to the checkpoint directory. ``manifest=False`` keeps the
    safe file creation but hashes nothing and writes no manifest (integrity switched off).
    """

    def __init__(self, path, *, extra_files: Optional[Dict[str, dict]] = None, manifest: bool = True, **kwargs):
        super().__init__(path, **kwargs)
        self._digests: Dict[str, dict] = {}
        self._digest_lock = threading.Lock()     # DCP may write several files from several threads
        self.fs = _HashingFileSystem(self._digests if manifest else None, self._digest_lock)   # DCP's public attribute
        self._extra = dict(extra_files or {})
        self._manifest = manifest

    def write_data(self, plan, planner) -> Future:
        written = super().write_data(plan, planner)
        results = list(written.value())
        if self._manifest:
            with self._digest_lock:   # every file this rank's DCP writer created, data-bearing or not
                files = {**self._extra, **self._digests}
            results += [WriteResult(index=MetadataIndex(_DIGEST_FQN + name), size_in_bytes=0, storage_data=info)
                        for name, info in files.items()]
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        files, data_results = {}, []
        for rank_results in results:
            data_results.append([r for r in rank_results if not r.index.fqn.startswith(_DIGEST_FQN)])
            files.update({r.index.fqn[len(_DIGEST_FQN):]: r.storage_data for r in rank_results
                          if r.index.fqn.startswith(_DIGEST_FQN)})
        if self._manifest:
            write_manifest(os.fspath(self.path), files)
        super().finish(metadata, data_results)


def write_manifest(path: str, files: Dict[str, dict]) -> None:
    body = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    containment.atomic_write(os.path.join(path, MANIFEST_FILE), json.dumps(body, indent=1))


# --------------------------------------------------------------------------- load side
def read_manifest(path: str) -> Optional[dict]:
    """The manifest's ``files`` map, or None when the checkpoint has none. Raises IntegrityError
    when it exists but cannot be read."""
    file = os.path.join(path, MANIFEST_FILE)
    if not os.path.lexists(file):
        return None
    try:
        with open(file) as handle:
            body = json.load(handle)
        files = body["files"]
        if body.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown algorithm {body.get('algorithm')!r}")
        return files
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise IntegrityError(f"checkpoint {path}: {MANIFEST_FILE} is unreadable ({err}).") from None


def check_file(path: str, name: str, expected: dict) -> Optional[str]:
    """None when ``path/name`` matches ``expected``; else what is wrong, in a few words."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return "missing" if not os.path.lexists(file) else "not a regular file"
    size = os.path.getsize(file)
    if size != expected.get("size"):
        kind = "empty" if size == 0 else ("truncated" if size < expected.get("size", 0) else "longer than saved")
        return f"{kind}: {size} bytes, the manifest says {expected.get('size')}"
    got = digest_file(file)[ALGORITHM]
    if got != expected.get(ALGORITHM):
        return f"contents changed since the save ({ALGORITHM} {got}, the manifest says {expected.get(ALGORITHM)})"
    return None


def check_dcp_references(path: str, metadata, files: Dict[str, dict]) -> Optional[str]:
    """Every data file ``.metadata`` points into must be in the manifest and long enough."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is None:
            continue
        if name not in files:
            return f"file {name}: referenced by .metadata but not listed in {MANIFEST_FILE}"
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        if end > int(files[name].get("size", 0)):
            return f"file {name}: .metadata reads up to byte {end} but the file holds {files[name].get('size')}"
    return None


def verify_collectively(path: str, files: Dict[str, dict], group=None) -> List[str]:
    """Every rank hashes its share of ``files``; returns the problems found (same list on every rank)."""
    names = sorted(files, key=lambda n: (-int(files[n].get("size", 0)), n))   # big first: balanced shares
    mine = names[_comm.rank()::_comm.world_size()]
    problems = []
    for name in mine:
        try:
            what = check_file(path, name, files[name])
        except OSError as err:
            what = f"unreadable ({err.strerror or err})"
        if what:
            problems.append(f"file {name}: {what}")
    return sorted(p for rank_problems in _comm.all_gather(problems, group) for p in rank_problems)
