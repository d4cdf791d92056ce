"""The model bucket's tensors and the keys the buckets are stored under.

The buckets themselves are the Stateful classes of `hyperacc.checkpoint.state` (model, optimizer,
progress, lr_scheduler(s), train loader, RNG); this module holds what the model bucket needs to
turn a live model into DCP's sharded state and back -- a tied parameter stored once, the
trainable tensors only for an adapters-only model -- and the on-disk key of each model and optimizer.
"""
from __future__ import annotations

import logging
import warnings
from typing import Dict, List

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)

from hyperacc import kinds
from hyperacc.checkpoint import _comm
from hyperacc.checkpoint.optim_state import canonical_name
from hyperacc.sharding import reshard

logger = logging.getLogger("hyperacc.checkpoint")


def as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def model_key(index: int) -> str:
    return "model" if index == 0 else f"model_{index}"


def optimizer_key(index: int) -> str:
    return "optimizer" if index == 0 else f"optimizer_{index}"


def warn0(message: str) -> None:
    """Warn once per job (rank 0), not once per process."""
    if _comm.rank() == 0:
        warnings.warn(message, stacklevel=3)


def optimizer_owner(models: List[nn.Module], index: int, n_optimizers: int) -> nn.Module:
    """The module whose parameters optimizer ``index`` updates (for DCP's FQN mapping)."""
    if len(models) == n_optimizers:
        return models[index]
    if len(models) == 1:
        return models[0]
    return nn.ModuleList(models)


def adapters_only(cfg, models) -> bool:
    """Save and restore trainable tensors only: ``CheckpointConfig.is_peft`` when set, else whether a
    model's kind says so (`hyperacc.kinds`: a `peft.PeftModel`, whose frozen base comes back from its own
    source, not the checkpoint)."""
    if cfg.is_peft is not None:
        return bool(cfg.is_peft)
    return any(kinds.for_model(m).saves_trainable_only(m) for m in models)


def tied_aliases(model: nn.Module) -> Dict[str, str]:
    """``{alias: kept}`` state-dict keys of tied parameters (``lm_head.weight`` -> ``model.embed_tokens.weight``
    with ``tie_word_embeddings``): one Parameter under several names, kept under its first one, as
    `optim_state.param_names` keys its optimizer state. Read from the module structure, so every rank
    agrees (a storage comparison would not: a rank may hold an empty shard)."""
    kept: Dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = canonical_name(name)
        first = kept.setdefault(id(param), key)
        if first != key:
            aliases[key] = first
    return aliases


def model_state(model: nn.Module, *, trainable_only: bool = False) -> dict:
    """The model bucket (DTensor shards, nothing gathered), a tied parameter once, under its kept key
    (`tied_aliases`: DCP would write each key's bytes, twice for a tied embedding and head).
    ``trainable_only``: the trainable tensors, and those the model's kind always saves whatever their
    ``requires_grad`` (`ModelKind.always_saved`: a PEFT model's adapters, an inactive one or a flag PEFT
    toggled: what the checkpoint holds must not depend on it)."""
    reshard(model)
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    adapters = kinds.for_model(model).always_saved(model) if trainable_only else set()
    if adapters - set(state):
        state.update({k: v for k, v in get_model_state_dict(model).items() if k in adapters})
    for alias, kept in tied_aliases(model).items():
        if alias in state and kept in state:
            del state[alias]
    return state


def restore_model(model: nn.Module, state: dict, *, strict: bool) -> None:
    """Load ``state`` (a `model_state`: tied parameters under their kept key only) into ``model`` in place;
    a tied Parameter stays one Parameter."""
    reshard(model)
    state = dict(state)
    for alias, kept in tied_aliases(model).items():
        if kept in state:
            state[alias] = state[kept]
    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))


def check_tied_copies(path: str, key: str, template: dict, aliases: Dict[str, str], group=None) -> None:
    """Collective, before the model is loaded. A checkpoint written before ties were stored once holds a
    tied parameter under each of its names (``aliases``: alias -> kept, under the bucket ``key``); they must
    be equal (one tensor when saved), else the checkpoint came from an untied model whose head the load
    would drop silently. Reads those tensors into scratch buffers and raises the same error on every rank."""
    from hyperacc.checkpoint import storage

    probe = {}
    for alias, kept in aliases.items():
        probe[alias] = torch.empty_like(template[kept])
        probe.setdefault(kept, torch.empty_like(template[kept]))
    storage.dcp_load({key: probe}, path, process_group=group)
    local = {name: t.to_local() if hasattr(t, "to_local") else t for name, t in probe.items()}
    differs = [alias for alias, kept in aliases.items() if not torch.equal(local[alias], local[kept])]
    if not _comm.all_true(not differs, group):
        alias = differs[0] if differs else next(iter(aliases))
        raise RuntimeError(f"checkpoint {path} holds different values for {alias} and {aliases[alias]}, which are one "
                           "tied parameter in this model: it was saved from a model without that tie "
                           "(tie_word_embeddings=False); nothing was loaded. Build the model with the same tie as the "
                           "run that saved it.")
