"""Writing Megatron ``MMIDIDX`` v1 datasets (the layout is described in `hyperacc.data.megatron`),
atomically, and removing the temporary files a killed writer of the same prefix left behind."""
from __future__ import annotations

import os
import re
import socket
import struct
from array import array
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

from hyperacc.data.megatron import MAGIC, VERSION, _DTYPE_TO_CODE, bin_path, idx_path, optimal_dtype

__all__ = ["IndexedDatasetWriter", "remove_stale_temp_files"]


_TMP_TAG = re.compile(r"\.tmp-(?P<pid>\d+)-[0-9a-f]+(?:@(?P<host>.*))?$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(prefix: Union[str, os.PathLike], log=None, *, own: bool = False) -> List[str]:
    """Remove the ``PREFIX.bin.tmp-*`` / ``PREFIX.idx.tmp-*`` files that a killed writer of the
    same prefix left behind; return their paths.

    A temporary file is stale when the process that wrote it (pid and host are in its name) no
    longer runs on this host. Files of a live writer, or written on another host, are kept (the
    latter with a message through ``log``). ``own=True``: this process's own ones too -- for a caller
    whose writing was interrupted (a signal can land between a writer creating its file and anyone
    holding the writer, where its ``abort`` cannot run).
    """
    prefix = os.fspath(prefix)
    directory = os.path.dirname(os.path.abspath(prefix))
    host = socket.gethostname()
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        for final in (os.path.basename(bin_path(prefix)), os.path.basename(idx_path(prefix))):
            if not name.startswith(final + ".tmp-"):
                continue
            match = _TMP_TAG.match(name[len(final):])
            path = os.path.join(directory, name)
            if match is None or os.path.isdir(path) or os.path.islink(path):
                continue
            if match.group("host") not in (None, host):
                if log is not None:
                    log(f"keeping temporary file {path}: it was written on host {match.group('host')!r}")
                continue
            pid = int(match.group("pid"))
            if _pid_alive(pid) and not (own and pid == os.getpid()):
                continue
            os.remove(path)
            removed.append(path)
            if log is not None and pid != os.getpid():
                log(f"removed stale temporary file {path} (its writer, pid {pid}, is gone)")
    return removed


class IndexedDatasetWriter:
    """Write a Megatron ``MMIDIDX`` v1 dataset, atomically.

    Tokens go to temporary files next to the output; :meth:`finalize` (or leaving the ``with``
    block without an exception) writes the index and renames both files to ``PREFIX.bin`` /
    ``PREFIX.idx``. An error or interruption leaves nothing under the final names (the temporary
    files are removed on errors raised in Python).

    ``dtype`` defaults to :func:`optimal_dtype` of ``vocab_size`` (uint16 below 65500, else int32).
    A token id that does not fit the dtype raises :class:`OverflowError`.
    Existing output files are refused unless ``overwrite=True``.
    """

    def __init__(self, prefix: Union[str, os.PathLike], *, vocab_size: Optional[int] = None,
                 dtype=None, overwrite: bool = False):
        self.prefix = os.fspath(prefix)
        if dtype is None:
            dtype = optimal_dtype(vocab_size)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _DTYPE_TO_CODE:
            raise ValueError(f"dtype {self.dtype} cannot be stored in a Megatron index")
        if self.dtype.kind not in "iu":
            raise ValueError(f"token dtype must be an integer type, got {self.dtype}")
        info = np.iinfo(self.dtype)
        self._min, self._max = int(info.min), int(info.max)
        self.vocab_size = vocab_size
        self.idx_path, self.bin_path = idx_path(self.prefix), bin_path(self.prefix)
        if not overwrite:
            for p in (self.bin_path, self.idx_path):
                if os.path.exists(p):
                    raise FileExistsError(f"{p} already exists; refusing to overwrite it (choose another "
                                          f"output prefix, or pass --overwrite / overwrite=True)")
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{id(self):x}@{socket.gethostname()}"  # see remove_stale_temp_files
        self._tmp_bin, self._tmp_idx = self.bin_path + tag, self.idx_path + tag
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = array("q")
        self._docs = array("q", [0])
        self.num_tokens = 0
        self._closed = False

    # -- writing ------------------------------------------------------------------------------
    def _check(self, arr: np.ndarray, where: str) -> np.ndarray:
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._min or hi > self._max:
                bad = hi if hi > self._max else lo
                raise OverflowError(
                    f"token id {bad} in {where} does not fit the index dtype {self.dtype.name} "
                    f"(range {self._min}..{self._max}); the vocabulary size was given as "
                    f"{self.vocab_size}: pass the tokenizer's real vocabulary size (>= 65500 selects "
                    f"int32) or dtype=numpy.int32")
        if arr.dtype.kind == "f":
            raise TypeError(f"tokens in {where} are floating point ({arr.dtype}); expected integers")
        return arr.astype(self.dtype, copy=False)

    def add_item(self, tokens) -> None:
        """Append one sequence to the current document (close it with :meth:`end_document`)."""
        arr = self._check(np.asarray(tokens), f"sequence {len(self._lengths)}")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)
        self.num_tokens += arr.size

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, tokens, lengths: Optional[Sequence[int]] = None) -> None:
        """Append one document: one sequence, or several when ``lengths`` splits ``tokens``."""
        arr = self._check(np.asarray(tokens), f"document {len(self._docs) - 1}")
        if lengths is None:
            lengths = [arr.size]
        elif sum(lengths) != arr.size:
            raise ValueError(f"lengths sum to {sum(lengths)} but the document has {arr.size} tokens")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.extend(int(n) for n in lengths)
        self.num_tokens += arr.size
        self._docs.append(len(self._lengths))

    def add_documents(self, documents: Iterable) -> None:
        for doc in documents:
            self.add_document(doc)

    def add_documents_flat(self, tokens, lengths) -> None:
        """Append many one-sequence documents at once: ``tokens`` concatenated, ``lengths`` each."""
        lengths = np.asarray(lengths, dtype=np.int64)
        arr = self._check(np.asarray(tokens), f"documents {self.num_documents}..{self.num_documents + len(lengths) - 1}")
        if int(lengths.sum()) != arr.size or (lengths.size and lengths.min() < 0):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {arr.size} tokens were given")
        self._bin.write(arr.tobytes(order="C"))
        first = len(self._lengths)
        self._lengths.extend(lengths.tolist())
        self._docs.extend(range(first + 1, first + 1 + lengths.size))
        self.num_tokens += arr.size

    @property
    def num_documents(self) -> int:
        return len(self._docs) - 1

    # -- finishing ----------------------------------------------------------------------------
    def _write_index(self, path: str) -> None:
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if len(self._lengths) else np.zeros(0, np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise OverflowError("a sequence is longer than 2**31-1 tokens; split it with add_item")
        pointers = (np.cumsum(lengths) - lengths) * self.dtype.itemsize
        docs = np.frombuffer(self._docs, dtype=np.int64)
        with open(path, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _DTYPE_TO_CODE[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", docs.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())

    def finalize(self) -> str:
        """Write the index, rename both files to their final names and return the prefix."""
        if self._closed:
            return self.prefix
        try:
            if self._docs[-1] != len(self._lengths):  # sequences added with add_item, unclosed
                self.end_document()
            self._bin.close()
            self._write_index(self._tmp_idx)
            # .bin first: a reader needs the .idx, which appears last, only once both are complete.
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.prefix

    def abort(self) -> None:
        """Discard everything written so far; the final names are left untouched."""
        self._closed = True
        try:
            self._bin.close()
        except Exception:
            pass
        for p in (self._tmp_bin, self._tmp_idx):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.abort()
