"""Sharded loading: a model built on the meta device remembers its weight files, and after it is
sharded every rank reads only its own slices of the safetensors files straight into its shards.

Why: `from_pretrained` on every rank holds the whole model on every rank (30.5 B parameters x 4
bytes = 122 GB per rank in fp32) and reads the files once per rank. Here each rank's peak is its
shard plus one slice, and the bytes read in total are about one copy of the model. The slice a
rank owns comes from its DTensor's placements (FSDP2, TP, EP or any mix), so the loader does not
know or care which layout produced it.

Why not torch DCP's ``HuggingFaceStorageReader`` (``dcp.load(model.state_dict(), storage_reader=)``),
measured on 2 ranks loading a 1.0 GB fp32 Qwen3 (485 MiB FSDP2 shard each;
`benchmarks/libraries_weights.py`, issue 39): it reads through safetensors' mmap ``get_slice``, so a
rank's peak RSS is +565-610 MiB above its shard against +0-2 MiB here (2.2x the rank's weight
memory), in 1.4-1.7x the time; it reads every ``*.safetensors`` in the directory instead of
following the index; and it maps keys one to one, so a hub Qwen3-MoE checkpoint (per-expert keys)
does not load into transformers 5's fused experts ("Missing key in checkpoint state_dict:
model.layers.0.mlp.experts.down_proj").
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyperacc import kinds
from hyperacc.weights import layout
from hyperacc.weights.files import WeightFiles, WeightsError

logger = logging.getLogger("hyperacc.weights")
SOURCE_ATTR = "hyperacc_weights_source"


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Where a meta-device model's weights are: a local directory of safetensors files."""

    directory: str
    dtype: torch.dtype


def source_of(model: nn.Module) -> Optional[WeightsSource]:
    """The weights a model built by `build_for_sharded_load` is waiting for (None otherwise)."""
    return getattr(model, SOURCE_ATTR, None)


# --------------------------------------------------------------------------- plan
def checkpoint_keys(model: nn.Module) -> Dict[str, Optional[str]]:
    """Tensor name -> its name in the base model's checkpoint (None: a tensor of the model kind's own,
    e.g. a PEFT adapter's, initialised by the kind, not read): `ModelKind.base_names`, the identity for
    a plain model."""
    return kinds.for_model(model).base_names(model)


def plan(model: nn.Module, files: WeightFiles) -> Dict[str, List[layout.Piece]]:
    """Tensor name -> the checkpoint pieces that tile it, for every parameter and persistent buffer;
    raises one WeightsError naming the first missing, unexpected or mis-shaped key."""
    tensors = dict(model.named_parameters())
    non_persistent = _non_persistent(model)
    tensors.update({n: b for n, b in model.named_buffers() if n not in non_persistent})
    keys = checkpoint_keys(model)
    # Tied keys (lm_head -> embed_tokens): a file holds one of them; a PEFT modules_to_save copy of a
    # tied head is not tied itself, so it is read through its original's tie.
    tied_keys = {keys.get(alias) or alias: keys.get(kept) or kept for alias, kept in layout.aliases(model).items()}
    out, missing = {}, []
    for name, tensor in tensors.items():
        key = keys.get(name, name)
        if key is None:
            continue
        if key not in files.entries and tied_keys.get(key) in files.entries:
            key = tied_keys[key]
        try:
            out[name] = layout.load_pieces(key, tuple(tensor.shape), files.shape)
        except KeyError as err:
            missing.append((name, err.args[0]))
        except ValueError as err:
            raise WeightsError(f"{files.directory}: {err}") from None
    arch = model_class(model).__name__
    if missing:
        name, key = missing[0]
        what = f"key {key!r} (for parameter {name})" if key != name else f"key {name!r}"
        raise WeightsError(f"{files.directory}: {what} is missing from the checkpoint"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; it is not a {arch} "
                           "checkpoint of this config (another architecture?), or its files are incomplete.")
    used = {piece.key for pieces in out.values() for piece in pieces}
    tied = set(tied_keys)
    unexpected = [k for k in files.entries if k not in used and k not in tied and not layout.ignorable(k, model)]
    if unexpected:
        raise WeightsError(f"{files.directory}: key {unexpected[0]!r} in the checkpoint matches no parameter of "
                           f"{arch}{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}: a "
                           "checkpoint of another architecture, or a layout hyperacc does not map.")
    return out


# --------------------------------------------------------------------------- load
@torch.no_grad()
def fill_shards(model: nn.Module, source: Optional[WeightsSource] = None) -> dict:
    """Read every rank's own slices of its parameters and persistent buffers from the safetensors
    files (converting dtype on the fly) and initialise non-persistent buffers (rotary tables).
    Called on every rank after sharding; no collectives. Returns {"seconds", "bytes_read"}
    ({} for a model that waits for no weights)."""
    source = source or source_of(model)
    if source is None:
        return {}
    start = time.perf_counter()
    files = WeightFiles(source.directory)
    try:
        pieces = plan(model, files)
        _init_non_persistent_buffers(model)
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        read = 0
        for name, tensor_pieces in pieces.items():
            read += _fill(tensors[name], name, tensor_pieces, files)
    finally:
        files.close()
    for module in model.modules():     # loaded: a second prepare must not load again
        module.__dict__.pop(SOURCE_ATTR, None)      # (on the base model inside a PEFT wrapper)
    stats = {"seconds": time.perf_counter() - start, "bytes_read": read}
    logger.info("loaded %s into shards: %.1f MiB read in %.2f s", source.directory, read / 2**20, stats["seconds"])
    return stats


def local_box(tensor: torch.Tensor):
    """(global offset, shape, local tensor) of this rank's part of ``tensor`` (whole if not a DTensor)."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape), tensor
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()      # public DCP protocol: this rank's shard as (offsets, sizes)
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise WeightsError(f"a parameter placed as {tensor.placements} has no single contiguous box per rank; "
                           "the sharded loader cannot fill it (load with accelerator=None instead).")
    return tuple(chunks[0].offsets), tuple(chunks[0].sizes), local


def _fill(tensor: torch.Tensor, name: str, pieces: List[layout.Piece], files: WeightFiles) -> int:
    offset, shape, local = local_box(tensor)
    covered = read = 0
    for piece in pieces:
        overlap = layout.intersect(offset, shape, piece)
        if overlap is None:
            continue
        source_index, dest_index = overlap
        dest = local[dest_index]
        if not files.read_into(piece.key, source_index, dest):     # straight into the shard when it can
            data = files.read(piece.key, source_index)
            dest.copy_(data.reshape(dest.shape))        # converts the dtype on the fly
        covered += dest.numel()
        read += dest.numel() * dest.element_size()
    if covered != local.numel():
        raise WeightsError(f"{files.directory}: the checkpoint pieces of {name} cover {covered} of this rank's "
                           f"{local.numel()} elements (overlapping or partial keys).")
    return read


def _non_persistent(model: nn.Module) -> set:
    names = set()
    for prefix, module in model.named_modules():
        for buffer in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{buffer}" if prefix else buffer)
    return names


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Buffers no checkpoint holds (rotary inverse frequencies) are computed by the model's own
    initialiser, as `from_pretrained` does."""
    init = getattr(model, "_init_weights", None)
    for prefix, module in model.named_modules():
        own = [b for b in getattr(module, "_non_persistent_buffers_set", ()) if module._buffers.get(b) is not None]
        if not own:
            continue
        if init is None:
            raise WeightsError(f"{type(model).__name__} has non-persistent buffer(s) {prefix}.{own[0]} and no "
                               "_init_weights to compute them; load it with accelerator=None.")
        init(module)


def model_class(model: nn.Module) -> type:
    """The class the user built (FSDP2 turns it into a subclass named FSDP<Class>)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next(c for c in cls.__bases__ if c is not FSDPModule)
    return cls
