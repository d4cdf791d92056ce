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
  (importable from here too). Run-time dtype casts and adapter switches: `peft_runtime`.

`peft` is imported only when a PEFT model is seen: it is an optional extra (``pip install hyperacc[peft]``).
"""
from __future__ import annotations

import copy
import sys
import zlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def is_peft_model(model: nn.Module) -> bool:
    """True for a `peft.PeftModel` (checked without importing peft when nothing imported it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _tuner_classes():
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return BaseTunerLayer, AuxiliaryTrainingWrapper


def base_prefix(model: nn.Module) -> str:
    """Where the base (Hugging Face) model sits inside the PEFT model, e.g. ``"base_model.model."``."""
    base = model.get_base_model()
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    raise ValueError("the PEFT model does not contain its own base model")


def tuner_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, layer) of every adapted layer (a PEFT `BaseTunerLayer`), in model order."""
    tuner, _ = _tuner_classes()
    return [(name, module) for name, module in model.named_modules() if isinstance(module, tuner)]


def base_names(model: nn.Module) -> Dict[str, Optional[str]]:
    """Every parameter and buffer name of the PEFT model -> its key in the base model's checkpoint,
    or None for an adapter's own tensor (which no base checkpoint holds).

    ``q_proj.base_layer.weight`` -> ``q_proj.weight``; ``lm_head.original_module.weight`` and
    ``lm_head.modules_to_save.<adapter>.weight`` -> ``lm_head.weight`` (the copy starts as the original)."""
    tuner, wrapper = _tuner_classes()
    prefix = base_prefix(model)
    kinds = {name: module for name, module in model.named_modules() if isinstance(module, (tuner, wrapper))}
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    out = {}
    for name in names:
        key, parts = name, name.split(".")
        for cut in range(len(parts) - 1, 0, -1):        # the innermost wrapper first
            owner = ".".join(parts[:cut])
            if owner in kinds:
                key = _strip_owner(key, owner, kinds[owner], wrapper)
                if key is None:
                    break
        out[name] = None if key is None else key[len(prefix):] if key.startswith(prefix) else key
    return out


def _strip_owner(key: str, owner: str, module: nn.Module, wrapper) -> Optional[str]:
    rest = key[len(owner) + 1:]
    if isinstance(module, wrapper):
        if rest.startswith("original_module."):
            return f"{owner}.{rest[len('original_module.'):]}"
        if rest.startswith("modules_to_save."):
            return f"{owner}.{rest.split('.', 2)[2]}"
        return None          # e.g. trainable token deltas
    if rest.startswith("base_layer."):
        return f"{owner}.{rest[len('base_layer.'):]}"
    return None          # an adapter's own tensor (lora_A, lora_B, ...)


def adapter_tensor_names(model: nn.Module) -> set:
    """The tensors a PEFT model's adapters are, whatever their ``requires_grad``: every adapter's own
    tensors and ``modules_to_save`` copy (by structure), and every tensor PEFT's own state-dict function
    keeps (trained biases, ...: `peft_saved.trained_names`). Empty for any other model. What an
    adapters-only checkpoint holds and what `broadcast_adapters` makes equal on every rank."""
    if not is_peft_model(model):
        return set()
    from hyperacc.integrations.peft_saved import trained_names

    own = {n for n, key in base_names(model).items() if key is None or ".modules_to_save." in n}
    return own | trained_names(model)


# --------------------------------------------------------------------------- checks before any collective
def check_layout(model: nn.Module, tp_size: int, ep_size: int) -> None:
    """Refuse, in one line, what is not proven exact: adapters on parameters (``target_parameters``)
    and adapters under tensor or expert parallelism (a LoRA A of a column-parallel layer would be
    replicated and its B sharded; PEFT's own TP support assumes another mesh)."""
    if not is_peft_model(model):
        return
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


def _layer_adapters(layer) -> List[str]:
    names = set()
    for attr in tuple(layer.adapter_layer_names) + tuple(layer.other_param_names):
        value = getattr(layer, attr, None)
        if hasattr(value, "keys"):
            names.update(value.keys())
    return sorted(names)


def _own_tensors(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """A tuner layer's adapter parameters and buffers (everything but its base layer's), by relative name."""
    out = {}
    for key, tensor in list(layer.named_parameters()) + list(layer.named_buffers()):
        if not key.startswith("base_layer."):
            out[key] = tensor
    return out


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
    from hyperacc.sharding.fsdp import _copy_into

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


def __getattr__(name):
    # The exports live in peft_export (one concept per module); importable from here as well.
    if name in ("export_adapter", "export_merged", "adapter_state_dict", "merged_tensors"):
        from hyperacc.integrations import peft_export
        return getattr(peft_export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
