"""A stream's own position for `ResumableLoader`: resume a prepared DataLoader over an iterable dataset
without reading again the batches already trained on.

A source that keeps its position (``state_dict()`` / ``load_state_dict()``: `datasets`' streaming
``IterableDataset``, a torch ``IterableDataset`` written that way, a torchdata ``Stateful``) is wrapped,
after accelerate prepared the loader, in `PositionTracker`: between two records it notes the source's
``state_dict()`` each time one more *global* batch (the samples one step covers on all ranks) was read.
The loader reads ahead (accelerate fetches the next batch, or the next group of batches when it
dispatches, before yielding the current one), so the source's live state is past what was trained; the
note for "``k`` global batches read" is exactly the position after the batches trained, whatever the
look-ahead. ``save_state`` stores the note of the batches yielded; ``load_state`` gives it back to the
source, which continues with the next record: nothing is read again.

Where it holds: the loader reads one global record stream (accelerate's `DataLoaderDispatcher` — the
main process reads and dispatches, its note is broadcast so every rank saves the same —, its
`IterableDatasetShard` — every rank reads the stream and keeps its slice —, or one process); the main
process reads the records (``num_workers=0``: workers hold copies of the source); the source's state is
all of its position (`datasets`' ``shuffle(buffer_size=...)`` loses its buffer on a resume). Otherwise
(or with per-rank shards, `datasets`' ``shard()``: each rank its own position) the loader falls back to
replaying the stream, with one warning naming why and how to avoid it.

The note counts records, so a position carries over to another number of processes whenever the
records trained are a whole number of the new global batches (e.g. the same global batch).

torchdata's ``StatefulDataLoader`` (accelerate's ``use_stateful_dataloader=True``) is not what resumes a
stream here: under accelerate's dispatching its saved dataset state is ``processes - 1`` batches past
what was trained (the look-ahead correction of accelerate 1.16 adjusts the counters, not the dataset's
state), and `IterableDatasetShard` keeps no state, so torchdata would replay. A stream is resumed by this
module with or without it; map-style data keeps torchdata's own state when it is turned on.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import IterableDataset

KEEP = 8          # notes kept: the look-ahead is at most two global batches


def has_position(source) -> bool:
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))


def _buffer_shuffled(source) -> bool:
    """`datasets`' shuffle buffer anywhere in the stream's chain (its content is not in the state)."""
    seen, todo = set(), [getattr(source, "_ex_iterable", None)]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo.append(getattr(node, "ex_iterable", None))
        todo.extend(getattr(node, "ex_iterables", None) or ())
    return False


def position_problem(source, num_workers: int) -> Optional[str]:
    """Why a stream cannot be resumed from its own position (None: it can)."""
    if not has_position(source):
        return (f"its dataset ({type(source).__name__}) keeps no position: give it state_dict()/load_state_dict(), "
                "as datasets' streaming IterableDataset has")
    if num_workers:
        return "the DataLoader reads it in worker processes: set num_workers=0 (the workers hold copies of the dataset)"
    if _buffer_shuffled(source):
        return ("datasets' shuffle(buffer_size=...) keeps its buffer out of the stream's state: shuffle the shards "
                "only, or the records before writing them")
    return None


class PositionTracker(IterableDataset):
    """The source, read through, noting its position at every whole global batch of records."""

    def __init__(self, source, global_batch: int):
        self.source, self.global_batch = source, int(global_batch)
        self.first = 0              # global batches already read before the next pass starts (a resume)
        self._notes: dict = {}

    def __iter__(self):
        first, self.first = self.first, 0
        self._notes = {}
        count = 0
        for record in self.source:
            yield record
            count += 1                                   # the consumer asked for the next record
            if count % self.global_batch == 0:
                batches = first + count // self.global_batch
                self._notes[batches] = self.source.state_dict()
                self._notes.pop(batches - KEEP, None)

    def note(self, batches: int):
        """The source's state after ``batches`` global batches of this pass (None if not noted)."""
        return self._notes.get(int(batches))

    def __getattr__(self, name):                         # set_epoch, generator, ... are the source's
        if name.startswith("__") or name in ("source", "_notes", "first", "global_batch"):
            raise AttributeError(name)
        return getattr(self.source, name)


def attach(loader, global_batch: Optional[int]) -> tuple:
    """Put a `PositionTracker` between accelerate's prepared ``loader`` (`DataLoaderShard` or
    `DataLoaderDispatcher`) and the user's stream. Returns (tracker or None, why not)."""
    from accelerate.data_loader import IterableDatasetShard

    base = getattr(loader, "base_dataloader", None)
    holder = getattr(base, "dataset", None)
    if base is None or holder is None:
        return None, "the loader was not prepared by accelerate's prepare_data_loader"
    shard = holder if isinstance(holder, IterableDatasetShard) else None
    source = shard.dataset if shard is not None else holder
    if not global_batch:
        return None, ("each process reads its own shards of the stream (datasets' shard()): keep accelerate's "
                      "default dispatch_batches, or a stream whose shard count is below the number of processes")
    problem = position_problem(source, int(getattr(base, "num_workers", 0) or 0))
    if problem is not None:
        return None, problem
    tracker = PositionTracker(source, global_batch)
    if shard is not None:
        shard.dataset = tracker
    else:
        object.__setattr__(base, "dataset", tracker)    # torch's DataLoader refuses a plain set after __init__
    if getattr(base, "_initial_iter_for_state_dict", False):
        # torchdata's StatefulDataLoader made an iterator over the bare source for accelerate's first
        # state_dict() and would hand it to the first pass: a new one reads through the tracker.
        base._iterator, base._initial_iter_for_state_dict = None, False
    return tracker, None


def shared_note(loader, note):
    """The note every rank saves: under `DataLoaderDispatcher` only the main process reads the stream, so
    its note is broadcast (collective: `save_state` calls the loader's state_dict on every rank)."""
    from accelerate.data_loader import DataLoaderDispatcher

    dist = torch.distributed
    if isinstance(loader, DataLoaderDispatcher) and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        box = [note]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return note


def is_main() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
