"""Exports of a prepared PEFT model: the adapters in PEFT's own format (`export_adapter`, loadable by
``PeftModel.from_pretrained``) and the base with the adapters merged in (`export_merged`, a plain
Hugging Face checkpoint). Both are collective and gather one tensor at a time; files appear only
when complete, and nothing a user already has is written over (only hyperacc's own earlier export
is replaced, by `Accelerator.save_model`)."""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional

import torch
from torch import nn

from hyperacc.integrations.peft import (ADAPTER_WEIGHTS_FILE, _layer_adapters, _own_tensors, _tuner_classes,
                                        adapter_tensor_names, base_names, tuner_layers)
from hyperacc.weights.export import _full      # collective for a DTensor: every rank, same order
from hyperacc.weights.files import MARK_KEY


def adapter_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full-size host copies of every adapter tensor and ``modules_to_save`` copy (collective)."""
    from hyperacc.sharding import reshard

    reshard(model)
    keep = adapter_tensor_names(model)
    out = {}
    for name, tensor in model.named_parameters():
        if name in keep:
            out[name] = _full(tensor.detach()).cpu()
    return out


def export_adapter(model: nn.Module, out_dir: str, *, group=None, into_existing: bool = False) -> str:
    """Collective: the adapters in PEFT's own format (``adapter_model.safetensors`` +
    ``adapter_config.json``, written by rank 0 through ``PeftModel.save_pretrained``), moved into
    ``out_dir`` only when complete. Refuses an ``out_dir`` that holds files (``into_existing=True``:
    one that may hold other files, e.g. a tokenizer or a README, which are kept, and hyperacc's own
    earlier export, which is replaced as `hyperacc.weights.publish` says). Returns ``out_dir``."""
    from hyperacc.weights import publish
    from hyperacc.weights.export import _agree

    out_dir = os.path.abspath(out_dir)
    target = _agree(lambda: publish.start(out_dir, into_existing, "adapter"), group)
    state = adapter_state_dict(model)         # every rank joins the gathers

    def write():
        model.save_pretrained(target.tmp, state_dict=state, is_main_process=True)
        _mark_adapter_file(os.path.join(target.tmp, ADAPTER_WEIGHTS_FILE), target.mark)
        return publish.publish(target.tmp, out_dir, target.mark, "adapter")

    return _agree(write, group)


def _mark_adapter_file(path: str, mark: str) -> None:
    """Put the export's mark into the header PEFT wrote (the adapters are small: rewritten whole),
    so that a later save knows the file as hyperacc's own (`hyperacc.weights.publish`)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(path, framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    metadata[MARK_KEY] = mark
    save_file(load_file(path), path + ".marked", metadata=metadata)     # not over a file still mapped
    os.replace(path + ".marked", path)


@contextlib.contextmanager
def _full_adapters(layer: nn.Module) -> Iterator[None]:
    """Within: the layer's adapter parameters are plain full-size tensors (PEFT's own
    ``get_delta_weight`` then works on them); restored after. Collective (every rank, same order)."""
    swapped = []
    for key, _ in _own_tensors(layer).items():
        owner_name, _, attr = key.rpartition(".")
        owner = layer.get_submodule(owner_name) if owner_name else layer
        if attr in owner._parameters:
            original = owner._parameters[attr]
            owner._parameters[attr] = nn.Parameter(_full(original.detach()), requires_grad=False)
            swapped.append((owner, attr, original))
    try:
        yield
    finally:
        for owner, attr, original in swapped:
            owner._parameters[attr] = original


def _check_mergeable(model: nn.Module) -> None:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lycoris_utils import LycorisLayer

    for name, layer in tuner_layers(model):
        if not isinstance(layer, (LoraLayer, LycorisLayer)):
            raise NotImplementedError(f"{name}: merging {type(layer).__name__} adapters is not supported by the sharded "
                                      "merged export (LoRA, LoHa and LoKr are). Fix: export the adapter "
                                      "(export_adapter) and merge it with PEFT's merge_and_unload.")
        if any(getattr(layer, "use_dora", {}).get(a, False) for a in layer.active_adapters):
            raise NotImplementedError(f"{name}: DoRA adapters are not merged by the sharded export (their merge "
                                      "rescales each weight column). Fix: export the adapter and merge it with "
                                      "PEFT's merge_and_unload.")


def merged_tensors(model: nn.Module):
    """(base checkpoint key, tensor or `Computed`) of the base model with the active adapters folded
    in: W + delta(adapters), computed in fp32 and stored in W's dtype (as PEFT's merge does)."""
    from hyperacc.weights.export import Computed, export_tensors

    _check_mergeable(model)
    names = base_names(model)
    _, wrapper = _tuner_classes()
    trained_copies = {}
    for owner, module in model.named_modules():
        if isinstance(module, wrapper) and hasattr(module, "modules_to_save"):
            active = [a for a in module.modules_to_save if a in module.active_adapters]
            if active:
                trained_copies[owner] = f"{owner}.modules_to_save.{active[0]}."
    layers = {f"{name}.base_layer.weight": layer for name, layer in tuner_layers(model)}
    out = []
    for name, tensor in export_tensors(model):
        key = names.get(name)
        if key is None:
            continue
        owner = next((o for o in trained_copies if name.startswith(f"{o}.")), None)
        if owner is not None and not name.startswith(trained_copies[owner]):
            continue            # the original of a modules_to_save copy: the trained copy is exported
        layer = layers.get(name)
        out.append((key, tensor if layer is None else Computed(tensor.shape, tensor.dtype, _merge(tensor, layer))))
    return out


def _merge(weight: torch.Tensor, layer: nn.Module):
    def compute() -> torch.Tensor:
        full = _full(weight.detach()).float()
        with _full_adapters(layer), torch.no_grad():
            for adapter in layer.active_adapters:
                if adapter in _layer_adapters(layer):
                    full = full + layer.get_delta_weight(adapter).float()
        return full.to(weight.dtype)
    return compute


def export_merged(model: nn.Module, out_dir: str, *, group=None, max_shard_bytes: Optional[int] = None) -> str:
    """Collective: the base model with the adapters merged, as a plain Hugging Face checkpoint
    (``from_pretrained`` loads it without peft); every rank writes its share, one tensor at a time."""
    from hyperacc.weights.export import DEFAULT_MAX_SHARD_BYTES, export_sharded

    return export_sharded(model.get_base_model(), out_dir, tensors=merged_tensors(model), group=group,
                          max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
