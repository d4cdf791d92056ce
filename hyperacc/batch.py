"""The batch conventions every layer shares: what a label that does not count looks like, how many
tokens a loss averages over, and how a packed row keeps its samples apart.

Why at the lowest layer: the loader writes these conventions, the accumulator weights the loss by them,
context parallelism and the MoE aux loss read them, and the packed attention kernel cuts rows by them;
one definition keeps every reader agreeing.

Packed rows (`hyperacc.data.packing`): a micro-batch's samples laid end to end in one row, with
``position_ids`` restarting at 0 at every sample and no ``attention_mask``. `sequence_index` recovers the
samples by transformers' own rule: a boundary wherever a position is not its predecessor + 1.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

IGNORE_INDEX = -100                      # a label that does not count (PyTorch's cross-entropy default)
PACKED_FIELDS = ("input_ids", "labels")


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to a causal-LM loss: labels != -100 after the model's shift by one."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


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
