"""Hugging Face export: ``model.safetensors`` (+ index when sharded) and ``config.json``.

The full (unsharded) state dict is gathered to rank 0 on CPU and written there into a temporary
directory that is renamed into place, so a crash never leaves a half-written export.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hyperacc.checkpoint import _comm

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _shards(tensors: dict, max_bytes: int):
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    return shards


def write_hf_files(full_state: dict, config, out_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    from safetensors.torch import save_file

    tmp = f"{out_dir}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if config is not None:
        config.save_pretrained(tmp)
    seen, tensors = set(), {}
    for name, tensor in full_state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        tensors[name] = tensor.clone() if key in seen else tensor  # safetensors refuses shared storage
        seen.add(key)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for index, shard in enumerate(shards, start=1):
            file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
            for name, tensor in shard.items():
                weight_map[name] = file
                total += tensor.numel() * tensor.element_size()
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as handle:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=1)
    os.replace(tmp, out_dir)


def export_hf(model: torch.nn.Module, out_dir: str, *, group=None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Collective: every rank calls it; rank 0 writes ``out_dir``. Returns ``out_dir``."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _comm.rank() == 0:
        write_hf_files(full, getattr(model, "config", None), out_dir, max_shard_bytes=max_shard_bytes)
    del full
    _comm.barrier(group)
    return out_dir
