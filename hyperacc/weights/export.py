"""Sharded Hugging Face export: every rank writes the safetensors files of the tensors assigned to
it, in parallel, into a temporary directory that becomes the export only when complete.

Why: gathering the full state dict on rank 0 costs the whole model in rank 0's host memory (122 GB
for Qwen3-30B-A3B in fp32) and one writer for all of it. Here each tensor is gathered
(`DTensor.full_tensor`, one tensor at a time), kept only by the rank that owns it in the file plan,
and appended to that rank's file as it arrives: no rank holds more than one full tensor, and all
ranks write at once. Fused MoE experts are written per expert, the way `save_pretrained` does, so
the result loads with `from_pretrained` (and vLLM and every other reader of HF checkpoints).
A model no bigger than ``max_shard_size`` is one ``model.safetensors`` (no index), as
`save_pretrained` writes it: rank 0 writes it, still receiving one gathered tensor at a time.
Where the files go, and how a save replaces hyperacc's own earlier export: `hyperacc.weights.publish`.

Why not torch DCP's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``,
measured on 2 ranks exporting a 1.0 GB fp32 Qwen3 with the same file plan
(`benchmarks/libraries_weights.py`, issue 39): the same keys, dtypes and values, and a slightly lower
peak RSS (+242-405 MiB per rank against +260-487 MiB here: no rank gathers a full tensor), but
1.15-2.1x the time (every rank writes its shards into ``sharded/``, then rank 0 copies them all into
the consolidated files, and the 970 MiB of ``sharded/`` stay in the export); headers without
``__metadata__`` (no ``format: pt``, no export mark: `publish` could not tell its own files) and not
8-byte aligned; a small model as ``model-00001-of-00001.safetensors`` plus an index instead of
``model.safetensors``; and fused MoE experts under their fused names (25 keys where
`save_pretrained` writes 45 for the tiny Qwen3-MoE), which vLLM and older readers do not load.
"""
from __future__ import annotations

import builtins
import dataclasses
import os
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyperacc import kinds
from hyperacc.weights import layout, publish
from hyperacc.weights.hf_metadata import aligned, export_config, export_generation_config, save_tokenizer
from hyperacc.weights.load import model_class
from hyperacc.weights.writer import Entry, RankWriter, plan_files, write_index

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


@dataclasses.dataclass(frozen=True)
class Computed:
    """A tensor an export computes when its turn comes (on every rank, in the same order: computing
    may gather), e.g. a weight with its adapters merged in."""

    shape: torch.Size
    dtype: torch.dtype
    compute: Callable[[], torch.Tensor]


def export_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The tensors an export holds, in model order: parameters once each (a tied head is not
    written, as `save_pretrained` does) and persistent buffers."""
    skip = set()
    for prefix, module in model.named_modules():
        skip.update(f"{prefix}.{b}" if prefix else b for b in getattr(module, "_non_persistent_buffers_set", ()))
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n not in skip]
    return tensors


def entry_groups(tensors) -> List[List[Entry]]:
    return [[Entry(p.key, tensor.dtype, p.key_shape) for p in layout.export_pieces(name, tuple(tensor.shape))]
            for name, tensor in tensors]


def piece_of(full: torch.Tensor, piece: layout.Piece) -> torch.Tensor:
    index = tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.shape))
    data = full[index]
    return data.reshape(piece.key_shape) if piece.stacked else data


def hf_config(model: nn.Module, dtype: Optional[torch.dtype], tokenizer=None):
    """The model's config as the export writes it (`hf_metadata.export_config`): its own class as
    architecture, the weights' dtype, the model's own ``use_cache``, the tokenizer's token ids."""
    return export_config(getattr(model, "config", None), architecture=model_class(model).__name__, dtype=dtype,
                         tokenizer=tokenizer)


def write_metadata(directory: str, config, generation_config=None) -> None:
    if config is not None:
        config.save_pretrained(directory)
    if generation_config is not None:
        aligned(generation_config, config).save_pretrained(directory)


def export_sharded(model: nn.Module, out_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   group=None, into_existing: bool = False, tensors=None, tokenizer=None) -> str:
    """Collective: every rank calls it; the files appear in ``out_dir`` when complete. Refuses an
    ``out_dir`` that holds files (``into_existing=True``: one that may hold other files, e.g. a
    tokenizer, and hyperacc's own earlier export, which is replaced as `hyperacc.weights.publish`
    says; weights hyperacc did not write are refused). ``tensors``: (key, tensor or `Computed`) to
    write instead of the model's own (`export_tensors`); ``model`` still gives the config.
    ``config.json`` and ``generation_config.json`` say what generating needs (`hf_metadata`: the
    model's own ``use_cache``, token ids); ``tokenizer`` (optional) gives those ids and is saved into
    ``out_dir`` (rank 0, after the weights). Returns ``out_dir``."""
    from hyperacc.sharding import reshard

    reshard(model)      # an eval forward leaves units unsharded: read the shards
    out_dir = os.path.abspath(out_dir)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    target = _agree(lambda: publish.start(out_dir, into_existing), group)
    tensors = export_tensors(model) if tensors is None else tensors
    files = plan_files(entry_groups(tensors), world, max_shard_bytes, avoid=target.in_use)
    writer = RankWriter(target.tmp, files, rank, mark=target.mark)
    error = None
    for name, tensor in tensors:
        full = _full(tensor)                                    # collective for a DTensor
        pieces = layout.export_pieces(name, tuple(tensor.shape))
        if error is None and writer.owns(pieces[0].key):
            try:
                for piece in pieces:
                    writer.write(piece.key, piece_of(full.detach(), piece))
            except Exception as err:  # noqa: BLE001 - every rank must keep joining the gathers
                error = err
        del full
    try:
        writer.close()
    except Exception as err:  # noqa: BLE001
        error = error or err
    _raise_if_any_failed(error, group)
    dtype = tensors[0][1].dtype if tensors else None

    def finish():
        config = hf_config(model, dtype, tokenizer)
        published = _finish(target, out_dir, files, config, export_generation_config(model, config))
        save_tokenizer(tokenizer, out_dir)
        return published

    return _agree(finish, group)


def _full(tensor) -> torch.Tensor:
    if isinstance(tensor, Computed):
        return tensor.compute()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def save_model_sharded(model: nn.Module, save_directory: str, max_shard_size="10GB", safe_serialization: bool = True,
                       *, group=None, tokenizer=None) -> str:
    """`Accelerator.save_model`: accelerate's arguments, but every rank writes in parallel
    (accelerate gathers the whole model on rank 0); a model kind's own format where it has one
    (`ModelKind.export`: a PEFT model's adapters in PEFT's format).
    ``save_directory`` may hold other files (a tokenizer, checkpoints) and hyperacc's own earlier
    export, which the new one replaces (what `Trainer.save_model` needs: the same directory each time).
    ``tokenizer`` (optional): saved beside the export, and its token ids fill the config's missing ones."""
    from accelerate.utils import convert_file_size_to_int

    if not safe_serialization:
        raise ValueError(
            "save_model(safe_serialization=False): hyperacc writes safetensors only (pytorch_model.bin is a "
            "pickle, loading it can run code, and transformers 5 no longer writes it). Fix: drop "
            "safe_serialization=False; from_pretrained loads the safetensors export. If a tool needs a .bin, "
            "load the export with from_pretrained and torch.save(model.state_dict(), 'pytorch_model.bin').")
    max_shard_bytes = convert_file_size_to_int(max_shard_size)
    # A model kind's own format (a PEFT model: what PeftModel.save_pretrained writes, its adapters)
    own = kinds.for_model(model).export(model, save_directory, group=group, into_existing=True, tokenizer=tokenizer,
                                        max_shard_bytes=max_shard_bytes)
    if own is not None:
        return own
    return export_sharded(model, save_directory, max_shard_bytes=max_shard_bytes, group=group, into_existing=True,
                          tokenizer=tokenizer)


# --------------------------------------------------------------------------- directory handling
def _finish(target, out_dir: str, files, config, generation_config) -> str:
    """Rank 0, once every rank's files are complete: configs and index, then into ``out_dir``."""
    write_metadata(target.tmp, config, generation_config)
    write_index(target.tmp, files, mark=target.mark)
    return publish.publish(target.tmp, out_dir, target.mark, "model")


def _agree(fn, group):
    """Run ``fn`` on rank 0; its result, or its error, on every rank."""
    if not dist.is_initialized():
        return fn()
    outcome, error = [None], None
    if dist.get_rank(group) == 0:
        try:
            outcome[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error, outcome[0] = err, ("error", (type(err).__name__, str(err)))
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = outcome[0]
    if kind == "error":
        if error is not None:
            raise error                 # rank 0: the error itself, as without a process group
        raise _same_kind(*value)
    return value


def _same_kind(name: str, message: str) -> Exception:
    """Rank 0's error on the other ranks: the same built-in type (FileExistsError ...) where there is one."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return RuntimeError(f"Hugging Face export failed on rank 0: {name}: {message}")


def _raise_if_any_failed(error: Optional[BaseException], group) -> None:
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}", group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise RuntimeError(f"Hugging Face export failed on rank {failed[0][0]}: {failed[0][1]}") from error
