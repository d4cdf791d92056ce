"""Optimizer state matched to parameters by name, exactly as it was.

Why not ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``: both first "prime" an
optimizer that has no state (a zero-gradient ``step()`` with lr 0), which gives every parameter a
``step=1`` state with zero moments. At save time that changes the live run (AdamW's bias
correction then counts one step too many); at load time every parameter that had no state when
saved (a layer not used yet, a frozen-then-unfrozen module) gets one, and training drifts.

So hyperacc builds the same DCP layout itself -- ``{"state": {fqn: {key: tensor}}, "param_groups":
[{**hyperparameters, "params": [fqn, ...]}]}``, which checkpoints written with
``get_optimizer_state_dict`` also have -- referencing the live tensors (a save never changes the
optimizer), and at load allocates only the entries the checkpoint holds, shaped from its metadata.
Param groups are compared by their parameter names first: any structural difference fails
closed, naming the first one.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

_WRAPPER_SEGMENTS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def canonical_name(name: str) -> str:
    """A parameter's name without activation-checkpoint / compile wrapper segments, as DCP's
    state-dict helpers write it (so model and optimizer keys agree)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def param_names(owner: nn.Module) -> Dict[int, str]:
    """id(parameter) -> canonical name; a tied parameter keeps its first name."""
    names: Dict[int, str] = {}
    for name, param in owner.named_parameters():
        names.setdefault(id(param), canonical_name(name))
    return names


def group_names(owner: nn.Module, optimizer) -> List[List[str]]:
    """Each param group's parameter names, in order."""
    names = param_names(owner)
    out = []
    for index, group in enumerate(optimizer.param_groups):
        try:
            out.append([names[id(p)] for p in group["params"]])
        except KeyError:
            raise ValueError(f"optimizer param group {index} holds a parameter that is not in the model it "
                             "is checkpointed with (prepare the model and its optimizer together).") from None
    return out


def optimizer_state(owner: nn.Module, optimizer) -> dict:
    """The optimizer's state by parameter name, referencing (not copying, not creating) its tensors."""
    names = param_names(owner)
    state = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if entry:
                state[names[id(param)]] = dict(entry)
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names_}
              for group, names_ in zip(optimizer.param_groups, group_names(owner, optimizer))]
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------- load: structure
def saved_structure(available: dict, key: str) -> dict:
    """From DCP metadata: the number of saved param groups with their hyperparameter keys, and the
    saved state entries ``{rest_of_key: ("tensor", size, dtype) | ("bytes",)}`` under ``key.state``."""
    groups: Dict[int, set] = {}
    state = {}
    prefix_groups, prefix_state = f"{key}.param_groups.", f"{key}.state."
    for fqn, meta in available.items():
        if fqn.startswith(prefix_groups):
            index, _, field = fqn[len(prefix_groups):].partition(".")
            groups.setdefault(int(index), set()).add(field)
        elif fqn.startswith(prefix_state):
            size = getattr(meta, "size", None)
            state[fqn[len(prefix_state):]] = (("tensor", tuple(size), meta.properties.dtype)
                                              if size is not None else ("bytes",))
    return {"groups": [sorted(groups[i]) for i in sorted(groups)], "state": state}


def groups_template(structure: dict) -> dict:
    """A DCP load template that reads back just the saved param groups (small pickled values)."""
    return {"param_groups": [{field: None for field in fields} for fields in structure["groups"]]}


def first_difference(index: int, saved_groups: List[dict], live: List[List[str]]) -> Optional[str]:
    """None when the saved param groups hold the same parameter names as the live ones; else the
    first difference, in one sentence."""
    where = f"optimizer {index}"
    count = (f"the checkpoint has {len(saved_groups)} param group(s), training has {len(live)}; "
             if len(saved_groups) != len(live) else "")
    for g in range(max(len(saved_groups), len(live))):
        saved_names = list(saved_groups[g].get("params") or []) if g < len(saved_groups) else []
        names = live[g] if g < len(live) else []
        if set(saved_names) == set(names):
            continue
        only_live = [n for n in names if n not in set(saved_names)]
        only_saved = [n for n in saved_names if n not in set(names)]
        if only_live:
            detail = f"parameter {only_live[0]!r} is in training's group {g} but not in the checkpoint's"
        else:
            detail = f"parameter {only_saved[0]!r} is in the checkpoint's group {g} but not in training's"
        return f"{where}: {count}{detail} ({len(saved_names)} saved vs {len(names)} now)"
    return f"{where}: {count.rstrip('; ')}" if count else None


def split_state_key(rest: str, names: List[str]) -> tuple:
    """``"layers.0.weight.exp_avg"`` -> ``("layers.0.weight", "exp_avg")`` (longest matching name)."""
    best = max((n for n in names if rest.startswith(n + ".")), key=len, default=None)
    if best is None:
        return None, rest
    return best, rest[len(best) + 1:]


# --------------------------------------------------------------------------- load: tensors
def live_state_dtype(optimizer, param: torch.Tensor) -> torch.dtype:
    """The dtype ``optimizer`` keeps a parameter-shaped state in: `hyperacc.precision.adamw.AdamW`'s
    ``state_dtype``, else the parameter's own (torch's optimizers use ``zeros_like(param)``)."""
    return getattr(optimizer, "state_dtype", None) or param.dtype


def state_template(owner: nn.Module, optimizer, structure: dict) -> dict:
    """Buffers for exactly the saved state entries: shaped like the parameter (a DTensor with its
    placements, so DCP reshards) and in the dtype the live optimizer keeps (DCP casts a checkpoint
    saved under another precision recipe as it loads) when the sizes agree, else a plain tensor of
    the saved size and dtype."""
    names = param_names(owner)
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    state: Dict[str, dict] = {}
    for rest, spec in structure["state"].items():
        name, key = split_state_key(rest, list(by_name))
        if name is None:
            raise ValueError(f"the checkpoint holds optimizer state {rest!r} for a parameter this optimizer "
                             "does not have")
        param = by_name[name]
        if spec[0] == "bytes":
            value = None
        elif tuple(spec[1]) == tuple(param.shape):
            value = torch.empty_like(param.detach(), dtype=live_state_dtype(optimizer, param))
        else:
            value = torch.empty(spec[1], dtype=spec[2])
        state.setdefault(name, {})[key] = value
    return {"state": state}


def apply(owner: nn.Module, optimizer, loaded: dict, saved_groups: List[dict]) -> None:
    """Install the loaded state: saved entries for the parameters that had state, none for the rest,
    and the saved hyperparameters of each group (matched by name, checked before)."""
    names = param_names(owner)
    state = loaded.get("state", {})
    for group, saved in zip(optimizer.param_groups, saved_groups):
        device_step = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            entry = state.get(names[id(param)])
            if entry is None:
                optimizer.state.pop(param, None)
                continue
            if device_step and isinstance(entry.get("step"), torch.Tensor):
                local = param.to_local() if hasattr(param, "to_local") else param
                entry = {**entry, "step": entry["step"].to(local.device)}
            optimizer.state[param] = dict(entry)
        group.update({k: v for k, v in saved.items() if k != "params"})
