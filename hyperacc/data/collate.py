"""Collators: turn a list of samples into one micro-batch, a dict of tensors.

``default_collate`` stacks equal-shaped fields; ``pad_collate`` right-pads variable-length token
sequences (``input_ids`` / ``attention_mask`` / ``labels``) so that a token-weighted loss can ignore
the padding. ``check_batch`` is what the loader runs on every collate output.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any

import numpy as np
import torch

__all__ = ["default_collate", "pad_collate", "check_batch"]


def check_batch(batch: Any, *, where: str = "collate_fn") -> Mapping:
    """Return ``batch`` if it is a mapping of ``str`` keys to tensors, else raise one TypeError.

    The message names the offending key and type so a broken collate function is found at once.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{where} must return a mapping (dict) of tensors, got {type(batch).__name__}; "
            "wrap the output in a dict, e.g. {'input_ids': tensor, ...}")
    if not batch:
        raise TypeError(f"{where} returned an empty mapping; a micro-batch needs at least one tensor")
    for key, value in batch.items():
        if not isinstance(key, str):
            raise TypeError(f"{where} returned a mapping with a non-string key {key!r} "
                            f"({type(key).__name__}); keys must be str")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} returned key {key!r} of type {type(value).__name__}; "
                            "every value of a micro-batch must be a torch.Tensor")
    return batch


def _samples_as_mappings(samples: Sequence) -> list[Mapping]:
    if isinstance(samples, Mapping) or not isinstance(samples, Sequence) or len(samples) == 0:
        raise TypeError("a collate function takes a non-empty list of samples, got "
                        f"{type(samples).__name__}" + (" (empty)" if isinstance(samples, Sequence)
                                                       and len(samples) == 0 else ""))
    for i, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            raise TypeError(f"sample {i} is a {type(sample).__name__}; the default collators take "
                            "samples that are dicts (field name -> tensor / array / int / list); "
                            "pass collate_fn= for other sample types")
    keys = list(samples[0].keys())
    for i, sample in enumerate(samples[1:], start=1):
        if set(sample.keys()) != set(keys):
            raise ValueError(f"sample {i} has keys {sorted(map(str, sample.keys()))} but sample 0 has "
                             f"{sorted(map(str, keys))}; all samples of a batch need the same fields")
    return samples


def _to_tensor(key: str, value: Any) -> torch.Tensor:
    """One field of one sample as a tensor (no copy for tensors and numeric numpy arrays)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise TypeError(f"field {key!r}: numpy array of dtype {value.dtype} cannot become a tensor")
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (bool, Number, np.generic)) and not isinstance(value, (str, bytes)):
        return torch.tensor(value)
    if isinstance(value, (list, tuple)):
        try:
            return torch.tensor(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"field {key!r}: list cannot become a tensor ({exc}); "
                            "nested lists must be rectangular and numeric") from None
    raise TypeError(f"field {key!r} has type {type(value).__name__}; the default collate handles "
                    "tensors, numpy arrays, python numbers and numeric lists (pass collate_fn= "
                    "or drop the field)")


def _stack(key: str, values: list[torch.Tensor]) -> torch.Tensor:
    first = values[0].shape
    for i, v in enumerate(values):
        if v.shape != first:
            raise ValueError(f"field {key!r}: sample 0 has shape {tuple(first)} but sample {i} has "
                             f"{tuple(v.shape)}; use hyperacc.data.collate.pad_collate for "
                             "variable-length sequences")
    return torch.stack(values)


def default_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack a list of dict samples into a dict of tensors with a leading batch dimension.

    Field values may be tensors, numpy arrays, python numbers or (rectangular) numeric lists; all
    samples must have the same fields and, per field, the same shape.
    """
    samples = _samples_as_mappings(samples)
    return {key: _stack(key, [_to_tensor(key, s[key]) for s in samples]) for key in samples[0]}


# Fields right-padded by pad_collate and the pad value used when the caller does not override it.
_PAD_DEFAULTS = {"attention_mask": 0, "position_ids": 0, "token_type_ids": 0}


def pad_collate(samples: Sequence[Mapping[str, Any]], pad_token_id: int = 0, label_pad_id: int = -100,
                *, pad_to_multiple_of: int | None = None,
                pad_values: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad variable-length 1-D token fields to the longest sample and stack everything.

    - ``input_ids`` is padded with ``pad_token_id``, ``labels`` with ``label_pad_id`` (ignored by the
      loss), ``attention_mask`` / ``position_ids`` / ``token_type_ids`` with 0; ``pad_values`` adds or
      overrides fields (name -> pad value).
    - When samples have ``input_ids`` but no ``attention_mask``, one is created (1 on real tokens,
      0 on padding), so the padding is always identifiable.
    - Other fields are stacked as by :func:`default_collate` (same shape required).
    - ``pad_to_multiple_of`` rounds the padded length up (e.g. 8 for tensor cores).

    Use as ``collate_fn=functools.partial(pad_collate, pad_token_id=tok.pad_token_id)``.
    """
    samples = _samples_as_mappings(samples)
    pads = dict(_PAD_DEFAULTS)
    pads["input_ids"] = pad_token_id
    pads["labels"] = label_pad_id
    if pad_values:
        pads.update(pad_values)
    keys = list(samples[0].keys())
    make_mask = "input_ids" in keys and "attention_mask" not in keys
    columns = {key: [_to_tensor(key, s[key]) for s in samples] for key in keys}
    if make_mask:
        columns["attention_mask"] = [torch.ones(len(t), dtype=torch.long) for t in columns["input_ids"]]
    padded_keys = [k for k in columns if k in pads]
    length = 0
    for key in padded_keys:
        for i, t in enumerate(columns[key]):
            if t.dim() != 1:
                raise ValueError(f"pad_collate: field {key!r} of sample {i} has shape {tuple(t.shape)}; "
                                 "padded fields must be 1-D sequences")
            length = max(length, t.shape[0])
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out: dict[str, torch.Tensor] = {}
    for key, values in columns.items():
        if key not in pads:
            out[key] = _stack(key, values)
            continue
        batch = torch.full((len(values), length), pads[key], dtype=values[0].dtype)
        for i, t in enumerate(values):
            if t.dtype != batch.dtype:
                t = t.to(batch.dtype)
            batch[i, : t.shape[0]] = t
        out[key] = batch
    return out
