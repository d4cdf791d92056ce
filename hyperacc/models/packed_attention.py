"""``attn_implementation="packed_sdpa"``: SDPA that attends within each sample of a packed row.

Why: for a packed row (`hyperacc.data.packing`: position_ids restarting, no attention mask)
transformers' ``sdpa`` builds a block-diagonal causal mask over the whole row and computes attention
for every pair of tokens in it -- ``(sum of lengths)^2`` -- of which only each sample's own block
counts. Flash-attention kernels take the boundaries instead (varlen), but they are not everywhere
(CPU, GPUs without flash-attn). ``packed_sdpa`` runs transformers' own ``sdpa_attention_forward`` on
each sample's slice with a plain causal mask: ``sum of length^2`` work, no mask read, the causal fast
path -- the same numbers up to float rounding.

It takes that path only when it is sure: one row, the mask transformers built is exactly the
block-diagonal causal mask of the row's position_ids restarts (so a padding mask, a sliding window or
anything else in the mask falls back), and not while dynamo traces (the slice lengths are data). In
every other case it is transformers' ``sdpa``, with the mask. Importing this module registers the name
with transformers' attention and mask interfaces (`build_causal_lm` and the sharded loader import it).
"""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hyperacc.batch import sequence_index

PACKED_SDPA = "packed_sdpa"
_last = (lambda: None, None)            # (weak reference to the last mask seen, its sample lengths or None)


def _block_causal(samples: torch.Tensor) -> torch.Tensor:
    """[T] sample numbers -> [T, T] bool: query i may see key j (same sample, j <= i)."""
    same = samples[:, None] == samples[None, :]
    return torch.tril(same)


def sample_lengths(mask, position_ids) -> Optional[List[int]]:
    """The lengths of a packed row's samples when ``mask`` is exactly their block-diagonal causal mask,
    else None. Computed once per forward (every layer gets the same mask object)."""
    global _last
    if _last[0]() is mask:
        return _last[1]
    lengths = None
    if (torch.is_tensor(position_ids) and position_ids.dim() == 2 and position_ids.shape[0] == 1
            and mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, position_ids.shape[1], position_ids.shape[1])):
        samples = sequence_index(position_ids)[0]
        if int(samples[-1]) > 0 and torch.equal(mask[0, 0], _block_causal(samples.to(mask.device))):
            lengths = torch.bincount(samples).tolist()
    _last = (weakref.ref(mask), lengths)
    return lengths


def packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature; ``kwargs`` carries ``position_ids`` from the layer."""
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    lengths = None
    if not tracing and torch.is_tensor(attention_mask) and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        lengths = sample_lengths(attention_mask, kwargs.get("position_ids"))
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    pieces = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]       # [1, length, heads, dim]
              for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(pieces, dim=1), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
