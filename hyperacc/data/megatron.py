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
import struct
from typing import Optional, Union

import numpy as np
from hyperacc.errors import IndexedDatasetError  # noqa: F401 - defined with every error class

__all__ = [
    "IndexedDataset",
    "IndexedDatasetError",
    "MAGIC",
    "VERSION",
    "optimal_dtype",
    "exists",
]  # the writer: hyperacc.data.megatron_writer

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
