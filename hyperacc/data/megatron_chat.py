"""Chat data in Megatron format: token ids plus a loss mask, written by the converter, read for training.

    python -m hyperacc.data.convert --format chat --input chats.jsonl --output-prefix data/sft

writes two ``MMIDIDX`` pairs with identical document lengths, one document per conversation:
``PREFIX.bin/.idx`` (the rendered token ids) and ``PREFIX_loss_mask.bin/.idx`` (uint8, 1 where the token is
trained: the assistant's tokens as the chat template marks them). Two plain pairs rather than one custom
file: each is a standard Megatron dataset that megatron-core and any ``IndexedDataset`` open as is.

Conversations are stored whole and cut to ``seq_len`` when read, by ``hyperacc.data.chat.fit_sample`` (the
rule every chat source shares): one conversion serves every ``seq_len``, and ``ChatIndexedDataset`` gives
the samples that rendering the records in memory gives. Importing this module is cheap (numpy; torch when
a sample is read).
"""
from __future__ import annotations

import hashlib
import itertools
import operator
import os
import secrets
import socket
import warnings
from typing import Optional, Tuple, Union

import numpy as np

from hyperacc.data.chat import IGNORE_INDEX, render_row
from hyperacc.data.megatron import IndexedDataset, exists, normalize_prefix
from hyperacc.data.megatron_writer import IndexedDatasetWriter
from hyperacc.data.packed import SPLITS, _check_seq_len, holdout_cut

__all__ = ["LOSS_MASK_SUFFIX", "loss_mask_prefix", "has_loss_mask", "ChatIndexedDataset", "ChatDatasetWriter",
           "ChatEncoder"]

LOSS_MASK_SUFFIX = "_loss_mask"
CONVERT_FIX = "convert the chat records with `python -m hyperacc.data.convert --format chat ...`"


def loss_mask_prefix(prefix: Union[str, os.PathLike]) -> str:
    """Prefix of the loss-mask pair that belongs to the token ids at ``prefix``."""
    return normalize_prefix(prefix) + LOSS_MASK_SUFFIX


def has_loss_mask(prefix: Union[str, os.PathLike]) -> bool:
    """True when both the ids pair and its loss-mask pair exist (chat data, not plain text)."""
    return exists(normalize_prefix(prefix)) and exists(loss_mask_prefix(prefix))


# -- writing (used by hyperacc.data.convert) --------------------------------------------------------
class ChatEncoder:
    """Renders the converter's batches ``(first_row, {column: values})`` of chat records to (flat ids,
    lengths, flat uint8 loss mask). Picklable (the tokenizer travels with it) for its worker processes. A
    record that cannot be rendered is one ValueError naming its row (a conversion has no partial output)."""

    def __init__(self, tokenizer, messages_column: str, source: str):
        self.tokenizer, self.messages_column, self.source = tokenizer, messages_column, source

    def encode(self, batch) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        first, columns = batch
        ids, masks = [], []
        for row, values in enumerate(zip(*columns.values()), start=first):
            sample = render_row(self.tokenizer, dict(zip(columns, values)), messages_column=self.messages_column,
                                where=f"record {row} of {self.source}", column_flag="--messages-column ")
            ids.append(sample["input_ids"])
            masks.append([label != IGNORE_INDEX for label in sample["labels"]])
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
        return flat, lengths, np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=total)


class ChatDatasetWriter:
    """Writes the ids pair and the loss-mask pair together: all four files appear, or none does.

    Each pair is an atomic :class:`IndexedDatasetWriter`, finalized first under staging names (the
    ``PREFIX.bin.tmp-<pid>-<hex>@<host>`` form ``remove_stale_temp_files`` cleans up after a killed run);
    all four are renamed only once both are complete: no new ids beside an old or missing mask."""

    def __init__(self, prefix: str, *, vocab_size: int, overwrite: bool = False):
        self.prefix = prefix
        self.ids = IndexedDatasetWriter(prefix, vocab_size=vocab_size, overwrite=overwrite)
        try:
            # the prefix as given (no normalize_prefix: "x.bin" means x.bin.bin here, as for the ids)
            self.mask = IndexedDatasetWriter(prefix + LOSS_MASK_SUFFIX, dtype=np.uint8, overwrite=overwrite)
        except BaseException:
            self.ids.abort()
            raise
        self.dtype, self.num_trained = self.ids.dtype, 0

    num_documents = property(lambda self: self.ids.num_documents)
    num_tokens = property(lambda self: self.ids.num_tokens)

    def add_documents_flat(self, tokens, lengths, mask) -> None:
        self.ids.add_documents_flat(tokens, lengths)
        self.mask.add_documents_flat(mask, lengths)
        self.num_trained += int(np.count_nonzero(mask))

    def finalize(self) -> str:
        tag = f".tmp-{os.getpid()}-{secrets.token_hex(6)}@{socket.gethostname()}"
        moves = []
        try:
            for w in (self.ids, self.mask):
                finals = (w.bin_path, w.idx_path)
                w.bin_path, w.idx_path = (p + tag for p in finals)   # finalize() renames into these
                moves += list(zip((w.bin_path, w.idx_path), finals))
                w.finalize()
            # ids .bin, mask .bin, mask .idx, ids .idx: the pair a reader opens first (ids .idx) comes last
            for staged, final in (moves[0], moves[2], moves[3], moves[1]):
                os.replace(staged, final)
        except BaseException:
            self.abort()
            for staged in [p for p, _ in moves if os.path.exists(p)]:
                os.remove(staged)
            raise
        return self.prefix

    def abort(self) -> None:
        self.ids.abort()
        self.mask.abort()


# -- reading --------------------------------------------------------------------------------------
def _counts_at(mask: np.ndarray, positions: np.ndarray, where: str, chunk: int = 1 << 22) -> np.ndarray:
    """``out[j]`` = number of ones in ``mask[:positions[j]]`` (``positions`` sorted), in one chunked
    pass (bounded memory for any corpus size) that also checks every value is 0 or 1."""
    out = np.zeros(len(positions), dtype=np.int64)
    total, j = 0, 0
    for a in range(0, len(mask), chunk):
        part = mask[a:a + chunk]
        bad = np.flatnonzero(part > 1) if mask.dtype.kind == "u" else np.flatnonzero((part < 0) | (part > 1))
        if bad.size:
            raise ValueError(f"{where}: loss-mask value {part[bad[0]]} at token {a + int(bad[0])}; a loss mask holds "
                             f"only 0 and 1 (re-create it: {CONVERT_FIX} --overwrite)")
        csum = np.cumsum(part, dtype=np.int64)
        k = int(np.searchsorted(positions, a + len(part), side="right"))
        sel = positions[j:k] - a                         # in [0, len(part)] here
        out[j:k] = total + np.where(sel > 0, csum[np.maximum(sel - 1, 0)], 0)
        total += int(csum[-1]) if csum.size else 0
        j = k
    return out


def _mismatch(lengths: np.ndarray, mask_lengths: np.ndarray) -> Optional[str]:
    """How the mask's document lengths differ from the ids' (None when they agree)."""
    if len(mask_lengths) != len(lengths):
        return f"{len(mask_lengths)} documents, the ids {len(lengths)}"
    bad = np.flatnonzero(mask_lengths != lengths)
    return f"document {bad[0]} has {mask_lengths[bad[0]]} mask values, not {lengths[bad[0]]}" if bad.size else None


class ChatIndexedDataset:
    """Map-style chat samples over ``PREFIX`` + ``PREFIX_loss_mask`` (see the module docstring).

    ``ds[i]`` is ``{"input_ids", "labels"}``, 1-D int64 tensors of at most ``seq_len`` tokens: conversation
    ``ds.documents[i]`` cut by ``fit_sample``, labels the token where the mask is 1, else -100. Conversations
    with nothing trained within ``seq_len`` tokens are skipped (``ds.skipped`` counts them). ``split``:
    ``"train"``, ``"validation"`` (the last ``holdout_fraction`` of the tokens, cut at a conversation
    boundary by ``packed.holdout_cut``, as for ``PackedDataset``) or ``"all"``.
    """

    def __init__(self, prefix: Union[str, os.PathLike], seq_len: int, *, split: Optional[str] = "all",
                 holdout_fraction: float = 0.05):
        self.seq_len, self.split, self.holdout_fraction = _check_seq_len(seq_len), split or "all", holdout_fraction
        if self.split not in SPLITS:
            raise ValueError(f"unknown split {split!r} for Megatron chat data; available: {', '.join(SPLITS)}")
        if split == "validation" and holdout_fraction <= 0:
            raise ValueError("split='validation' needs holdout_fraction > 0 (e.g. 0.05)")
        self.ids = IndexedDataset(prefix)
        self.prefix, mprefix = self.ids.prefix, loss_mask_prefix(self.ids.prefix)
        if not exists(mprefix):
            raise ValueError(f"{self.prefix}: no loss mask ({mprefix}.bin/.idx not found): these are token ids "
                             f"without the assistant-token mask chat training needs. Fix: {CONVERT_FIX}")
        self.mask = IndexedDataset(mprefix)
        offsets = self.ids.document_token_offsets()
        problem = _mismatch(np.diff(offsets), np.diff(self.mask.document_token_offsets()))
        if problem:
            raise ValueError(f"{mprefix}: the loss mask does not match {self.prefix} ({problem}). Fix: re-create "
                             f"both: {CONVERT_FIX} --overwrite")
        if self.mask.dtype.kind not in "iu":
            raise ValueError(f"{mprefix}: a loss mask holds integers 0/1, not {self.mask.dtype.name} ({CONVERT_FIX})")
        self.documents, self.skipped = self._select(offsets)
        self._start = offsets[self.documents]
        self._length = np.minimum(offsets[self.documents + 1] - self._start, self.seq_len)
        self._fingerprint, where = None, self.prefix + ("" if self.split == "all" else f" (split {self.split!r})")
        if len(self.documents) == 0:
            raise ValueError(f"no conversation of {where} has an assistant token within seq_len={self.seq_len} tokens "
                             f"(all {self.skipped} were skipped). Fix: a larger seq_len, or data with assistant turns.")
        if self.skipped:
            warnings.warn(f"{self.skipped} conversations of {where} have no assistant token within "
                          f"seq_len={self.seq_len} tokens: skipped", stacklevel=2)

    def _select(self, offsets: np.ndarray):
        """(kept document indices, skipped count): ``fit_sample``'s rule, vectorised -- a conversation is
        kept when its mask has a 1 among positions ``1 .. min(length, seq_len) - 1``."""
        starts, ends = offsets[:-1], offsets[1:]
        in_split = np.ones(len(starts), dtype=bool)
        if self.split != "all":   # train: the conversations that start before the cut; validation: the rest
            in_split = (starts < holdout_cut(offsets, self.holdout_fraction)) == (self.split == "train")
        candidates = np.flatnonzero(in_split & (ends - starts >= 2))
        first = starts[candidates] + 1
        last = starts[candidates] + np.minimum(ends[candidates] - starts[candidates], self.seq_len)
        counts = _counts_at(self.mask.tokens, np.stack([first, last], axis=1).reshape(-1), self.mask.prefix)
        kept = candidates[counts[1::2] > counts[0::2]]
        return kept.astype(np.int64), int(np.count_nonzero(in_split)) - len(kept)

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i) -> dict:
        import torch

        i = range(len(self))[operator.index(i)]  # negative indices; IndexError out of range
        s = int(self._start[i])
        e = s + int(self._length[i])
        ids = self.ids.tokens[s:e].astype(np.int64)
        labels = np.where(self.mask.tokens[s:e] == 1, ids, IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def num_tokens(self) -> int:  # over all samples, after truncation
        return int(self._length.sum())

    def fingerprint(self) -> str:
        """Identity of the samples (for resuming a loader): a hash of both index files (every document's
        length), the sizes of both token files, and seq_len / split / holdout_fraction. Content, not mtimes:
        a copy of the files on another node has the same fingerprint."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for ds in (self.ids, self.mask):
                with open(ds.idx_path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                h.update(str(os.path.getsize(ds.bin_path)).encode())
            split = self.split if self.split == "all" else f"{self.split}/{self.holdout_fraction}"
            h.update(f"|{self.seq_len}|{split}".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"ChatIndexedDataset({self.prefix!r}, samples={len(self)}, seq_len={self.seq_len}, "
                f"split={self.split!r}, skipped={self.skipped})")
