"""Megatron-LM indexed dataset files (``PREFIX.bin`` + ``PREFIX.idx``, ``MMIDIDX`` version 1).

The layout, byte for byte (little endian), as written and read by Megatron-LM / megatron-core:

``PREFIX.idx``::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    8 bytes   version, uint64 == 1
    1 byte    dtype code of the tokens (uint8=1 int8=2 int16=3 int32=4 int64=5 float64=6
              float32=7 uint16=8)
    8 bytes   S = number of sequences, uint64
    8 bytes   D = number of document indices, uint64 (number of documents + 1)
    S x int32 sequence lengths, in tokens
    S x int64 sequence pointers, byte offsets into PREFIX.bin
    D x int64 document indices: document k is made of sequences
              [document_indices[k], document_indices[k + 1]); the first is 0, the last is S
    (S x int8 sequence modes, only in multimodal files; ignored here)

``PREFIX.bin``: the tokens of all sequences, back to back, in the dtype above.

This module only needs numpy: importing it stays cheap (no torch, no transformers).
"""
from __future__ import annotations

import os
import re
import socket
import struct
from array import array
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

__all__ = [
    "IndexedDataset",
    "IndexedDatasetWriter",
    "IndexedDatasetError",
    "MAGIC",
    "VERSION",
    "optimal_dtype",
    "exists",
    "remove_stale_temp_files",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # 34 bytes

_CODE_TO_DTYPE = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_DTYPE_TO_CODE = {np.dtype(v): k for k, v in _CODE_TO_DTYPE.items()}
# The token dtypes a writer accepts (Megatron only ever writes these two for tokens).
_TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated, foreign or inconsistent."""


def optimal_dtype(vocab_size: Optional[int]):
    """uint16 when the vocabulary has fewer than 65500 entries, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: Union[str, os.PathLike]) -> str:
    return os.fspath(prefix) + ".idx"


def bin_path(prefix: Union[str, os.PathLike]) -> str:
    return os.fspath(prefix) + ".bin"


def exists(prefix: Union[str, os.PathLike]) -> bool:
    """True when both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def normalize_prefix(path: Union[str, os.PathLike]) -> str:
    """Accept ``PREFIX``, ``PREFIX.idx`` or ``PREFIX.bin`` and return ``PREFIX``."""
    path = os.fspath(path)
    if path.endswith((".idx", ".bin")) and not exists(path):
        return path[:-4]
    return path


class IndexedDataset:
    """Memory-mapped reader of a Megatron ``MMIDIDX`` v1 dataset.

    ``len(ds)`` is the number of sequences, ``ds[i]`` the i-th sequence as a 1-D numpy array (a
    read-only view into the memory-mapped ``.bin``), ``ds.document_indices`` the int64 document
    boundaries (``len == documents + 1``). Everything is validated when the files are opened;
    a problem raises :class:`IndexedDatasetError` naming the file and what is wrong.
    """

    def __init__(self, prefix: Union[str, os.PathLike]):
        self.prefix = normalize_prefix(prefix)
        self.idx_path = idx_path(self.prefix)
        self.bin_path = bin_path(self.prefix)
        self._open()

    # -- opening and validation ---------------------------------------------------------------
    def _fail(self, path: str, problem: str, fix: str = "") -> IndexedDatasetError:
        msg = f"{path}: {problem}"
        if fix:
            msg += f" ({fix})"
        return IndexedDatasetError(msg)

    def _open(self) -> None:
        regen = "re-create it with `python -m hyperacc.data.convert ... --overwrite`"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise self._fail(path, "file not found",
                                 "a Megatron dataset is a PREFIX.bin + PREFIX.idx pair; pass PREFIX")
        idx_size = os.path.getsize(self.idx_path)
        if idx_size < HEADER_SIZE:
            raise self._fail(self.idx_path, f"truncated index: {idx_size} bytes, the header alone "
                             f"is {HEADER_SIZE} bytes", regen)
        with open(self.idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != MAGIC:
            raise self._fail(self.idx_path, f"not a Megatron MMIDIDX index (magic {header[:9]!r}, "
                             f"expected {MAGIC!r})", "is this file from another tool?")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise self._fail(self.idx_path, f"unsupported index version {version} (only version "
                             f"{VERSION} is supported)")
        code = header[17]
        if code not in _CODE_TO_DTYPE:
            raise self._fail(self.idx_path, f"unknown dtype code {code} (known: "
                             f"{sorted(_CODE_TO_DTYPE)})")
        self.dtype = np.dtype(_CODE_TO_DTYPE[code])
        n_seq, n_doc = struct.unpack("<QQ", header[18:34])
        body = 4 * n_seq + 8 * n_seq + 8 * n_doc
        expected = HEADER_SIZE + body
        # Multimodal files carry one int8 mode per sequence after the document indices.
        if idx_size not in (expected, expected + n_seq):
            raise self._fail(self.idx_path, f"truncated or corrupt index: the header announces "
                             f"{n_seq} sequences and {n_doc} document indices, which take "
                             f"{expected} bytes, but the file has {idx_size} bytes", regen)
        self.multimodal = idx_size == expected + n_seq and n_seq > 0
        if n_doc < 1:
            raise self._fail(self.idx_path, "no document indices (there must be at least [0])", regen)

        mm = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self._idx_mmap = mm
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=off)

        docs = self.document_indices
        if docs[0] != 0:
            raise self._fail(self.idx_path, f"the first document index is {int(docs[0])}, not 0", regen)
        if docs[-1] != n_seq:
            raise self._fail(self.idx_path, f"the last document index is {int(docs[-1])} but there "
                             f"are {n_seq} sequences", regen)
        if n_doc > 1 and np.any(np.diff(docs) < 0):
            raise self._fail(self.idx_path, "document indices are not non-decreasing", regen)

        itemsize = self.dtype.itemsize
        lengths = self.sequence_lengths
        if n_seq and lengths.min() < 0:
            raise self._fail(self.idx_path, "negative sequence length", regen)
        # The reader requires the contiguous layout that Megatron's builder and our writer both
        # produce: pointer[i] == sum(lengths[:i]) * itemsize. Checked in chunks (bounded memory);
        # nothing per sequence is kept in RAM beyond the memory-mapped index.
        total = 0
        chunk = 1 << 20
        for a in range(0, n_seq, chunk):
            ln = lengths[a:a + chunk].astype(np.int64)
            ends = np.cumsum(ln) + total
            expect = (ends - ln) * itemsize
            ptr = self.sequence_pointers[a:a + chunk]
            if not np.array_equal(ptr, expect):
                bad = int(np.flatnonzero(ptr != expect)[0])
                raise self._fail(self.idx_path, f"sequence pointer {a + bad} is {int(ptr[bad])}, expected "
                                 f"{int(expect[bad])} (sequences must lie back to back in the .bin)", regen)
            total = int(ends[-1])
        self.num_tokens = total
        bin_size = os.path.getsize(self.bin_path)
        if bin_size != self.num_tokens * itemsize:
            raise self._fail(self.bin_path, f"size mismatch: the index describes {self.num_tokens} "
                             f"tokens of {self.dtype.name} = {self.num_tokens * itemsize} bytes, but the "
                             f"file has {bin_size} bytes (truncated, or not the .bin of this .idx)",
                             regen)
        self._shift = itemsize.bit_length() - 1  # itemsize is a power of two
        if bin_size:
            # A plain ndarray view of the memory map: slicing it is cheaper than slicing a memmap.
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r",
                                    shape=(self.num_tokens,)).view(np.ndarray)
        else:
            self.tokens = np.empty(0, dtype=self.dtype)

    # -- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, i):
        try:  # the hot path: two reads from the mapped index, one slice of the mapped tokens
            s = self.sequence_pointers.item(i) >> self._shift
            return self.tokens[s:s + self.sequence_lengths.item(i)]
        except TypeError:
            if isinstance(i, slice):
                start, stop, step = i.indices(len(self))
                return [self[j] for j in range(start, stop, step)]
            raise

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i``."""
        s = int(self.sequence_pointers[i]) >> self._shift
        e = s + int(self.sequence_lengths[i])
        s = s + offset
        if length is not None:
            e = min(e, s + length)
        return self.tokens[s:e]

    def document(self, k: int) -> np.ndarray:
        """All tokens of document ``k`` (its sequences, concatenated)."""
        a, b = int(self.document_indices[k]), int(self.document_indices[k + 1])
        if a == b:
            return self.tokens[0:0]
        s = int(self.sequence_pointers[a]) >> self._shift
        e = (int(self.sequence_pointers[b - 1]) >> self._shift) + int(self.sequence_lengths[b - 1])
        return self.tokens[s:e]

    def document_token_offsets(self) -> np.ndarray:
        """Token offset where each document starts in the flat token stream, plus the total."""
        docs = self.document_indices
        out = np.empty(len(docs), dtype=np.int64)
        first = docs[:-1]
        nonempty = first < len(self)
        out[:-1][nonempty] = self.sequence_pointers[first[nonempty]] >> self._shift
        out[:-1][~nonempty] = self.num_tokens
        out[-1] = self.num_tokens
        return out

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents="
                f"{self.num_documents}, tokens={self.num_tokens}, dtype={self.dtype.name})")

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])


_TMP_TAG = re.compile(r"\.tmp-(?P<pid>\d+)-[0-9a-f]+(?:@(?P<host>.*))?$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(prefix: Union[str, os.PathLike], log=None) -> List[str]:
    """Remove the ``PREFIX.bin.tmp-*`` / ``PREFIX.idx.tmp-*`` files that a killed writer of the
    same prefix left behind; return their paths.

    A temporary file is stale when the process that wrote it (pid and host are in its name) no
    longer runs on this host. Files of a live writer, or written on another host, are kept (the
    latter with a message through ``log``).
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
            if _pid_alive(int(match.group("pid"))):
                continue
            os.remove(path)
            removed.append(path)
            if log is not None:
                log(f"removed stale temporary file {path} (its writer, pid {match.group('pid')}, is gone)")
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
