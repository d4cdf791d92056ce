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
from typing import Any

import torch

from hyperacc.batch import (  # noqa: F401 - the packed-row conventions, re-exported
    IGNORE_INDEX, PACKED_FIELDS, count_sequences, is_packed, packed_boundaries, sequence_index)
from hyperacc.data.collate import _samples_as_mappings, _to_tensor

__all__ = ["pack_collate", "is_packed", "sequence_index", "count_sequences", "PACKED_FIELDS"]



def pack_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Flatten ``samples`` (each ``input_ids`` and ``labels``, 1-D, any lengths) into one row.

    Returns ``input_ids`` / ``labels`` / ``position_ids`` of shape ``[1, sum of lengths]`` and no
    ``attention_mask``. An all-ones ``attention_mask`` in the samples is dropped (it says nothing a
    packed row needs); any other field, or a mask with zeros (a padded sample), is an error.

    Why not transformers' ``DataCollatorWithFlattening`` (issue 39, ``benchmarks/libraries_data.py``,
    shared 2-core CPU): it builds the very same row (the same three int64 fields, -100 as the
    separator label at every sample start, positions restarting at 0; max |diff| 0), but through
    Python lists: 14-47x our time for 8 samples / 5k tokens and 18-41x for 16 samples / 38k tokens
    (13-51 ms against 0.5-1.5 ms per micro-batch, five runs on a loaded shared 2-core CPU; only at 80
    tokens is it faster, 0.7-0.9x, both under 0.1 ms). It also drops empty samples and packs a padded sample's pad tokens without a word, so
    the row would hold other samples than the loader chose (``count_sequences`` and the loss would
    disagree with the global batch); here both are errors.
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
