"""The step loader over a stream: one item = this rank's micro-batches of one optimizer step, resumed exactly
from the stream's own position (no replay of what was trained).

Order. Every data-parallel rank reads the *same* global record stream (a ``datasets.IterableDataset`` —
hub id or local files with ``streaming=True`` — a torch ``IterableDataset``, or any re-iterable), in
windows of ``window`` records. With ``shuffle=True`` the records of window ``w`` of epoch ``e`` are
permuted by a generator seeded from ``(seed, e, w)``; otherwise they keep the stream's order. Each record
goes through ``transform`` (record -> 0..k samples: tokenize and cut into windows, render a chat, ...),
giving the global sample stream; global step ``s`` is its next ``global_batch_size`` samples, and DP rank
``r`` of ``d`` takes the ``r``-th contiguous block of ``G // d`` of them, cut into micro-batches (packing
is the collator's job, inside a micro-batch, so it never changes which samples a step trains on). The
order depends on the stream, the seed and the window only: not on the DP size, not on the micro-batch size.

Why every rank reads the whole stream instead of ``datasets.distributed.split_dataset_by_node``: a split
gives each rank its own sub-stream, so the global order (and every resume) would depend on the DP size,
and the split needs ``n_shards % world_size == 0`` to avoid reading everything anyway. Reading records is
cheap next to a step; the transform runs on every record on every rank (so that skipped rows and text
windows, which cross records, come out alike everywhere) — ``benchmarks/streaming.py`` measures the cost.

State. ``state_dict()`` holds the source's own position at the start of the current window
(``IterableDataset.state_dict()``: shard and offset), the record index inside the window, how many
samples of that record were already used, the transform's carry-over before it (e.g. the tokens of a
text window not yet complete) and the epoch: identical on every rank. A resume loads the source's
position, reads that one window again (at most ``window`` records, however far training got) and
continues with the next sample. A source without ``state_dict()``/``load_state_dict()`` is resumed by
reading the records before the window again (said once in a warning). Because the order does not depend
on the DP size, a state saved at one DP size resumes exactly at another with the same global batch.

Bad rows. A record the transform cannot turn into samples is a ``StreamRowError`` naming its position
(epoch and record number in the stream's own order, counted from 0, and the record's start), or,
with ``bad_rows="skip"``, skipped and counted (``skipped_rows``; one warning per epoch).
"""
from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import torch

from hyperacc.data.collate import check_batch, default_collate
from hyperacc.data.loader import _epoch_seed, _positive_int, check_rank
from hyperacc.data.stream_position import has_position
from hyperacc.errors import DataResumeMismatch, StreamRowError

__all__ = ["StreamingDataLoader", "StreamRowError", "STREAM_STATE_VERSION"]

STREAM_STATE_VERSION = 1


def _window_seed(seed: int, epoch: int, window: int) -> int:
    digest = hashlib.blake2b(f"hyperacc.stream:{_epoch_seed(seed, epoch)}:{window}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _Position:
    """Where the next sample comes from: (epoch, window, source position at the window's start, record in
    the window, samples of that record already used, the transform's carry-over before that record)."""

    __slots__ = ("epoch", "window", "source", "record", "used", "carry", "records_before")

    def __init__(self, epoch=0, window=0, source=None, record=0, used=0, carry=None, records_before=0):
        self.epoch, self.window, self.source, self.record = epoch, window, source, record
        self.used, self.carry, self.records_before = used, carry, records_before

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class StreamingDataLoader:
    """Yield, per optimizer step, this DP rank's micro-batches (``list[dict[str, Tensor]]``) from a stream.

    Args:
        source: a ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``), a torch
            ``IterableDataset`` or any iterable that can be iterated again (one pass = one epoch). The
            loader owns it: the source's position when the loader is built is where every epoch starts
            (pass a fresh source, not one already iterated).
        global_batch_size: samples per optimizer step over all DP ranks.
        micro_batch_size: samples per micro-batch.
        transform: record -> list of samples (``hyperacc.data.stream_samples.TextWindows`` /
            ``ChatRecords``); optional ``state_dict()`` (a new object each call)/``load_state_dict()``/``reset()``
            for what it carries from one record to the next. Default: each record is one sample.
        collate_fn: list of samples -> mapping of tensors (default :func:`default_collate`).
        shuffle: permute each window of records (seeded from ``(seed, epoch, window)``).
        seed: the order's seed (part of the state).
        window: records per window: the shuffle's reach and the most a resume reads again.
        bad_rows: ``"error"`` (default) or ``"skip"`` (skipped and counted).
        resume_mismatch: ``"error"`` or ``"restart"`` (a changed global batch or source restarts the epoch).
    """

    def __init__(self, source, *, global_batch_size: int, micro_batch_size: int,
                 transform: Optional[Callable[[Any], list]] = None, collate_fn: Optional[Callable] = None,
                 shuffle: bool = False, seed: int = 0, window: int = 1024, bad_rows: str = "error",
                 resume_mismatch: str = "error"):
        self._global_batch_size = _positive_int("global_batch_size", global_batch_size)
        self._micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        self._window = _positive_int("window", window)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
        if resume_mismatch not in ("error", "restart"):
            raise ValueError(f"resume_mismatch must be 'error' or 'restart', got {resume_mismatch!r}")
        if not hasattr(source, "__iter__") or isinstance(source, (str, bytes, Mapping)):
            raise TypeError("StreamingDataLoader needs an iterable source (datasets' load_dataset(..., "
                            f"streaming=True), a torch IterableDataset), got {type(source).__name__}")
        if iter(source) is source:
            raise TypeError(f"the source is a one-pass iterator ({type(source).__name__}): pass an object that can be "
                            "iterated again (an IterableDataset, a datasets stream), or a map-style dataset to "
                            "MicroBatchDataLoader")
        for name, fn in (("transform", transform), ("collate_fn", collate_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        self._source, self._transform = source, transform
        self._collate = collate_fn if collate_fn is not None else default_collate
        self._shuffle, self._seed = bool(shuffle), int(seed)
        self.bad_rows, self.resume_mismatch = bad_rows, resume_mismatch
        self._positioned = has_position(source)
        self._start = self._source_state() if self._positioned else None    # the stream's beginning
        self._pos = _Position(source=self._start)
        self._generation = 0
        self.skipped_rows = 0
        self._dp_rank, self._dp_size = 0, 1
        self.bind(0, 1)

    # ------------------------------------------------------------------ configuration
    def bind(self, dp_rank: int, dp_size: int) -> "StreamingDataLoader":
        """Take DP rank ``dp_rank`` of ``dp_size``'s share of every step (``prepare()`` calls it)."""
        check_rank(dp_rank, dp_size, self._global_batch_size, self._micro_batch_size)
        self._dp_rank, self._dp_size = dp_rank, dp_size
        self._generation += 1
        return self

    dataset = property(lambda self: self._source)
    global_batch_size = property(lambda self: self._global_batch_size)
    micro_batch_size = property(lambda self: self._micro_batch_size)
    dp_rank = property(lambda self: self._dp_rank)
    dp_size = property(lambda self: self._dp_size)
    seed = property(lambda self: self._seed)
    shuffle = property(lambda self: self._shuffle)

    @property
    def micro_batches_per_step(self) -> int:
        return self._global_batch_size // (self._micro_batch_size * self._dp_size)

    @property
    def epoch(self) -> int:
        """The epoch of the next step to be consumed."""
        return self._pos.epoch

    def __len__(self) -> int:
        raise TypeError("a stream has no length: bound the run by steps (max_steps), not by len(loader)")

    def __repr__(self) -> str:
        return (f"StreamingDataLoader(global_batch_size={self._global_batch_size}, micro_batch_size="
                f"{self._micro_batch_size}, dp_rank={self._dp_rank}, dp_size={self._dp_size}, epoch={self.epoch}, "
                f"records_read={self._pos.records_before + self._pos.record})")

    # ------------------------------------------------------------------ the source
    def _source_state(self):
        return copy.deepcopy(self._source.state_dict())

    def _records_from(self, pos: _Position) -> Iterator:
        """The epoch's records from the start of ``pos``'s window on."""
        set_epoch = getattr(self._source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(pos.epoch)
        if self._positioned:
            self._source.load_state_dict(copy.deepcopy(pos.source))
            return iter(self._source)
        records = iter(self._source)
        if pos.records_before:
            warnings.warn(f"StreamingDataLoader: {type(self._source).__name__} has no state_dict()/load_state_dict(), "
                          f"so the resume reads its first {pos.records_before} records again. Fix: give the source "
                          "those methods (torchdata's Stateful protocol), or stream it with datasets", stacklevel=3)
            for _ in range(pos.records_before):
                next(records)
        return records

    @staticmethod
    def _position_name(pos: _Position, index: int, record) -> str:
        """The record's place in the stream (exact, as the loader counts) and its start, to find it by."""
        preview = repr(record)
        preview = preview if len(preview) <= 80 else preview[:77] + "..."
        return f"record {pos.records_before + index} of epoch {pos.epoch} of the stream ({preview})"

    # ------------------------------------------------------------------ samples
    def _samples(self, pos: _Position) -> Iterator[tuple[Any, _Position]]:
        """(sample, the position after it) from ``pos`` to the end of the epoch."""
        transform = self._transform
        if transform is not None and hasattr(transform, "load_state_dict"):
            transform.load_state_dict(copy.deepcopy(pos.carry)) if pos.carry is not None else transform.reset()
        records = self._records_from(pos)
        window, source, first, used, before = pos.window, pos.source, pos.record, pos.used, pos.records_before
        skipped_before = self.skipped_rows
        while True:
            chunk = []
            for record in records:
                chunk.append(record)
                if len(chunk) == self._window:
                    break
            if not chunk:
                if self.skipped_rows > skipped_before:
                    warnings.warn(f"StreamingDataLoader: skipped {self.skipped_rows - skipped_before} bad row(s) in "
                                  f"epoch {pos.epoch} (bad_rows='skip')", stacklevel=3)
                return
            after = self._source_state() if self._positioned else None
            order = list(range(len(chunk)))
            if self._shuffle:
                gen = torch.Generator()
                gen.manual_seed(_window_seed(self._seed, pos.epoch, window))
                order = torch.randperm(len(chunk), generator=gen).tolist()
            here = _Position(pos.epoch, window, source, 0, 0, None, before)
            for index in range(first, len(order)):
                carry = _carry(transform)
                try:
                    samples = transform(chunk[order[index]]) if transform is not None else [chunk[order[index]]]
                except Exception as err:  # noqa: BLE001 - named by its position, or skipped
                    if transform is not None and hasattr(transform, "load_state_dict") and carry is not None:
                        transform.load_state_dict(copy.deepcopy(carry))
                    if self.bad_rows == "skip":
                        self.skipped_rows += 1
                        samples = []
                    else:
                        where = self._position_name(here, order[index], chunk[order[index]])
                        raise StreamRowError(f"{where} cannot be made into "
                                             f"samples: {type(err).__name__}: {str(err).rstrip('.')}. Fix: correct or "
                                             "remove the row, or "
                                             "pass bad_rows='skip' to skip and count such rows") from None
                for k in range(used, len(samples)):
                    if k + 1 < len(samples):
                        nxt = _Position(pos.epoch, window, source, index, k + 1, carry, before)
                    elif index + 1 < len(order):
                        nxt = _Position(pos.epoch, window, source, index + 1, 0, _carry(transform), before)
                    else:
                        nxt = _Position(pos.epoch, window + 1, after, 0, 0, _carry(transform), before + len(chunk))
                    yield samples[k], nxt
                used = 0
            window, source, first, before = window + 1, after, 0, before + len(chunk)

    def _make_item(self, samples: list) -> list:
        per_rank = self._global_batch_size // self._dp_size
        mine = samples[self._dp_rank * per_rank:(self._dp_rank + 1) * per_rank]
        m = self._micro_batch_size
        return [check_batch(self._collate(mine[i:i + m])) for i in range(0, len(mine), m)]

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        """The remaining steps of the current epoch; the position moves past a step as it is yielded."""
        self._generation += 1
        generation, start = self._generation, self._pos
        stream, g = self._samples(start), self._global_batch_size
        while True:
            samples, after = [], None
            for sample, after in stream:
                samples.append(sample)
                if len(samples) == g:
                    break
            if self._generation != generation:
                raise RuntimeError("StreamingDataLoader: the loader was re-bound, its state loaded, or a newer "
                                   "iterator started while this iterator was active; start a new `for` loop")
            if len(samples) < g:                    # the stream ended: the partial step is dropped
                self._pos = _Position(start.epoch + 1, 0, self._start, 0, 0, None, 0)
                return
            item = self._make_item(samples)
            self._pos = after
            yield item

    # ------------------------------------------------------------------ state
    def _fingerprint(self) -> dict:
        fingerprint: dict[str, Any] = {"source": type(self._source).__name__}
        extra = getattr(self._source, "fingerprint", None)
        extra = extra() if callable(extra) else extra
        if isinstance(extra, (str, int)) and not isinstance(extra, bool):
            fingerprint["id"] = extra
        ident = getattr(self._transform, "identity", None)
        if callable(ident):
            fingerprint["transform"] = ident()
        return fingerprint

    def state_dict(self) -> dict:
        """Plain data, identical on every rank: the next sample's position and what checks a resume."""
        return {"kind": "stream", "position": self._pos.as_dict(), "seed": self._seed, "shuffle": self._shuffle,
                "window": self._window, "global_batch_size": self._global_batch_size,
                "dataset_fingerprint": self._fingerprint(), "skipped_rows": self.skipped_rows,
                "version": STREAM_STATE_VERSION}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue at the next unconsumed sample of ``state`` (any DP size / micro-batch size)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state_dict expects a mapping, got {type(state).__name__}")
        if state.get("kind") != "stream":
            raise DataResumeMismatch("the checkpoint's loader state is a map-style MicroBatchDataLoader's, not a "
                                     "stream's: resume with the loader that saved it, or construct this one with "
                                     "resume_mismatch='restart' to start the stream from its beginning")
        if int(state.get("version", 0)) > STREAM_STATE_VERSION:
            raise ValueError(f"StreamingDataLoader state version {state['version']} is newer than this code "
                             f"({STREAM_STATE_VERSION}); upgrade hyperacc to resume it")
        problems = [f"{name}: saved {state[name]!r}, current {now!r}"
                    for name, now in (("global_batch_size", self._global_batch_size), ("shuffle", self._shuffle),
                                      ("window", self._window), ("seed", self._seed),
                                      ("dataset_fingerprint", self._fingerprint()))
                    if state.get(name) != now]
        saved = state["position"]
        if saved.get("source") is not None and not self._positioned:
            problems.append("the saved position is the source's own, and this source has no load_state_dict()")
        self._generation += 1
        if problems:
            if self.resume_mismatch != "restart":
                raise DataResumeMismatch(
                    f"cannot resume the stream exactly ({'; '.join(problems)}): the saved position would map to "
                    "different samples. Fix: restore the saved value(s), or construct the loader with "
                    "StreamingDataLoader.resume_mismatch='restart' to restart the stream's epoch (the model, "
                    "optimizer and progress are restored all the same)")
            warnings.warn(f"StreamingDataLoader: {'; '.join(problems)}; resume_mismatch='restart': restarting "
                          f"epoch {int(saved['epoch'])} from the start of the stream", stacklevel=2)
            self._pos = _Position(int(saved["epoch"]), 0, self._start, 0, 0, None, 0)
            return
        self._pos = _Position(**{name: saved[name] for name in _Position.__slots__})
        self.skipped_rows = int(state.get("skipped_rows", 0))


def _carry(transform):
    """The transform's carry-over: its ``state_dict()``, which must return a new object (not a view of its live
    state; TextWindows copies its token list). No deepcopy here: it ran twice a record, ~35 % of the loader's
    time in benchmarks/streaming.py's profile."""
    return transform.state_dict() if transform is not None and hasattr(transform, "state_dict") else None
