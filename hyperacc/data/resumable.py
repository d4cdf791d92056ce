"""A plain DataLoader prepared by accelerate, plus the position a checkpoint needs to resume it.

`prepare()` hands a plain `torch.utils.data.DataLoader` to accelerate's own `prepare_data_loader`
(same sharding, device placement, `even_batches`, RNG synchronisation and `gather_for_metrics`
bookkeeping as under accelerate) and wraps the result in `ResumableLoader`, which records where the
current epoch stands: the epoch index, the batches already yielded in it, and the random state
that decided the epoch's order (sampler generator, global torch RNG) when it began. `save_state()` stores that; after `load_state()` the next
iteration replays the same epoch order and skips the batches already trained on, so a resumed run
sees exactly the batches an uninterrupted one would.

Iterable datasets (a torch `IterableDataset` without `__len__`, a streaming `datasets` dataset) go
through accelerate's own sharding too (`IterableDatasetShard`, or `DataLoaderDispatcher` when
batches are dispatched). A stream has no random access, so its position is resumed by the stream's
own position when it keeps one (`datasets`' streaming ``IterableDataset``, any
dataset with ``state_dict()``/``load_state_dict()``): `hyperacc.data.stream_position` notes it after
every global batch read, the checkpoint stores the note of the batches trained, and the resumed
source continues with the next record — nothing is read again. Otherwise the stream is *replayed*:
the next iteration reads the batches already trained on again and drops them (accelerate's
`skip_first_batches` does the same), with the epoch number and the torch RNG of the epoch's start
restored first, and one warning names why and how to avoid it. Replay is exact for a stream that
yields the same samples when read again for the same epoch (files, `datasets` streams shuffled with
a seed and `set_epoch`, randomness drawn from torch's RNG); its cost grows with the position.

Scripts written for accelerate skip batches themselves after `load_state`
(`accelerator.skip_first_batches(loader, n)`). When such a call follows a restore, the explicit
count is used instead of the restored one, never both: see `skip_first_batches`.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch

from hyperacc.data import stream_position


class ResumableLoader:
    """Proxy around accelerate's `DataLoaderShard` / `DataLoaderDispatcher` (all attributes pass through)."""

    def __init__(self, loader, data_parallel_size: Optional[int] = None):
        self.base_loader = loader
        self._processes = data_parallel_size      # ranks reading different data (None: not known)
        if hasattr(loader, "gradient_state"):
            loader.gradient_state = _RegisterAs(loader.gradient_state, self)
        self._batches_in_epoch = 0
        self._epoch_start: Optional[dict] = None   # random state when the current epoch began
        self._pending: Optional[dict] = None   # restored position, applied by the next __iter__
        self._tracker, self._no_position = None, None   # a stream's own position (stream_position)
        if self._length() is None:
            self._tracker, self._no_position = stream_position.attach(loader, self._stream_batch())

    # ------------------------------------------------------------------ iteration
    @property
    def epoch(self) -> int:
        """Index of the current epoch (accelerate's `iteration`: epochs finished so far)."""
        return int(getattr(self.base_loader, "iteration", 0))

    def __len__(self) -> int:
        return len(self.base_loader)       # TypeError for an iterable dataset without len(), as torch's

    def __bool__(self) -> bool:
        return True                         # never asks len(): a stream has none

    def _length(self) -> Optional[int]:
        """Batches per epoch; None for a stream (an iterable dataset without len(): it ends when it ends)."""
        try:
            return len(self.base_loader)
        except TypeError:
            return None

    def __iter__(self):
        replay = self._pending
        self._pending = None
        if replay is not None:
            self.base_loader.iteration = int(replay["epoch"])
        self._epoch_start = replay.get("random_state") if replay is not None else self._random_state()
        skip = int(replay["batches"]) if replay is not None else 0
        self._batches_in_epoch = skip
        if skip and self._length() is None:
            if self._tracker is not None and replay.get("stream") is not None:
                self._tracker.source.load_state_dict(replay["stream"])    # continues after the batches trained
                self._tracker.first, skip, replay = skip, 0, None
            else:
                self._warn_replay(skip, int(replay["epoch"]))
        previous_skip = getattr(self.base_loader, "skip_batches", 0)
        self.base_loader.skip_batches = skip
        try:
            batches = iter(self.base_loader)
            if replay is not None:
                batches = self._replayed(batches, replay)
            for batch in batches:
                self._batches_in_epoch += 1
                yield batch
            # Epoch finished: the next position is the next epoch's start, whose order is drawn
            # from the random state of that moment (state_dict() then records the current one).
            self._batches_in_epoch = 0
            self._epoch_start = None
        finally:
            self.base_loader.skip_batches = previous_skip

    def _warn_replay(self, batches: int, epoch: int) -> None:
        why = self._no_position or ("the checkpoint holds no position of the stream (saved before hyperacc kept "
                                    "one, or where it could not): checkpoints saved from now on resume without it")
        if stream_position.is_main():
            warnings.warn(f"Resuming the stream by reading again the {batches} batches already trained in epoch "
                          f"{epoch}, because {why}.")

    def _random_state(self) -> dict:
        """What decides an epoch's order: the sampler's generator and the global torch RNG (a
        sampler without a generator, and the DataLoader's worker seed, draw from it)."""
        generator = self._generator()
        return {"torch": torch.get_rng_state(), "generator": generator.get_state() if generator is not None else None}

    def _replayed(self, batches, replay: dict):
        """Start the epoch from the random state it had when it first began.

        Mid-epoch, the checkpoint's RNG bucket restored a later global state (the epoch-start draws
        are in it): the global RNG is set back for the epoch's first draws, then given that state
        again. At an epoch boundary the restored global state *is* the epoch-start state: it is left
        alone (resetting it after the draws would replay them). The sampler's own generator is not
        in the RNG bucket: it is always restored here.
        """
        start = replay.get("random_state") or {}
        generator = self._generator()
        if generator is not None and start.get("generator") is not None:
            generator.set_state(start["generator"])
        if int(replay["batches"]) == 0 or start.get("torch") is None:
            yield from batches
            return
        restored = torch.get_rng_state()
        torch.set_rng_state(start["torch"])
        try:
            first = next(batches)
        except StopIteration:
            return
        finally:
            torch.set_rng_state(restored)
        yield first
        yield from batches

    def _generator(self) -> Optional[torch.Generator]:
        return getattr(self.base_loader, "synchronized_generator", None)

    # ------------------------------------------------------------------ checkpoint
    def _stateful(self) -> bool:
        return bool(getattr(self.base_loader, "use_stateful_dataloader", False))

    def state_dict(self) -> dict:
        if self._stateful() and self._length() is not None:
            return {"stateful": self.base_loader.state_dict()}    # a stream's position is this loader's own
        start = self._epoch_start if self._epoch_start is not None else self._random_state()
        length = self._length()
        state = {"epoch": self.epoch, "batches": self._batches_in_epoch, "random_state": start,
                 "length": length, "global_batch": self._global_batch()}
        if length is None:
            # A stream's last batch is known only once it was read: accelerate flags it before yielding it.
            state["at_end"] = bool(self._batches_in_epoch and getattr(self.base_loader, "end_of_dataloader", False))
            state["split"] = self._stream_split()
            if self._tracker is not None:
                batches = self._batches_in_epoch if not state["at_end"] else 0
                state["stream"] = stream_position.shared_note(
                    self.base_loader, self._tracker.note(batches) if batches else None)
        return state

    def _global_batch(self) -> Optional[int]:
        """Samples one batch index covers over all data-parallel ranks (per-rank batch x ranks)."""
        if self._length() is None:
            return self._stream_batch()
        try:
            return int(self.base_loader.total_batch_size)
        except (AttributeError, TypeError):
            return None

    def _stream_batch(self) -> Optional[int]:
        """For a stream: the samples global batch ``k`` covers when it is the stream's ``k``-th run of
        that many samples (accelerate's `DataLoaderDispatcher`, its `IterableDatasetShard`, or one
        process reading alone); None when each rank reads shards of its own (`datasets`' ``shard()``),
        where a position does not carry over to another split. (accelerate's ``total_batch_size``
        counts one rank's batch for an `IterableDatasetShard`: not used here.)"""
        from accelerate.data_loader import DataLoaderDispatcher, IterableDatasetShard

        loader = self.base_loader
        if isinstance(loader, DataLoaderDispatcher):
            return loader.batch_size if loader.split_batches else loader.batch_size * loader.state.num_processes
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, IterableDatasetShard):
            return dataset.batch_size if dataset.split_batches else dataset.batch_size * dataset.num_processes
        if self._processes == 1 and getattr(loader, "batch_size", None):
            return int(loader.batch_size)
        return None

    def _stream_split(self) -> list:
        """How a stream is split over the ranks: [per-rank batch, data-parallel ranks]."""
        return [getattr(self.base_loader, "batch_size", None), self._processes]

    def load_state_dict(self, state: dict) -> None:
        if "stateful" in state:
            self.base_loader.load_state_dict(state["stateful"])
            return
        state = dict(state)
        saved, now = state.get("length"), self._length()
        if (saved is None) != (now is None):
            kind = ["a stream (an iterable dataset without len())", "{} batches per epoch"]
            raise ValueError(
                f"The checkpoint's train DataLoader read {kind[saved is not None].format(saved)}, this one reads "
                f"{kind[now is not None].format(now)}: its position cannot be restored. Keep the kind of dataset "
                "of the saved run, or start from step 0.")
        if saved is None:
            if state.get("global_batch") != self._global_batch() or (
                    self._global_batch() is None and state.get("split") != self._stream_split()):
                state["batches"] = self._converted_stream_position(state)
        elif int(saved) != now:
            state["batches"] = self._converted_position(state)
        self._pending = state
        self.base_loader.iteration = int(state["epoch"])

    def _converted_stream_position(self, state: dict) -> int:
        """A stream's position when only the split of its batches over the ranks changed: samples
        read so far, in this loader's global batches. Else one clear error."""
        saved, now = state.get("global_batch"), self._global_batch()
        samples = int(state["batches"]) * saved if saved else None
        if saved and now and samples % now == 0:
            return samples // now
        raise ValueError(
            f"The checkpoint's train DataLoader read its stream in global batches of {saved or 'per-rank shards'}"
            f" ({int(state['batches'])} batches into epoch {int(state['epoch'])}), this one reads "
            f"{now or 'per-rank shards'}: the position cannot be restored exactly. Keep the batch over all "
            "data-parallel processes (per-rank batch x processes) and, with per-rank shards, the number of "
            "processes of the saved run, or start from step 0.")

    def _converted_position(self, state: dict) -> int:
        """The saved position in this loader's batches, when only the split of the same sample order
        into per-rank batches changed (another number of processes or per-rank batch size: the epoch
        and the position, counted in samples, stay whole numbers of batches). Else one clear error."""
        saved, now = state.get("global_batch"), self._global_batch()
        samples = int(state["batches"]) * saved if saved else None
        if saved and now and int(state["length"]) * saved == len(self.base_loader) * now and samples % now == 0:
            return samples // now
        raise ValueError(
            f"The checkpoint's train DataLoader had {state['length']} batches per epoch, this one has "
            f"{len(self.base_loader)}: its position cannot be restored exactly. Keep the dataset and the batch "
            "over all data-parallel processes (per-rank batch x processes) of the saved run, or start from step 0.")

    def restored_position(self) -> Optional[tuple]:
        """(epoch, batches already trained in it) that the next iteration starts from after
        `load_state`, or None when nothing was restored. A position at the very end of an epoch is
        the start of the next one: that is where a loop asking for the next epoch continues."""
        if self._pending is None or "epoch" not in self._pending:
            return None
        epoch, batches = int(self._pending["epoch"]), int(self._pending["batches"])
        length = self._length()
        if batches and (self._pending.get("at_end") if length is None else batches >= length):
            self._pending = {"epoch": epoch + 1, "batches": 0, "random_state": None}
            self.base_loader.iteration = epoch + 1
            return epoch + 1, 0
        return epoch, batches

    def skip_first_batches(self, num_batches: int):
        """accelerate's `skip_first_batches`, aware of a position restored by `load_state`.

        After a restore, an explicit count replaces the restored one (the order of the epoch is still
        the restored one); without a restore it is exactly accelerate's function.
        """
        if self._pending is None:
            from accelerate.data_loader import skip_first_batches

            return skip_first_batches(self.base_loader, num_batches=num_batches)
        if int(self._pending["batches"]) != int(num_batches):
            warnings.warn(
                f"skip_first_batches({num_batches}) after load_state restored the loader at batch "
                f"{self._pending['batches']} of epoch {self._pending['epoch']}: using your count. "
                "hyperacc restores the position itself, so the call is not needed.")
            self._pending["batches"] = int(num_batches)
        return self

    def __getattr__(self, name):
        if name == "base_loader":        # not yet set (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.base_loader, name)

    def __setstate__(self, state):
        self.__dict__.update(state)
        if hasattr(self.base_loader, "gradient_state"):     # registered as the proxy again
            self.base_loader.gradient_state = _RegisterAs(self.base_loader.gradient_state, self)


class _RegisterAs:
    """accelerate's GradientState as the wrapped loader sees it: where the loader registers itself
    as the active dataloader (`begin`/`end` of its iteration) the proxy the user holds is registered
    instead. The user's loop therefore finds its own object in `gradient_state.active_dataloader`
    (accelerate's scripts assert identity), `end_of_dataloader`/`remainder` read through the proxy,
    and nested and broken loops register and unregister exactly when accelerate's would.
    `_add_dataloader`/`_remove_dataloader` are accelerate's private registration methods: it has no
    public one, and these are what its own DataLoaderShard calls."""

    def __init__(self, state, proxy: ResumableLoader):
        self._state = state
        self._proxy = weakref.ref(proxy)     # the loader holds this: no strong cycle back to the proxy

    def _registered(self, dataloader):
        # Compared with None, never by truth value: that would ask the proxy its len(), which an
        # iterable dataset without __len__ does not have.
        proxy = self._proxy()
        return dataloader if proxy is None else proxy

    def _add_dataloader(self, dataloader):
        self._state._add_dataloader(self._registered(dataloader))

    def _remove_dataloader(self, dataloader):
        self._state._remove_dataloader(self._registered(dataloader))

    def __getattr__(self, name):
        if name == "_state":             # not yet set (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self._state, name)

    def __reduce__(self):                # a pickled loader gets accelerate's plain GradientState back
        return type(self._state), ()


def prepare_plain_loader(accelerator, data_loader, device_placement=None, slice_fn_for_dispatch=None):
    """accelerate's own `prepare_data_loader`, sharded over the data-parallel ranks (not every rank:
    tensor/expert-parallel peers read the same data), wrapped to resume its position.

    accelerate dispatches the batches of an iterable dataset by default (`DataLoaderDispatcher`: the
    main process reads, every process gets a slice). The dispatcher slices over *all* processes, so
    where some of them must read the same samples (fewer data-parallel ranks than processes) each
    data-parallel rank reads its own share instead (`IterableDatasetShard`), and an explicit
    ``dispatch_batches=True`` is refused."""
    from accelerate.data_loader import prepare_data_loader

    dispatch = accelerator.dispatch_batches
    if accelerator.dp_size != accelerator.num_processes:
        if dispatch:
            raise ValueError(
                f"DataLoaderConfiguration(dispatch_batches=True) slices every batch over all {accelerator.num_processes} "
                f"processes, but only {accelerator.dp_size} of them are data-parallel ranks (tensor/context/expert-"
                "parallel peers read the same samples): set dispatch_batches=False (each data-parallel rank then "
                "reads its own share).")
        dispatch = False
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=accelerator.dp_size, process_index=accelerator.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement if device_placement is None else device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=dispatch,
        even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    return ResumableLoader(prepared, data_parallel_size=accelerator.dp_size)
