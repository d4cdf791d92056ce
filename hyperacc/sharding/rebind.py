"""What `prepare()` does to optimizers and step-mode schedulers.

`fully_shard` replaces a model's parameters with new DTensor parameters, so an optimizer built
before `prepare` would keep updating the old tensors and the model would never train. Optimizers
are therefore rebound, group by group, to the sharded parameters with the same names.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch


class ParameterMap:
    """Remembers, for every prepared model, which sharded parameter replaced which original one."""

    def __init__(self):
        self._replaced: Dict[int, tuple] = {}      # id(original) -> (weakref(original), sharded)
        self._sharded_ids: set = set()
        self._names: Dict[int, str] = {}           # id(sharded) -> its name before sharding

    def record(self, model: torch.nn.Module, originals: Dict[str, torch.Tensor]) -> None:
        """``originals``: name -> parameter before sharding; ``model``: after sharding."""
        sharded = dict(model.named_parameters())
        for name, original in originals.items():
            self._replaced[id(original)] = (weakref.ref(original), sharded[name])
            self._names[id(sharded[name])] = name
        self._sharded_ids.update(id(p) for p in sharded.values())

    def names(self) -> Dict[int, str]:
        """id(sharded parameter) -> the name it had before `prepare` (the same on every layout)."""
        return dict(self._names)

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


class PreparedScheduler:
    """Step mode's scheduler: steps exactly once per real optimizer step (never per process).

    With plain DataLoaders the Accelerator uses accelerate's AcceleratedScheduler instead, which
    steps as accelerate scripts expect.
    """

    def __init__(self, scheduler, optimizers, gradients=None):
        """``gradients``: the owner of the gradient-sync flag (the Accelerator's `GradientAccumulator`:
        anything with ``sync_gradients``), read at each ``step``; None: its owner steps it only after
        real optimizer steps (`Accelerator.checkpoint_scheduler`)."""
        self.scheduler = scheduler
        self._optimizers = optimizers
        self._gradients = gradients

    def step(self, *args, **kwargs):
        if self._gradients is not None and not self._gradients.sync_gradients:
            return                       # a micro-batch of an accumulation: no optimizer step happened
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
