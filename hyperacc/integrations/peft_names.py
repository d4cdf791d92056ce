"""What a PEFT model is made of, by name: where its base sits, which layers PEFT adapted, which tensors
are the adapters' own and which are the base's under their pretrained-checkpoint keys.

Why a module of its own: the adapter initialisation (`hyperacc.integrations.peft`), the exports
(`peft_export`) and the model kind (`peft_kind`) all read the model through these names; kept
apart, none of them imports another to get them.

`peft` is imported only when a PEFT model is seen (`_tuner_classes`): it is an optional extra.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from hyperacc.integrations.peft_saved import trained_names

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
    own = {n for n, key in base_names(model).items() if key is None or ".modules_to_save." in n}
    return own | trained_names(model)


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
