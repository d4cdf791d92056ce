"""How a model's parameters map to a Hugging Face checkpoint's keys.

Most parameters are stored under their own name. transformers 5 fuses MoE experts into one tensor
per layer (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) while
``save_pretrained`` (and every published Qwen3-MoE checkpoint) stores one matrix per expert
(``mlp.experts.<e>.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]).

Why "pieces": a parameter is described as the boxes it is tiled by, each box one checkpoint key.
A rank then reads exactly the intersection of its own shard's box (whatever the FSDP/TP/EP
placements made it) with each piece, so loading never needs the whole parameter, and exporting is
the same description read the other way round.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, List, Optional, Tuple

# fused parameter name -> the per-expert keys concatenated along its dim 1, in order
FUSED_EXPERTS = {
    "gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
    "down_proj": ("down_proj.weight",),
}
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>" + "|".join(FUSED_EXPERTS) + r")$")
# keys a checkpoint may carry that no model parameter corresponds to (older transformers saved them)
IGNORED_KEYS = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Checkpoint key ``key`` fills ``param[offset : offset + shape]``; ``stacked``: the key has
    no leading (expert) dimension, the piece's dim 0 has size 1."""

    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    stacked: bool = False

    @property
    def key_shape(self) -> Tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def is_fused(name: str) -> bool:
    return _FUSED.match(name) is not None


def export_pieces(name: str, shape: Tuple[int, ...]) -> List[Piece]:
    """The keys ``save_pretrained`` writes for parameter ``name`` of ``shape`` (per-expert for
    fused experts, else the name itself)."""
    match = _FUSED.match(name)
    if match is None or len(shape) != 3:
        return [Piece(name, (0,) * len(shape), tuple(shape))]
    parts = FUSED_EXPERTS[match["name"]]
    if shape[1] % len(parts):
        raise ValueError(f"parameter {name} of shape {list(shape)}: dim 1 does not split into {len(parts)} equal "
                         "per-expert matrices.")
    rows = shape[1] // len(parts)
    return [Piece(f"{match['prefix']}.{e}.{part}", (e, i * rows, 0), (1, rows, shape[2]), stacked=True)
            for e in range(shape[0]) for i, part in enumerate(parts)]


def load_pieces(name: str, shape: Tuple[int, ...], key_shape: Callable[[str], Optional[Tuple[int, ...]]]
                ) -> List[Piece]:
    """The checkpoint keys that tile parameter ``name``; raises a one-line ValueError naming the
    key that is missing or has the wrong shape. ``key_shape(key)``: the key's shape, or None."""
    found = key_shape(name)
    if found is not None or not is_fused(name):
        if found is None:
            raise KeyError(name)
        if tuple(found) != tuple(shape):
            raise ValueError(f"key {name!r} has shape {list(found)} in the checkpoint but the model's parameter "
                             f"has shape {list(shape)} (a checkpoint of another model size or architecture).")
        return [Piece(name, (0,) * len(shape), tuple(shape))]
    pieces = export_pieces(name, shape)
    for piece in pieces:
        found = key_shape(piece.key)
        if found is None:
            raise KeyError(piece.key)
        if tuple(found) != piece.key_shape:
            raise ValueError(f"key {piece.key!r} has shape {list(found)} in the checkpoint but the model's fused "
                             f"parameter {name} {list(shape)} needs {list(piece.key_shape)} per expert (a "
                             "checkpoint of another model size or architecture).")
    return pieces


def aliases(model) -> Dict[str, str]:
    """Tied parameters: every other name of a parameter -> the name `named_parameters` keeps."""
    kept = {id(p): n for n, p in model.named_parameters()}
    return {n: kept[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if kept[id(p)] != n}


def ignorable(key: str, model) -> bool:
    patterns = list(IGNORED_KEYS) + [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected",
                                                                       None) or [])]
    return any(p.search(key) for p in patterns)


def intersect(box_offset, box_shape, piece: Piece):
    """(index into the piece's key, index into the box) of their overlap, or None."""
    source, dest = [], []
    for dim, (b0, bn, p0, pn) in enumerate(zip(box_offset, box_shape, piece.offset, piece.shape)):
        lo, hi = max(b0, p0), min(b0 + bn, p0 + pn)
        if lo >= hi:
            return None
        if not (piece.stacked and dim == 0):
            source.append(slice(lo - p0, hi - p0))
        dest.append(slice(lo - b0, hi - b0))
    return tuple(source), tuple(dest)
