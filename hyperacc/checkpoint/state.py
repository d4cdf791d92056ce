"""What a checkpoint holds: a dict of `Stateful` objects, one small class per bucket, a user's own objects beside them.

Why a dict of objects with ``state_dict()`` / ``load_state_dict()``: it is the shape the ecosystem
checkpoints (torch's `torch.distributed.checkpoint.stateful.Stateful` protocol; torchtitan keeps its
``self.states`` so, Lightning Fabric saves ``fabric.save(path, state)``, accelerate's
``register_for_checkpointing`` takes any object with the two methods). Each bucket says in one class what
it saves and how it goes back; the `Checkpointer` around them (integrity manifest, single-writer lock,
lifecycle, discovery, the load plan checked on rank 0) is storage and knows no bucket's insides. A user's
registered object joins the same dict and is saved and restored at the same points, under the same
integrity manifest, with its count checked before anything loads.

Where a bucket's state lives is its ``storage``:
  ``DCP``       sharded tensors in the DCP payload under the dict key (``model``, ``model_1``, ``optimizer``,
                ...): DCP reshards them on load (model, optimizer);
  ``SHARED``    plain values identical on every rank (``progress``, ``schedulers``, ``loader``), saved together
                as the "extra state" (embedded in the DCP payload as one byte tensor, or in each rank's
                ``extra_state/extra_state_rank_<R>.pt``);
  ``PER_RANK``  this rank's own state (``rng``), in its extra_state file only;
  anything else (a registered object) is accelerate's ``custom_checkpoint_<i>.pkl``, written by the main process.
The dict key is the name on disk and the dict's order the order written, so the files are the ones written
before these classes existed (the lr_scheduler bucket is ``schedulers`` there, the dataloader ``loader``):
older checkpoints load, and every file of a checkpoint written now but DCP's ``.metadata`` (which holds a save
id) and the manifest that lists its digest is byte-for-byte what the previous version wrote for the same state.
Building the dict costs ~10 us a save; the save and load times of a tiny model were unchanged (1.00-1.03x).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from hyperacc.checkpoint import _comm, buckets, custom_objects, optim_state, rng
from hyperacc.runtime.progress import Progress

DCP, SHARED, PER_RANK, FILE = "dcp", "shared", "per_rank", "file"


@dataclasses.dataclass
class TrainState:
    """The run's live objects and the facts a checkpoint records with them (built fresh by the Accelerator
    for each call); `states` turns it into the dict of Stateful buckets that is saved and restored."""

    models: list
    optimizers: list
    schedulers: list
    loader: object = None
    progress: Progress = dataclasses.field(default_factory=Progress)
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    precision: str = "fp32_master"      # the recipe (hyperacc.precision), recorded with every save
    custom_objects: list = dataclasses.field(default_factory=list)   # accelerate's register_for_checkpointing

    def states(self, *, adapters_only: bool = False, optimizers: bool = True,
               device_type: str = "cpu") -> Dict[str, Stateful]:
        """The buckets, keyed and ordered as on disk. ``adapters_only``: the model buckets hold the
        trainable tensors only (PEFT); ``optimizers``: whether the optimizer buckets take part (a save
        with ``save_optimizer=False``, a load with ``restore_optimizer=False``)."""
        models = buckets.as_list(self.models)
        opts = buckets.as_list(self.optimizers) if optimizers else []
        states: Dict[str, Stateful] = {buckets.model_key(i): ModelBucket(m, adapters_only=adapters_only)
                                       for i, m in enumerate(models)}
        for i, optimizer in enumerate(opts):
            states[buckets.optimizer_key(i)] = OptimizerBucket(optimizer, buckets.optimizer_owner(models, i, len(opts)))
        states["progress"] = ProgressBucket(self.progress)
        states["schedulers"] = SchedulersBucket(buckets.as_list(self.schedulers))
        states["loader"] = LoaderBucket(self.loader, self.progress)
        states["rng"] = RngBucket(device_type)
        for i, obj in enumerate(self.custom_objects):
            states[custom_objects.key(i)] = obj
        return states


def storage_of(obj) -> str:
    """Where ``obj``'s state lives: a built-in bucket says; a registered object is a file of its own."""
    return obj.storage if isinstance(obj, Bucket) else FILE


def select(states: Dict[str, Stateful], storage: str, kind: Optional[type] = None) -> Dict[str, Stateful]:
    """The entries of ``states`` kept in ``storage`` (and of class ``kind``), in order."""
    return {k: v for k, v in states.items() if storage_of(v) == storage and (kind is None or isinstance(v, kind))}


def state_dicts(states: Dict[str, Stateful], storage: str) -> dict:
    return {k: v.state_dict() for k, v in select(states, storage).items()}


class Bucket(Stateful):
    """A built-in bucket: `Stateful`, plus where its state lives (``DCP``, ``SHARED`` or ``PER_RANK``: module
    docstring)."""

    storage: str = ""

    def state_dict(self):
        raise NotImplementedError

    def load_state_dict(self, state_dict) -> None:
        raise NotImplementedError


class ModelBucket(Bucket):
    """A model's parameters and buffers as DTensor shards (nothing gathered), a tied parameter once under its
    kept key, a PEFT model's trainable tensors only (`buckets.model_state`). ``state_dict()`` is also the
    load template DCP reads into, as DCP's Stateful protocol has it."""

    storage = DCP

    def __init__(self, model, *, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only

    def state_dict(self) -> dict:
        return buckets.model_state(self.model, trainable_only=self.adapters_only)

    def load_state_dict(self, state_dict: dict) -> None:
        buckets.restore_model(self.model, state_dict, strict=not self.adapters_only)

    def tied(self) -> Dict[str, str]:
        return buckets.tied_aliases(self.model)


class OptimizerBucket(Bucket):
    """An optimizer's state by parameter name, exactly as it is (`optim_state`: never primed). The load
    template holds only the entries the checkpoint has (`load_template`); ``load_state_dict`` takes
    ``{"state": ..., "param_groups": [saved groups]}``, the groups checked against these by the load plan."""

    storage = DCP

    def __init__(self, optimizer, owner):
        self.optimizer, self.owner = optimizer, owner

    def state_dict(self) -> dict:
        return optim_state.optimizer_state(self.owner, self.optimizer)

    def group_names(self) -> List[List[str]]:
        return optim_state.group_names(self.owner, self.optimizer)

    def load_template(self, structure: dict) -> dict:
        return optim_state.state_template(self.owner, self.optimizer, structure)

    def load_state_dict(self, state_dict: dict) -> None:
        optim_state.apply(self.owner, self.optimizer, state_dict, state_dict["param_groups"])


class ProgressBucket(Bucket):
    """global_step, epoch, consumed samples and tokens."""

    storage = SHARED

    def __init__(self, progress: Progress):
        self.progress = progress

    def state_dict(self) -> dict:
        return self.progress.state_dict()

    def load_state_dict(self, state_dict: Optional[dict]) -> None:
        if state_dict is None:      # every hyperacc extra state holds it
            raise KeyError("progress: the checkpoint's training state has no progress bucket")
        self.progress.load_state_dict(state_dict)


class SchedulersBucket(Bucket):
    """The lr_scheduler(s), in order. Fewer or more than saved: the pairs in order, with a warning.
    ``optimizer_restored`` (set by the load): when False the param groups still hold the initial LR, so
    the restored schedule writes its last LR into them and continues."""

    storage = SHARED

    def __init__(self, schedulers: list):
        self.schedulers, self.optimizer_restored = schedulers, True

    def state_dict(self) -> list:
        return [_plain(s.state_dict()) for s in self.schedulers]

    def load_state_dict(self, state_dict: Optional[list]) -> None:
        saved = state_dict or []
        if len(saved) != len(self.schedulers):
            buckets.warn0(f"The checkpoint holds {len(saved)} lr_scheduler(s) but training has {len(self.schedulers)}: "
                          f"restoring the first {min(len(saved), len(self.schedulers))} pair(s) in order, the rest "
                          "start fresh.")
        for scheduler, scheduler_state in zip(self.schedulers, saved):
            scheduler.load_state_dict(scheduler_state)
            if not self.optimizer_restored and hasattr(scheduler, "get_last_lr"):
                for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                    group["lr"] = lr


class LoaderBucket(Bucket):
    """The train loader's position (None when it keeps none); its epoch is the progress bucket's epoch.
    The loader validates what it is given (e.g. a changed batch size)."""

    storage = SHARED

    def __init__(self, loader, progress: Progress):
        self.loader, self.progress = loader, progress

    def state_dict(self) -> Optional[dict]:
        loader = self.loader
        return _plain(loader.state_dict()) if loader is not None and hasattr(loader, "state_dict") else None

    def load_state_dict(self, state_dict: Optional[dict]) -> None:
        loader = self.loader
        if loader is None or not hasattr(loader, "load_state_dict"):
            return
        if state_dict is None:
            buckets.warn0("The checkpoint holds no train-loader state: the loader starts from its beginning.")
        else:
            loader.load_state_dict(state_dict)
        if getattr(loader, "epoch", None) is not None:
            self.progress.epoch = int(loader.epoch)


class RngBucket(Bucket):
    """This rank's generators (torch CPU and device, python, numpy: `rng`). When they cannot be mapped onto
    the ranks (another topology, or a layout that keeps none) the load re-derives them (`rederive`)."""

    storage = PER_RANK

    def __init__(self, device_type: str):
        self.device_type = device_type

    def state_dict(self) -> dict:
        return rng.get_rng_state(self.device_type)

    def load_state_dict(self, state_dict: dict) -> None:
        rng.set_rng_state(state_dict, self.device_type)

    def rederive(self, seed: int, step: int) -> int:
        return rng.rederive_rng(seed, step, _comm.rank(), self.device_type)


def _plain(obj):
    """numpy values -> Python/tensors so that the state loads with weights_only=True."""
    if isinstance(obj, dict):
        return type(obj)((k, _plain(v)) for k, v in obj.items()) if type(obj) is not dict else {
            k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
