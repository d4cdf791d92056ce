"""The stateful micro-batch loader: one item = the micro-batches of one optimizer step.

Order. The samples of global step ``s`` of epoch ``e`` are positions ``[s*G, (s+1)*G)`` of the
epoch's order, ``G = global_batch_size``. The order is ``range(n)`` or, with ``shuffle=True``, a
``torch.randperm(n)`` drawn from a private generator seeded from ``(seed, e)``. It depends on
nothing else: not on the data-parallel size, not on the micro-batch size, not on the global RNG.
DP rank ``r`` of ``d`` takes the ``r``-th contiguous block of ``G // d`` sample ids of the step and
cuts it into micro-batches of ``micro_batch_size``.

State. ``state_dict()`` is ``(epoch, step)`` plus what is needed to check that a resume is exact
(seed, global batch size, dataset fingerprint). Resuming is index arithmetic: nothing skipped is
read or collated, so it costs the same at step 1 and at step 10**6. Because the order does not
depend on the DP size or the micro-batch size, a state saved at one DP size / micro-batch size
resumes exactly at another.

``drop_last=False``: the final step of an epoch is completed to a full global batch by wrapping
around to the start of the same epoch's order (like ``DistributedSampler`` pads). Every step thus
has the same number of micro-batches of the same size on every rank, which FSDP collectives need;
the price is that ``G - n % G`` samples are seen twice in that epoch.
"""
from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from hyperacc.data.collate import check_batch, default_collate
from hyperacc.data.prefetch import Prefetcher
from hyperacc.errors import DataResumeMismatch  # noqa: F401 - defined with every error class

__all__ = ["DataResumeMismatch", "MicroBatchDataLoader", "STATE_VERSION", "check_rank", "micro_batches_per_step"]

STATE_VERSION = 1
_PERM_CACHE = 2          # epochs whose permutation is kept (the current one and one looked up)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), the same in every process and Python run."""
    digest = hashlib.blake2b(f"hyperacc.loader:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _map_style_length(dataset) -> int:
    """len(dataset) of a map-style dataset. Step mode draws each step's samples by index from a
    per-epoch order, which a stream (an iterable dataset) cannot give: refused, naming what works."""
    length = None
    if not isinstance(dataset, torch.utils.data.IterableDataset) and (hasattr(dataset, "__getitem__")
                                                                      or hasattr(dataset, "__getitems__")):
        try:
            length = len(dataset)
        except TypeError:
            pass
    if length is None:
        raise TypeError(
            f"MicroBatchDataLoader needs a map-style dataset (len() and dataset[i]); {type(dataset).__name__} is "
            "iterable: pass map-style data (e.g. datasets' load_dataset without streaming=True), or a "
            "torch.utils.data.DataLoader over the iterable dataset to Accelerator.prepare() with "
            "gradient_accumulation_steps.")
    return int(length)


def micro_batches_per_step(global_batch_size: int, micro_batch_size: int, dp_size: int = 1) -> int:
    """Micro-batches each DP rank runs per optimizer step: the one place the divisibility rule lives
    (the loader, the example's config checks and its dry run all ask here)."""
    g, m, unit = global_batch_size, micro_batch_size, micro_batch_size * dp_size
    if g % unit:
        lower, upper = (g // unit) * unit, (g // unit + 1) * unit
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"global_batch_size={g} is not divisible by micro_batch_size={m} * dp_size={dp_size} "
            f"(= {unit}): every DP rank must get the same whole number of micro-batches per step. "
            f"Fix: set global_batch_size to a multiple of {unit} (e.g. {options}), or pick a "
            f"micro_batch_size that divides global_batch_size / dp_size")
    return g // unit


def check_rank(dp_rank: int, dp_size: int, global_batch_size: int, micro_batch_size: int) -> None:
    """What ``bind(dp_rank, dp_size)`` of a step loader accepts (this one's and the stream's)."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}")
    micro_batches_per_step(global_batch_size, micro_batch_size, dp_size)


class MicroBatchDataLoader:
    """Yield, per optimizer step, this DP rank's micro-batches (``list[dict[str, Tensor]]``).

    Args:
        dataset: a map-style dataset (``len()`` and ``dataset[i]``; ``__getitems__`` is used when present).
        global_batch_size: samples per optimizer step over all DP ranks.
        micro_batch_size: samples per micro-batch (per forward/backward).
        collate_fn: list of samples -> mapping of tensors; default :func:`default_collate`.
        shuffle: shuffle per epoch with a private generator seeded from ``(seed, epoch)``.
        seed: the order's seed (part of the state).
        drop_last: drop the incomplete final step (default); ``False`` completes it by wrapping around.
        num_workers: ``> 0`` collates micro-batches in ``torch.utils.data.DataLoader`` worker processes.
        prefetch: collate the next items in a background thread (bounded queue of 2 items).
        resume_mismatch: ``"error"`` (default) or ``"restart"``: what ``load_state_dict`` does when
            the saved global batch size or dataset fingerprint differs from the current one.

    ``bind(dp_rank, dp_size)`` (called by ``prepare()``) selects this rank's share; unbound = rank 0 of 1.
    """

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int,
                 collate_fn: Callable[[list], Mapping] | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, num_workers: int = 0, prefetch: bool = False,
                 resume_mismatch: str = "error"):
        self._global_batch_size = _positive_int("global_batch_size", global_batch_size)
        self._micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if resume_mismatch not in ("error", "restart"):
            raise ValueError(f"resume_mismatch must be 'error' or 'restart', got {resume_mismatch!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
        num_samples = _map_style_length(dataset)
        if drop_last and num_samples < self._global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than global_batch_size="
                             f"{self._global_batch_size}: with drop_last=True an epoch has no step; "
                             "lower global_batch_size or pass drop_last=False")
        if num_samples == 0:
            raise ValueError("the dataset is empty")
        self._dataset = dataset
        self._num_samples = int(num_samples)
        self._collate = collate_fn if collate_fn is not None else default_collate
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._drop_last = bool(drop_last)
        self.num_workers = num_workers
        self.prefetch = bool(prefetch)
        self.resume_mismatch = resume_mismatch
        self._epoch = 0
        self._step = 0
        self._generation = 0          # bumped whenever the position or the rank changes
        self._perm_lock = threading.Lock()
        self._perms: dict[tuple, torch.Tensor] = {}    # (seed, epoch, n) -> permutation, oldest first
        self._dp_rank, self._dp_size = 0, 1
        self.bind(0, 1)

    # ------------------------------------------------------------------ configuration
    def bind(self, dp_rank: int, dp_size: int) -> "MicroBatchDataLoader":
        """Take DP rank ``dp_rank`` of ``dp_size``'s share of every step; returns self.

        May be called again (e.g. after ``load_state_dict`` at a new DP size) before iterating.
        """
        check_rank(dp_rank, dp_size, self._global_batch_size, self._micro_batch_size)
        self._dp_rank, self._dp_size = dp_rank, dp_size
        self._generation += 1
        return self

    @property
    def dataset(self):
        return self._dataset

    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self._micro_batch_size

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def micro_batches_per_step(self) -> int:
        return self._global_batch_size // (self._micro_batch_size * self._dp_size)

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def epoch(self) -> int:
        """The epoch of the next step to be consumed."""
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        """Steps of the current epoch already consumed (= index of the next step)."""
        return self._step

    def __len__(self) -> int:
        """Optimizer steps per epoch."""
        n, g = self._num_samples, self._global_batch_size
        return n // g if self._drop_last else -(-n // g)

    def __repr__(self) -> str:
        return (f"MicroBatchDataLoader(len={len(self)}, global_batch_size={self._global_batch_size}, "
                f"micro_batch_size={self._micro_batch_size}, dp_rank={self._dp_rank}, "
                f"dp_size={self._dp_size}, epoch={self._epoch}, step_in_epoch={self._step})")

    # ------------------------------------------------------------------ order
    def _permutation(self, epoch: int) -> torch.Tensor:
        key = (self._seed, epoch, self._num_samples)
        with self._perm_lock:
            perm = self._perms.pop(key, None)
            if perm is None:
                gen = torch.Generator()
                gen.manual_seed(_epoch_seed(self._seed, epoch))
                perm = torch.randperm(self._num_samples, generator=gen)
                while len(self._perms) >= _PERM_CACHE:
                    self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm                  # most recently used last
            return perm

    def _step_ids(self, epoch: int, step: int) -> torch.Tensor:
        """The global_batch_size dataset indices of (epoch, step), as an int64 tensor."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        steps = len(self)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < steps:
            raise ValueError(f"step must be an int in [0, {steps}), got {step!r}")
        n, g = self._num_samples, self._global_batch_size
        start = step * g
        if start + g <= n:
            if self._shuffle:
                return self._permutation(epoch)[start:start + g]
            return torch.arange(start, start + g, dtype=torch.int64)
        positions = torch.arange(start, start + g, dtype=torch.int64) % n   # drop_last=False tail
        return self._permutation(epoch)[positions] if self._shuffle else positions

    def global_step_indices(self, epoch: int, step: int) -> list[int]:
        """The ``global_batch_size`` dataset indices of global step ``step`` of epoch ``epoch``."""
        return self._step_ids(epoch, step).tolist()

    def _rank_chunks(self, epoch: int, step: int, dp_rank: int, dp_size: int,
                     micro_batch_size: int) -> list[list[int]]:
        per_rank = self._global_batch_size // dp_size
        mine = self._step_ids(epoch, step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return mine.view(-1, micro_batch_size).tolist()

    # ------------------------------------------------------------------ reading
    def _fetch(self, ids: list[int]) -> list:
        getitems = getattr(self._dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(ids))
        return [self._dataset[i] for i in ids]

    def _collate_checked(self, samples: list):
        return check_batch(self._collate(samples))

    def _make_item(self, epoch: int, step: int, plan: tuple[int, int, int]) -> list:
        return [self._collate_checked(self._fetch(ids)) for ids in self._rank_chunks(epoch, step, *plan)]

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Iterate the remaining steps of the current epoch (all of it unless resumed mid-epoch)."""
        self._generation += 1
        generation = self._generation
        epoch, steps = self._epoch, range(self._step, len(self))
        plan = (self._dp_rank, self._dp_size, self._micro_batch_size)
        if self.num_workers > 0:
            source = self._worker_items(epoch, steps, plan)       # workers already read ahead
        elif self.prefetch:
            source = Prefetcher(lambda s: self._make_item(epoch, s, plan), steps)
        else:
            source = (self._make_item(epoch, s, plan) for s in steps)
        return self._consume(generation, epoch, steps, source)

    def _consume(self, generation: int, epoch: int, steps: range, source: Iterator):
        try:
            for step, item in zip(steps, source):
                if self._generation != generation:
                    raise RuntimeError(
                        "MicroBatchDataLoader: the loader was re-bound, its state loaded, or a newer "
                        "iterator started while this iterator was active; start a new `for` loop")
                # The item is consumed by the training loop from here on: the state moves past it.
                if step + 1 >= len(self):
                    self._epoch, self._step = epoch + 1, 0
                else:
                    self._epoch, self._step = epoch, step + 1
                yield item
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _worker_items(self, epoch: int, steps: range, plan: tuple[int, int, int]):
        mbps = self._global_batch_size // (plan[1] * plan[2])
        sampler = _MicroBatchSampler(self, epoch, steps, plan, mbps)
        generator = torch.Generator()
        generator.manual_seed(_epoch_seed(self._seed, epoch))   # keeps the global RNG untouched
        dl = DataLoader(self._dataset, batch_sampler=sampler, collate_fn=self._collate,
                        num_workers=self.num_workers, generator=generator)
        it = iter(dl)
        try:
            for _ in steps:
                yield [check_batch(next(it)) for _ in range(mbps)]
        finally:
            del it      # the last reference: the iterator's __del__ stops its worker processes now

    # ------------------------------------------------------------------ state
    def _fingerprint(self) -> dict:
        fingerprint: dict[str, Any] = {"length": self._num_samples}
        extra = getattr(self._dataset, "fingerprint", None)   # optional, dataset-provided identity
        if callable(extra):
            try:
                extra = extra()
            except TypeError:                                  # not a zero-argument method: ignore
                extra = None
        if isinstance(extra, (str, int)) and not isinstance(extra, bool):
            fingerprint["id"] = extra
        return fingerprint

    def state_dict(self) -> dict:
        """Plain ints/strs, identical on every rank: where the next step starts and how to check it."""
        return {"epoch": int(self._epoch), "step": int(self._step), "seed": int(self._seed),
                "global_batch_size": int(self._global_batch_size),
                "dataset_fingerprint": self._fingerprint(), "version": STATE_VERSION}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue at the next unconsumed step of ``state`` (any DP size / micro-batch size)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state_dict expects a mapping, got {type(state).__name__}")
        missing = [k for k in ("epoch", "step", "seed", "global_batch_size", "dataset_fingerprint",
                               "version") if k not in state]
        if missing:
            raise ValueError(f"MicroBatchDataLoader state is missing {missing}; got keys {sorted(state)}")
        version = int(state["version"])
        if version > STATE_VERSION:
            raise ValueError(f"MicroBatchDataLoader state version {version} is newer than this code "
                             f"({STATE_VERSION}); upgrade hyperacc to resume it")
        epoch, step, seed = int(state["epoch"]), int(state["step"]), int(state["seed"])
        if epoch < 0 or step < 0:
            raise ValueError(f"invalid MicroBatchDataLoader state: epoch={epoch}, step={step}")
        saved_fp, current_fp = dict(state["dataset_fingerprint"]), self._fingerprint()
        saved_g = int(state["global_batch_size"])
        problems = []
        if saved_g != self._global_batch_size:
            problems.append(f"global_batch_size: saved {saved_g}, current {self._global_batch_size}")
        if saved_fp != current_fp:
            problems.append(f"dataset_fingerprint: saved {saved_fp}, current {current_fp}")
        if problems and self.resume_mismatch != "restart":
            raise DataResumeMismatch(
                f"cannot resume the data loader exactly ({'; '.join(problems)}): the saved step would "
                f"map to different samples. Fix: restore the saved value(s), or construct the loader with "
                f"MicroBatchDataLoader.resume_mismatch='restart' to restart epoch {epoch} at step 0 (the model, "
                "optimizer and progress are restored all the same)")
        steps = len(self)
        if not problems and step > steps:
            raise ValueError(f"MicroBatchDataLoader state step={step} is past the end of the epoch "
                             f"({steps} steps with drop_last={self._drop_last})")
        if seed != self._seed:
            warnings.warn(f"MicroBatchDataLoader: resuming with the saved seed {seed} instead of the "
                          f"constructor's seed {self._seed}, so that the sample order continues exactly",
                          stacklevel=2)
        self._seed = seed
        self._generation += 1
        if problems:
            what = "; ".join(problems)
            warnings.warn(f"MicroBatchDataLoader: {what}; resume_mismatch='restart': restarting "
                          f"epoch {epoch} at step 0 (samples already seen in this epoch are seen again)",
                          stacklevel=2)
            self._epoch, self._step = epoch, 0
            return
        self._epoch, self._step = (epoch + 1, 0) if step == steps else (epoch, step)


class _MicroBatchSampler:
    """Batch sampler for the worker path: this rank's micro-batch id lists for the given steps."""

    def __init__(self, loader: MicroBatchDataLoader, epoch: int, steps: range,
                 plan: tuple[int, int, int], mbps: int):
        self._loader, self._epoch, self._steps, self._plan, self._mbps = loader, epoch, steps, plan, mbps

    def __iter__(self):
        for step in self._steps:
            yield from self._loader._rank_chunks(self._epoch, step, *self._plan)

    def __len__(self) -> int:
        return len(self._steps) * self._mbps
