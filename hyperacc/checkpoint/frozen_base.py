"""The frozen base of an adapters-only checkpoint (`ModelKind.saves_trainable_only`: a PEFT model's): a
fingerprint saved with it and checked on resume.

Why: such a checkpoint holds the adapters only; the base model comes back from wherever the resumed
run gets it (pretrained files, or the seed). Adapters resumed onto another base -- another
pretrained directory, another dtype, another seed -- train on silently, and wrongly. Each frozen
parameter's (numel, sum, sum of squares), accumulated in float64 over the full tensor, is recorded
in the sentinel and compared when the checkpoint is loaded: the error names the first parameter that
differs.

The fingerprint is independent of the layout (each element counted once: a rank's slice is divided
by the number of ranks holding the same slice), so a resume at another world size is checked as
well; float64 summation order differs between layouts by ~1e-16 relative, far under the tolerance.
Computed once per model and run for saves (the base never changes while training) and afresh at
each load; a pass over the frozen shards in float64 on the host, a chunk at a time.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hyperacc import kinds

RELATIVE_TOLERANCE = 1e-9
CHUNK = 1 << 20         # elements converted to float64 at a time (8 MiB)


def _copies(tensor: torch.Tensor, world: int) -> int:
    """How many ranks hold the same local slice of ``tensor``."""
    if not isinstance(tensor, DTensor):
        return world
    mesh = tensor.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(tensor.placements) if isinstance(p, Replicate))


def _frozen(model: nn.Module) -> List[tuple]:
    """(key, parameter) of the frozen floating parameters, by their base checkpoint key
    (`ModelKind.base_names`: a PEFT model's), so that a changed adapter configuration is not mistaken
    for another base."""
    keys = kinds.for_model(model).base_names(model)
    return [(keys.get(name) or name, p) for name, p in model.named_parameters()
            if not p.requires_grad and p.is_floating_point()]


@torch.no_grad()
def fingerprint(model: nn.Module, group=None) -> Dict[str, List[float]]:
    """Collective (one all-reduce): frozen parameter name -> [numel, sum, sum of squares] of the full
    tensor, identical on every rank. {} when nothing is frozen."""
    params = _frozen(model)
    if not params:
        return {}
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = torch.zeros(len(params), 3, dtype=torch.float64)
    for row, (_, param) in enumerate(params):
        data = param.to_local() if isinstance(param, DTensor) else param
        flat, copies = data.detach().reshape(-1), _copies(param, world)
        for start in range(0, flat.numel(), CHUNK):      # float64 on the host, a chunk at a time
            values = flat[start:start + CHUNK].to("cpu", torch.float64)
            local[row, 1] += values.sum()
            local[row, 2] += values.square_().sum()
        local[row] *= 1.0 / copies
        local[row, 0] = flat.numel() / copies
    if dist.is_initialized() and world > 1:
        dist.all_reduce(local, group=group)
    return {name: [round(local[row, 0].item()), local[row, 1].item(), local[row, 2].item()]
            for row, (name, _) in enumerate(params)}


def first_difference(saved: Dict[str, List[float]], live: Dict[str, List[float]]) -> Optional[str]:
    """A sentence naming the first frozen parameter that differs between ``saved`` and ``live``, or None."""
    missing = [n for n in saved if n not in live]
    if missing:
        return f"frozen parameter {missing[0]} of the checkpoint's base is not frozen (or absent) in this model"
    added = [n for n in live if n not in saved]
    if added:
        return f"frozen parameter {added[0]} of this model was not frozen (or absent) in the checkpoint's base"
    for name, (numel, total, squares) in saved.items():
        live_numel, live_total, live_squares = live[name]
        scale = RELATIVE_TOLERANCE * (squares + 1e-30)
        if (numel != live_numel or abs(live_squares - squares) > scale
                or abs(live_total - total) > RELATIVE_TOLERANCE * math.sqrt(numel * squares) + 1e-30):
            return (f"frozen parameter {name} differs (sum {live_total:.9g} vs {total:.9g} saved, sum of squares "
                    f"{live_squares:.9g} vs {squares:.9g})")
    return None


def for_models(models: List[nn.Module], group=None, cache: Optional[dict] = None) -> List[Dict[str, List[float]]]:
    """Collective: `fingerprint` of each model, reusing ``cache`` (by model identity) within a run."""
    cache = {} if cache is None else cache
    out = []
    for model in models:
        if id(model) not in cache:
            cache[id(model)] = (model, fingerprint(model, group))    # the model is kept: its id stays unique
        out.append(cache[id(model)][1])
    return out


def check(path: str, saved: Optional[List[dict]], live: List[dict]) -> None:
    """Raise one RuntimeError when the base the adapters of ``path`` were trained on is not this run's."""
    if not saved:
        return          # a checkpoint of a run without frozen parameters, or from before fingerprints
    for index, (saved_model, live_model) in enumerate(zip(saved, live)):
        problem = first_difference(saved_model, live_model)
        if problem:
            which = f" of model {index}" if len(live) > 1 else ""
            raise RuntimeError(
                f"checkpoint {path} holds adapters trained on another base model{which}: {problem}. The base is not "
                "in an adapters-only checkpoint; it comes from this run. Fix: load the same base (same pretrained "
                "directory and dtype, or the same seed and model config) as the run that saved it.")
