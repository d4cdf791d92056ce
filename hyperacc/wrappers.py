"""What `prepare()` does to optimizers, schedulers and plain DataLoaders.

`fully_shard` replaces a model's parameters with new DTensor parameters, so an optimizer built
before `prepare` would keep updating the old tensors and the model would never train. Optimizers
are therefore rebound, group by group, to the sharded parameters with the same names.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


class ParameterMap:
    """Remembers, for every prepared model, which sharded parameter replaced which original one."""

    def __init__(self):
        self._replaced: Dict[int, tuple] = {}      # id(original) -> (weakref(original), sharded)
        self._sharded_ids: set = set()

    def record(self, model: torch.nn.Module, originals: Dict[str, torch.Tensor]) -> None:
        """``originals``: name -> parameter before sharding; ``model``: after sharding."""
        sharded = dict(model.named_parameters())
        for name, original in originals.items():
            self._replaced[id(original)] = (weakref.ref(original), sharded[name])
        self._sharded_ids.update(id(p) for p in sharded.values())

    def lookup(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        if id(param) in self._sharded_ids:
            return param
        entry = self._replaced.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return None


def rebind_optimizer(optimizer: torch.optim.Optimizer, params: ParameterMap) -> None:
    """Point every param group of ``optimizer`` at the sharded parameters, in place.

    Groups and their hyperparameters (lr, betas, weight decay...) are kept as they are.
    """
    if any(len(state) for state in optimizer.state.values()):
        raise ValueError("The optimizer already has state (it has stepped): prepare it before the "
                         "first optimizer.step(), or build it after prepare(model).")
    for group_index, group in enumerate(optimizer.param_groups):
        rebound = []
        for param in group["params"]:
            sharded = params.lookup(param)
            if sharded is None:
                raise ValueError(
                    f"The optimizer's param group {group_index} holds a parameter of shape "
                    f"{tuple(param.shape)} that is not in any prepared model. Build the optimizer from "
                    "model.parameters() of the model you prepare, and prepare the model in the same "
                    "call or before the optimizer.")
            rebound.append(sharded)
        group["params"] = rebound
    optimizer.state.clear()


class PreparedOptimizer:
    """An optimizer that skips `step`/`zero_grad` while gradients are still being accumulated."""

    def __init__(self, optimizer: torch.optim.Optimizer, should_step: Callable[[], bool],
                 on_step: Optional[Callable[[], None]] = None):
        self.optimizer = optimizer
        self._should_step = should_step
        self._on_step = on_step
        self.step_was_skipped = False

    def step(self, closure=None):
        if not self._should_step():
            self.step_was_skipped = True
            return None
        self.step_was_skipped = False
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if self._on_step is not None:
            self._on_step()
        return result

    def zero_grad(self, set_to_none: bool = True):
        if self._should_step():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self):
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the wrapped LR scheduler exactly once per real optimizer step (never per process)."""

    def __init__(self, scheduler, optimizers):
        self.scheduler = scheduler
        self._optimizers = optimizers

    def step(self, *args, **kwargs):
        if any(opt.step_was_skipped for opt in self._optimizers):
            return
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class ShardedDataLoader:
    """A plain DataLoader re-made over a DistributedSampler: each DP rank sees a disjoint slice.

    The order is deterministic (seed + epoch); the epoch advances each time iteration starts.
    ``on_last_batch`` is told when the final batch is yielded so that accumulation can flush.
    """

    def __init__(self, loader: DataLoader, *, dp_rank: int, dp_size: int, seed: int,
                 on_last_batch: Optional[Callable[[bool], None]] = None):
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise TypeError("prepare() cannot shard an IterableDataset DataLoader deterministically: "
                            "use a map-style dataset, or MicroBatchDataLoader.")
        self.sampler = DistributedSampler(
            loader.dataset, num_replicas=dp_size, rank=dp_rank,
            shuffle=isinstance(loader.sampler, RandomSampler), seed=seed, drop_last=loader.drop_last)
        self.loader = DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=self.sampler,
            collate_fn=loader.collate_fn, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
            drop_last=loader.drop_last, worker_init_fn=loader.worker_init_fn)
        self.dataset = loader.dataset
        self._on_last_batch = on_last_batch
        self.epoch = 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        total = len(self.loader)
        for index, batch in enumerate(self.loader):
            if self._on_last_batch is not None:
                self._on_last_batch(index == total - 1)
            yield batch
        if self._on_last_batch is not None:
            self._on_last_batch(False)
