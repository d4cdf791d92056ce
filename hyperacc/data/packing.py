"""Padding-free packing: a micro-batch's samples flattened into one row that keeps them apart.

Why one row per micro-batch: packing must not change what a step trains on. The loader still decides
which samples make each micro-batch (the global batch counts samples, as without packing); packing
only lays those samples end to end instead of padding each to the longest (TRL's padding-free mode,
transformers' ``DataCollatorWithFlattening``). A step therefore computes the same loss and gradients
with packing on or off -- without the padding tokens.

What keeps the samples apart:
- ``position_ids`` restart at 0 at every sample, so rotary positions are each sample's own, and with no
  ``attention_mask`` transformers reads the restarts as sequence boundaries
  (``masking_utils.find_packed_sequence_indices``) and confines sdpa / eager / flash attention to each
  sample (eager and sdpa only without a KV cache: the model needs ``use_cache=False``);
- the first label of every sample is -100: after the model's shift it would be the target of the
  previous sample's last token.

`sequence_index` recovers the samples of such a row (the MoE sequence-wise aux loss and the step's
sample count use it), by transformers' own rule: a boundary wherever a position is not its
predecessor + 1.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from hyperacc.data.collate import _samples_as_mappings, _to_tensor

__all__ = ["pack_collate", "is_packed", "sequence_index", "count_sequences", "PACKED_FIELDS"]

IGNORE_INDEX = -100
PACKED_FIELDS = ("input_ids", "labels")


def pack_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Flatten ``samples`` (each ``input_ids`` and ``labels``, 1-D, any lengths) into one row.

    Returns ``input_ids`` / ``labels`` / ``position_ids`` of shape ``[1, sum of lengths]`` and no
    ``attention_mask``. An all-ones ``attention_mask`` in the samples is dropped (it says nothing a
    packed row needs); any other field, or a mask with zeros (a padded sample), is an error.
    """
    samples = _samples_as_mappings(samples)
    ids, labels, positions = [], [], []
    for i, sample in enumerate(samples):
        extra = sorted(set(sample) - set(PACKED_FIELDS) - {"attention_mask"})
        if extra or any(f not in sample for f in PACKED_FIELDS):
            raise ValueError(f"pack_collate: sample {i} has fields {sorted(sample)}; a packed row is built from "
                             f"'input_ids' and 'labels' only. Fix: drop {extra or 'nothing'} from the samples, "
                             "or use pad_collate (data.packing=false) for samples with more fields.")
        x, y = _to_tensor("input_ids", sample["input_ids"]), _to_tensor("labels", sample["labels"])
        if x.dim() != 1 or x.shape != y.shape or x.numel() == 0:
            raise ValueError(f"pack_collate: sample {i} has input_ids of shape {tuple(x.shape)} and labels of shape "
                             f"{tuple(y.shape)}; both must be the same non-empty 1-D sequence.")
        mask = sample.get("attention_mask")
        if mask is not None and not bool((_to_tensor("attention_mask", mask) == 1).all()):
            raise ValueError(f"pack_collate: sample {i} is padded (its attention_mask has zeros); pack unpadded "
                             "samples: padding is what packing removes.")
        y = y.to(torch.long).clone()
        y[0] = IGNORE_INDEX                 # the previous sample's last token does not predict this one
        ids.append(x.to(torch.long))
        labels.append(y)
        positions.append(torch.arange(x.numel(), dtype=torch.long))
    return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
            "position_ids": torch.cat(positions)[None]}


def is_packed(micro_batch: Mapping) -> bool:
    """Whether a micro-batch's rows may hold several samples: ``position_ids`` and no attention mask
    (the form in which transformers looks for restarts)."""
    return torch.is_tensor(micro_batch.get("position_ids")) and micro_batch.get("attention_mask") is None


def sequence_index(position_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, length]`` -> the index of each token's sample within its row (0, 0, 1, 1, 1, 2, ...)."""
    step = torch.ones_like(position_ids, dtype=torch.bool)
    step[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1]) != 1
    step[:, 0] = False
    return step.to(torch.long).cumsum(dim=1)


def count_sequences(micro_batch: Mapping) -> int:
    """Samples in a micro-batch: one per row, or, in packed rows, one per run of consecutive positions."""
    rows = int(micro_batch["labels"].shape[0])
    if not is_packed(micro_batch) or micro_batch["position_ids"].numel() == 0:
        return rows
    return int(sequence_index(micro_batch["position_ids"])[:, -1].sum()) + rows


def packed_boundaries(micro_batch: Mapping) -> Optional[int]:
    """How many sample boundaries the packed rows of ``micro_batch`` hold (None if not packed)."""
    if not is_packed(micro_batch):
        return None
    return count_sequences(micro_batch) - int(micro_batch["labels"].shape[0])
