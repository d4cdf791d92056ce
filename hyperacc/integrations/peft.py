"""PEFT adapters (LoRA and the other tuners of the `peft` library) under FSDP2.

What a PEFT model needs beyond any other model, and why:

- **Names.** PEFT nests the base model under ``base_model.model.`` and a wrapped layer's own
  weight under ``.base_layer`` (``modules_to_save`` keep ``.original_module`` plus a trainable copy per
  adapter). Pretrained base weights are read from files that know none of this: `base_names` maps each
  tensor back to its checkpoint key, and says which tensors are the adapters' own (no file holds them).
- **Adapter initialisation.** A model built on the meta device has meta adapters too (PEFT moves
  them to its base layer's device), and the base model's ``_init_weights`` would initialise them as
  ordinary layers (LoRA's B no longer zero: step 1 no longer starts from the base model).
  `initial_adapter_values` runs PEFT's own injection, layer by layer, on a full-size host copy of each
  adapted base layer, seeded by (seed, layer name): PEFT's initialisation, the same on every rank and
  at every world size, for every tuner `inject_adapter_in_model` supports.
- **Exports** in PEFT's own format and merged into the base: `hyperacc.integrations.peft_export`
  (importable from here too). Run-time dtype casts and adapter switches: `peft_runtime`. The names
  themselves: `peft_names` (importable from here too). How the core reaches all this: the PEFT model
  kind, `peft_kind` (`hyperacc.kinds`).

`peft` is imported only when a PEFT model is seen: it is an optional extra (``pip install hyperacc[peft]``).
"""
from __future__ import annotations

import copy
import zlib
from types import SimpleNamespace
from typing import Dict, List

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyperacc.integrations.peft_export import (  # noqa: F401 - the exports, importable from here as well
    adapter_state_dict, export_adapter, export_merged, merged_tensors)
from hyperacc.integrations.peft_names import (  # noqa: F401 - the names, importable from here as well
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, _layer_adapters, _own_tensors, _tuner_classes, adapter_tensor_names,
    base_names, base_prefix, is_peft_model, tuner_layers)
from hyperacc.sharding.fsdp import _copy_into


# --------------------------------------------------------------------------- checks before any collective
def check_layout(model: nn.Module, tp_size: int, ep_size: int) -> None:
    """`check_parallel` with the sizes given one by one."""
    check_parallel(model, SimpleNamespace(tp_size=tp_size, ep_size=ep_size))


def check_parallel(model: nn.Module, parallel) -> None:
    """Refuse, in one line, what is not proven exact: adapters on parameters (``target_parameters``)
    and adapters under tensor or expert parallelism (a LoRA A of a column-parallel layer would be
    replicated and its B sharded; PEFT's own TP support assumes another mesh). ``parallel``: a
    `hyperacc.ParallelConfig` (its ``tp_size`` and ``ep_size``). The PEFT kind's `check_layout`."""
    if not is_peft_model(model):
        return
    tp_size, ep_size = parallel.tp_size, parallel.ep_size
    wrapped = [name for name, layer in tuner_layers(model) if type(layer).__name__ == "ParamWrapper"]
    if wrapped:
        raise NotImplementedError(
            f"{wrapped[0]}: adapters on parameters (LoraConfig.target_parameters, or a target module PEFT adapts "
            "through its parameters, e.g. Qwen3-MoE's router 'gate' or fused experts) are not supported by hyperacc (PEFT applies them as parametrizations of the sharded parameters; neither their "
            "initialisation on the meta device nor their gradients under FSDP2 are proven). Fix: target modules "
            "(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', ...]).")
    for size, what in ((tp_size, "tp_size"), (ep_size, "ep_size")):
        if size > 1:
            raise NotImplementedError(
                f"PEFT adapters with {what}={size} are not supported by hyperacc (their gradients and exports under "
                f"{'tensor' if what == 'tp_size' else 'expert'} parallelism are not proven exact). Fix: {what}=1 "
                "(FSDP / HSDP shard adapters and base alike), or fine-tune without PEFT.")


# --------------------------------------------------------------------------- adapter initialisation
def _module_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"peft:{seed}:{name}".encode()) & 0x7FFFFFFF


def _holder(path: str, leaf: nn.Module) -> nn.Module:
    """A tree of empty modules with ``leaf`` at ``path``, so that PEFT's name matching (target_modules,
    layers_to_transform, rank_pattern ...) sees the same name it saw in the real model."""
    root = parent = nn.Module()
    parts = path.split(".")
    for part in parts[:-1]:
        child = nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.add_module(parts[-1], leaf)
    return root


def _injectable_config(config):
    config = copy.deepcopy(config)
    for field in ("modules_to_save", "trainable_token_indices"):
        if hasattr(config, field):
            setattr(config, field, None)    # handled on the real model (copies of base weights)
    return config


def _refuse_weight_dependent_init(config, adapter: str) -> None:
    if getattr(config, "use_dora", False):
        # Measured: built on the meta device, every DoRA magnitude came out 0 (the norm of a zero base
        # weight), and the first loss was no longer the base model's.
        raise ValueError(f"adapter {adapter!r}: DoRA (use_dora=True) computes its magnitude vectors from the base "
                         "weights, which a model on the meta device does not have yet. Fix: build the PEFT model on "
                         "a real device (load the base with accelerator=None), or use_dora=False.")
    init = getattr(config, "init_lora_weights", True)
    if not isinstance(init, bool) and str(init).lower() not in ("gaussian", "orthogonal"):
        raise ValueError(f"adapter {adapter!r}: init_lora_weights={init!r} is computed from the base weights, which a "
                         "model on the meta device does not have yet. Fix: build the PEFT model on a real device "
                         "(load the base with accelerator=None), or use init_lora_weights=True/'gaussian'/'orthogonal'.")


def initial_adapter_values(model: nn.Module, seed: int) -> Dict[str, torch.Tensor]:
    """Full-size host values, by parameter name, of every adapter tensor now on the meta device,
    as PEFT initialises them (see the module docstring); {} when there is none."""
    if not is_peft_model(model):
        return {}
    from peft import inject_adapter_in_model

    prefix = base_prefix(model)
    values = {}
    for name, layer in tuner_layers(model):
        own = _own_tensors(layer)
        if not any(t.is_meta for t in own.values()):
            continue
        for adapter in _layer_adapters(layer):
            config = model.peft_config[adapter]
            _refuse_weight_dependent_init(config, adapter)
            base = copy.deepcopy(layer.get_base_layer()).to_empty(device="cpu").float()
            with torch.no_grad():
                for tensor in list(base.parameters()) + list(base.buffers()):
                    tensor.zero_()
            path = name[len(prefix):] if name.startswith(prefix) else name
            holder = _holder(path, base)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_module_seed(seed, f"{name}:{adapter}"))
                inject_adapter_in_model(_injectable_config(config), holder, adapter_name=adapter)
            made = _own_tensors(holder.get_submodule(path))
            for key, tensor in own.items():
                if tensor.is_meta and key in made and f".{adapter}" in f".{key}":
                    value = made[key].detach()
                    values[f"{name}.{key}"] = value.float() if value.is_floating_point() else value
    names = base_names(model)
    missing = [n for n, p in model.named_parameters() if p.is_meta and names.get(n, "") is None and n not in values]
    if missing:
        raise ValueError(f"{missing[0]} (and {len(missing) - 1} more) is an adapter tensor on the meta device that "
                         "PEFT's inject_adapter_in_model cannot recreate (a tuner with shared state, or prompt "
                         "learning). Fix: build the PEFT model on a real device (accelerator=None).")
    return values


@torch.no_grad()
def broadcast_adapters(model: nn.Module, device: torch.device) -> None:
    """Collective: rank 0's values of every adapter tensor that exists (is not on the meta device)
    on every rank, before sharding. PEFT initialises adapters from the global RNG: a PEFT model built
    before the Accelerator seeded every rank alike would otherwise shard a different initialisation
    on each rank (and HSDP replicas would disagree from step 0). One broadcast per dtype (usually
    one), in that dtype: exact, and nothing a backend might lack (float64 on some NPUs)."""
    import torch.distributed as dist

    if not is_peft_model(model) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names = adapter_tensor_names(model)
    tensors = [p for n, p in model.named_parameters() if n in names and not p.is_meta and p.is_floating_point()]
    if not tensors:
        return
    for dtype in sorted({t.dtype for t in tensors}, key=str):        # the same order on every rank
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group])
        dist.broadcast(flat, src=0)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()


@torch.no_grad()
def write_values(model: nn.Module, values: Dict[str, torch.Tensor]) -> None:
    """Copy full-size ``values`` into the (sharded) tensors of those names; each rank keeps its slice."""
    if not values:
        return
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name, value in values.items():
        _copy_into(tensors[name], value.to(tensors[name].dtype))


def copy_wrappers(model: nn.Module) -> List[nn.Module]:
    """Every ``modules_to_save`` wrapper of a PEFT model (an original module and its trainable
    copies); [] for any other model."""
    if not is_peft_model(model):
        return []
    _, wrapper = _tuner_classes()
    return [m for m in model.modules() if isinstance(m, wrapper) and hasattr(m, "modules_to_save")]


@torch.no_grad()
def copy_modules_to_save(model: nn.Module) -> None:
    """After random initialisation of a meta-device PEFT model: each trainable copy of a
    ``modules_to_save`` module starts as the original, as PEFT makes it."""
    for module in copy_wrappers(model):
        originals = dict(module.original_module.named_parameters())
        for copy_module in module.modules_to_save.values():
            for key, tensor in copy_module.named_parameters():
                source = originals[key]
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                local.copy_(source.to_local() if isinstance(source, DTensor) else source)
