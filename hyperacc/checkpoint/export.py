"""Hugging Face export of a checkpointed model (``save_consolidated``): safetensors files, their
index and ``config.json``, loadable by ``from_pretrained``.

Every rank writes its share of the files in parallel and no rank holds the whole model (see
`hyperacc.weights.export`); the files appear all at once (temporary directory + rename), so a
crash never leaves a half-written export.
"""
from __future__ import annotations

import torch

from hyperacc import kinds
from hyperacc.weights.export import DEFAULT_MAX_SHARD_BYTES, export_sharded

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "export_hf"]


def export_hf(model: torch.nn.Module, out_dir: str, *, group=None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Collective: every rank calls it and writes part of ``out_dir``. Returns ``out_dir``. A model kind
    with a format of its own exports in it (`ModelKind.export`: a PEFT model's adapters, in PEFT's
    format; the base model is not the run's to re-publish)."""
    own = kinds.for_model(model).export(model, out_dir, group=group, max_shard_bytes=max_shard_bytes)
    if own is not None:
        return own
    return export_sharded(model, out_dir, max_shard_bytes=max_shard_bytes, group=group)
