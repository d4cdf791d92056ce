"""Exports of a prepared PEFT model: the adapters in PEFT's own format (`export_adapter`, loadable by
``PeftModel.from_pretrained``) and the base with the adapters merged in (`export_merged`, a plain
Hugging Face checkpoint). Both are collective and gather one tensor at a time; files appear only
when complete, and nothing a user already has is written over (only hyperacc's own earlier export
is replaced, by `Accelerator.save_model`)."""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from hyperacc.integrations.peft_names import (ADAPTER_WEIGHTS_FILE, _layer_adapters, _own_tensors, _tuner_classes,
                                              base_names, tuner_layers)
from hyperacc.integrations.peft_saved import adapter_files, check_exportable
from hyperacc.sharding import reshard
from hyperacc.weights import publish
from hyperacc.weights.export import (  # _full: collective for a DTensor (every rank, same order)
    DEFAULT_MAX_SHARD_BYTES, Computed, _agree, _full, export_sharded, export_tensors)
from hyperacc.weights.files import MARK_KEY
from hyperacc.weights.hf_metadata import save_tokenizer


def _selection(model: nn.Module, group):
    """(the state-dict keys to gather, in model order; {adapter: the keys of its file}) as PEFT's own
    ``get_peft_model_state_dict`` chooses them (`hyperacc.integrations.peft_saved`), chosen on rank 0
    (PEFT's embedding check may read the base's config) and agreed by every rank; a refusal is raised
    on every rank before anything is gathered or written."""
    def choose():
        files = adapter_files(model)
        check_exportable(model, files)
        wanted = {key for keys in files.values() for key in keys.values()}
        order = [key for key in model.state_dict(keep_vars=True) if key in wanted]
        return order, {adapter: sorted(keys) for adapter, keys in files.items()}

    record_base(model)
    return _agree(choose, group)


def record_base(model: nn.Module) -> None:
    """``base_model_name_or_path`` of every adapter config that lacks it, from the base model's own
    name (``name_or_path``, else ``config._name_or_path``) when it has one, so that adapter_config.json
    says which base the adapter belongs to (PEFT looks for the name where transformers 5 may not keep it)."""
    base = model.get_base_model()
    name = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    if not name:
        return
    for config in model.peft_config.values():
        if getattr(config, "base_model_name_or_path", None) is None:
            config.base_model_name_or_path = str(name)


def adapter_state_dict(model: nn.Module, *, group=None) -> Dict[str, torch.Tensor]:
    """Collective: full-size host copies, on every rank, of exactly the tensors PEFT's
    ``get_peft_model_state_dict`` keeps for any adapter, by model state-dict key
    (``PeftModel.save_pretrained(state_dict=...)`` takes it), gathered one at a time."""
    return _gather(model, _selection(model, group)[0], group, main_only=False)


def _gather(model: nn.Module, keys: List[str], group, *, main_only: bool) -> Dict[str, torch.Tensor]:
    import torch.distributed as dist

    reshard(model)
    live = model.state_dict(keep_vars=True)
    keep = not main_only or not dist.is_initialized() or dist.get_rank(group) == 0
    out = {}
    for key in keys:
        full = _full(live[key].detach())                # collective for a DTensor: every rank, same order
        if keep:
            out[key] = full.cpu()
        del full
    return out


def export_adapter(model: nn.Module, out_dir: str, *, group=None, into_existing: bool = False,
                   tokenizer=None) -> str:
    """Collective: the adapters in PEFT's own format (``adapter_model.safetensors`` +
    ``adapter_config.json``, written by rank 0 through ``PeftModel.save_pretrained``): exactly the
    tensors PEFT's own ``get_peft_model_state_dict`` keeps (`hyperacc.integrations.peft_saved`), moved
    into ``out_dir`` only when complete; a configuration it cannot export exactly is refused before
    anything is written. ``adapter_config.json`` names the base (`record_base`). Refuses an
    ``out_dir`` that holds files (``into_existing=True``: one that may hold other files, e.g. a
    tokenizer or a README, which are kept, and hyperacc's own earlier export, which is replaced as
    `hyperacc.weights.publish` says). ``tokenizer``: saved into ``out_dir`` too (rank 0, after the
    adapter). Returns ``out_dir``."""

    out_dir = os.path.abspath(out_dir)
    keys, files = _selection(model, group)          # refusals first: nothing written yet
    target = _agree(lambda: publish.start(out_dir, into_existing, "adapter"), group)
    state = _gather(model, keys, group, main_only=True)      # every rank joins the gathers

    def write():
        model.save_pretrained(target.tmp, state_dict=state, is_main_process=True)
        for adapter, file_keys in files.items():
            folder = target.tmp if adapter == "default" else os.path.join(target.tmp, adapter)
            _check_written(os.path.join(folder, ADAPTER_WEIGHTS_FILE), set(file_keys))
        if os.path.exists(os.path.join(target.tmp, ADAPTER_WEIGHTS_FILE)):     # absent: no "default" adapter
            _mark_adapter_file(os.path.join(target.tmp, ADAPTER_WEIGHTS_FILE), target.mark)
        published = publish.publish(target.tmp, out_dir, target.mark, "adapter")
        save_tokenizer(tokenizer, out_dir)
        return published

    return _agree(write, group)


def _check_written(path: str, expected: set) -> None:
    """PEFT chose again from the gathered tensors: its file must hold exactly the keys chosen first."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        written = set(handle.keys())
    if written != expected:
        odd = sorted(written ^ expected)
        raise RuntimeError(f"{path}: PEFT wrote other adapter keys than it chose over the model ({odd[0]} and "
                           f"{len(odd) - 1} more differ); nothing was published. Report this with the PEFT config.")


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


def export_merged(model: nn.Module, out_dir: str, *, group=None, max_shard_bytes: Optional[int] = None,
                  tokenizer=None) -> str:
    """Collective: the base model with the adapters merged, as a plain Hugging Face checkpoint
    (``from_pretrained`` loads it without peft); every rank writes its share, one tensor at a time.
    ``tokenizer``: saved with it, and its token ids fill the config's missing ones (`hf_metadata`)."""

    return export_sharded(model.get_base_model(), out_dir, tensors=merged_tensors(model), group=group,
                          max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, tokenizer=tokenizer)
