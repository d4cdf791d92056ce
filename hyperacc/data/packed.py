"""Fixed-length causal-LM samples cut from a token stream, and weighted blends of such datasets.

Sample layout (shared by the Megatron path here and the text path in ``hyperacc.data.text``)
------------------------------------------------------------------------------------------
Hugging Face causal LMs shift labels themselves: ``model(input_ids=x, labels=y)`` predicts
``y[t + 1]`` from ``x[:t + 1]``. A sample is therefore ``input_ids == labels`` (the same
``seq_len`` tokens) plus an all-ones ``attention_mask``. Sample ``i`` is the window
``stream[i * (seq_len - 1) : i * (seq_len - 1) + seq_len]``: consecutive windows share one
boundary token, which is the *input* of the last prediction of one window and the first
(unpredicted) token of the next. This is Megatron's "``seq_len + 1`` tokens, inputs ``[:-1]``,
targets ``[1:]``" window expressed for a model that shifts internally: every token of the stream
after the first is a target exactly once. Documents are concatenated (each ends with EOS) and
may cross sample boundaries; attention is not masked at document boundaries (as in Megatron's
default). The number of samples of a stream of ``N`` tokens is ``(N - 1) // (seq_len - 1)``.

Everything is deterministic and random access is O(1): a sample is one slice of a memory map.
Shuffling is the loader's job (``MicroBatchDataLoader(shuffle=True, seed=...)``).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from hyperacc.data.megatron import IndexedDataset, normalize_prefix, exists as megatron_exists

__all__ = [
    "TokenWindows",
    "PackedDataset",
    "BlendedDataset",
    "build_packed_dataset",
    "parse_blend",
    "num_windows",
    "holdout_cut",
    "SPLITS",
]

SPLITS = ("train", "validation", "all")


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many samples a stream of ``num_tokens`` tokens gives (see the module docstring)."""
    if num_tokens < seq_len:
        return 0
    return (num_tokens - 1) // (seq_len - 1)


def _check_seq_len(seq_len: int) -> int:
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    return int(seq_len)


class TokenWindows:
    """Map-style dataset of ``seq_len``-token windows over a 1-D token array (numpy or memmap).

    ``ds[i]`` is ``{"input_ids", "attention_mask", "labels"}``: 1-D int64 torch tensors of length
    ``seq_len``, with ``labels == input_ids`` (the model shifts). ``ds.window(i)`` gives the raw
    numpy tokens.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, source: str = "the token stream"):
        self.seq_len = _check_seq_len(seq_len)
        self.tokens = tokens
        self.source = source
        n = len(tokens)
        if n == 0:
            raise ValueError(f"{source} is empty: there are no tokens to train on (check the dataset, "
                             f"its text column, and the split)")
        self.stride = self.seq_len - 1
        self._len = num_windows(n, self.seq_len)
        if self._len == 0:
            raise ValueError(f"seq_len={self.seq_len} is longer than the whole of {source} ({n} tokens); "
                             f"use a smaller seq_len or more data")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return self._len

    def window(self, i: int) -> np.ndarray:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample index {i} out of range for {self._len} samples")
        s = i * self.stride
        return self.tokens[s:s + self.seq_len]

    def __getitem__(self, i: int) -> dict:
        import torch

        ids = torch.from_numpy(self.window(int(i)).astype(np.int64))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(samples={self._len}, seq_len={self.seq_len}, tokens={self.num_tokens})"


def holdout_cut(doc_offsets: np.ndarray, holdout_fraction: float) -> int:
    """Token offset where the held-out tail of a stream starts.

    ``doc_offsets`` are the document start offsets plus the total (as returned by
    :meth:`IndexedDataset.document_token_offsets`). The cut lands on the document start nearest to
    ``(1 - holdout_fraction) * total`` so that no document is split between train and validation,
    unless that would leave one side empty, in which case it cuts at the exact token.
    """
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    total = int(doc_offsets[-1])
    target = int(round(total * (1.0 - holdout_fraction)))
    if holdout_fraction == 0.0:
        return total
    inner = doc_offsets[1:-1]
    if len(inner):
        cut = int(inner[np.argmin(np.abs(inner - target))])
        if 0 < cut < total:
            return cut
    return min(max(target, 1), total - 1)


def _split_range(split: Optional[str], doc_offsets: np.ndarray, holdout_fraction: float) -> Tuple[int, int]:
    total = int(doc_offsets[-1])
    if split in (None, "all"):
        return 0, total
    if split not in ("train", "validation"):
        raise ValueError(f"unknown split {split!r} for a token-file dataset; available: "
                         f"{', '.join(SPLITS)} (the validation split is the last holdout_fraction)")
    if split == "validation" and holdout_fraction <= 0:
        raise ValueError("split='validation' needs holdout_fraction > 0 (e.g. 0.05)")
    cut = holdout_cut(doc_offsets, holdout_fraction)
    return (0, cut) if split == "train" else (cut, total)


class PackedDataset(TokenWindows):
    """Packed samples over one Megatron ``.bin``/``.idx`` pair (see the module docstring).

    ``split``: ``"train"`` (the first ``1 - holdout_fraction`` of the tokens, cut at a document
    boundary), ``"validation"`` (the rest) or ``"all"``/``None`` (everything).
    """

    def __init__(self, prefix: Union[str, os.PathLike, IndexedDataset], seq_len: int, *,
                 split: Optional[str] = "all", holdout_fraction: float = 0.05):
        indexed = prefix if isinstance(prefix, IndexedDataset) else IndexedDataset(prefix)
        self.indexed = indexed
        self.prefix = indexed.prefix
        self.split = split
        a, b = _split_range(split, indexed.document_token_offsets(), holdout_fraction)
        self.token_range = (a, b)
        where = f"{indexed.prefix}" + (f" (split {split!r})" if split not in (None, "all") else "")
        super().__init__(indexed.tokens[a:b], seq_len, source=where)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("tokens")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        a, b = self.token_range
        self.tokens = self.indexed.tokens[a:b]


class BlendedDataset:
    """A deterministic weighted interleaving of map-style datasets.

    Each dataset ``d`` contributes ``n_d ~= weights[d] * num_samples`` samples (largest remainder
    rounding, so the counts sum to ``num_samples``); a dataset asked for more samples than it has
    wraps around. The order spreads every dataset evenly: in any prefix of length ``k``, dataset
    ``d`` has ``k * n_d / num_samples`` samples, +-1. By default ``num_samples`` is the largest
    count for which no dataset wraps (one pass over the dataset that runs out first).

    Why not ``datasets.interleave_datasets(probabilities=..., seed=..., stopping_strategy=...)``
    (issue 39, ``benchmarks/libraries_data.py``: 0.7 / 0.3 over two prefixes of 2M and 0.5M tokens,
    seq_len 128, shared 2-core CPU): it draws each row's source at random, so it cannot give this
    order (104 of the first 4,000 rows equal ours at the same index; a prefix strays up to 27.6
    samples from the weights, ours 0.5), and a checkpoint's data position is an index into this
    order, so a resumed run would continue on another sequence. It takes Arrow tables only: every
    window copied out of the memory-mapped ``.bin`` (49-305x: 0.1-0.7 s against 1.5-14 ms for this
    index, five runs; a second copy of the corpus at pre-training scale); a random ``ds[i]`` costs
    9-27x ours (94-390 us against 4-23 us); its sizes are "first/all exhausted", where ours takes ``num_samples``.
    """

    def __init__(self, datasets: Sequence, weights: Optional[Sequence[float]] = None,
                 num_samples: Optional[int] = None):
        if not datasets:
            raise ValueError("BlendedDataset needs at least one dataset")
        self.datasets = list(datasets)
        if weights is None:
            weights = [len(d) for d in self.datasets]
        if len(weights) != len(self.datasets):
            raise ValueError(f"{len(weights)} weights for {len(self.datasets)} datasets")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"blend weights must be non-negative and not all zero, got {list(weights)}")
        w = w / w.sum()
        self.weights = w
        sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        if np.any(sizes[w > 0] == 0):
            raise ValueError("a dataset with a positive blend weight is empty")
        if num_samples is None:
            num_samples = int(np.floor(np.min(sizes[w > 0] / w[w > 0]) + 1e-9))
        num_samples = int(num_samples)
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        exact = w * num_samples
        counts = np.floor(exact).astype(np.int64)
        short = num_samples - int(counts.sum())
        if short:
            order = np.lexsort((np.arange(len(w)), -(exact - counts)))  # biggest remainder first
            counts[order[:short]] += 1
        self.counts = counts
        keys, ds_ids, local = [], [], []
        for d, n in enumerate(counts):
            if n == 0:
                continue
            j = np.arange(n, dtype=np.int64)
            keys.append((j + 0.5) / n)
            ds_ids.append(np.full(n, d, dtype=np.int64))
            local.append(j % sizes[d])
        keys, ds_ids, local = map(np.concatenate, (keys, ds_ids, local))
        order = np.lexsort((ds_ids, keys))
        self.dataset_index = ds_ids[order].astype(np.int32)
        self.dataset_sample_index = local[order]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        d = int(self.dataset_index[i])
        return self.datasets[d][int(self.dataset_sample_index[i])]

    def __repr__(self) -> str:
        return f"BlendedDataset(samples={len(self)}, weights={self.weights.round(4).tolist()}, counts={self.counts.tolist()})"


def parse_blend(spec: Union[str, Sequence]) -> Tuple[List[str], Optional[List[float]]]:
    """Parse a blend: ``"PREFIX"``, ``"0.7 PREFIX_A 0.3 PREFIX_B"`` (Megatron's ``--data-path``
    form), a list of prefixes, or a list ``[w1, p1, w2, p2, ...]``. Returns (prefixes, weights)."""
    if isinstance(spec, (str, os.PathLike)) and megatron_exists(normalize_prefix(os.fspath(spec))):
        return [os.fspath(spec)], None
    items = spec.split() if isinstance(spec, str) else [x for x in spec]
    if not items:
        raise ValueError("empty dataset blend")

    def is_number(x):
        if isinstance(x, (int, float)):
            return True
        try:
            float(x)
            return not megatron_exists(normalize_prefix(str(x)))
        except ValueError:
            return False

    if len(items) % 2 == 0 and all(is_number(x) for x in items[0::2]):
        return [os.fspath(p) for p in items[1::2]], [float(x) for x in items[0::2]]
    return [os.fspath(p) for p in items], None


def build_packed_dataset(prefixes, seq_len: int, *, weights: Optional[Sequence[float]] = None,
                         split: Optional[str] = "all", holdout_fraction: float = 0.05,
                         num_samples: Optional[int] = None):
    """One :class:`PackedDataset`, or a :class:`BlendedDataset` of several prefixes.

    ``prefixes``: a prefix, a Megatron-style ``"w1 p1 w2 p2"`` string or a list; ``weights``
    default to the token counts (natural proportions).
    """
    paths, parsed = parse_blend(prefixes if not isinstance(prefixes, os.PathLike) else [prefixes])
    weights = weights if weights is not None else parsed
    parts = [PackedDataset(p, seq_len, split=split, holdout_fraction=holdout_fraction) for p in paths]
    if len(parts) == 1 and num_samples is None:
        return parts[0]
    if weights is None:
        weights = [p.num_tokens for p in parts]
    return BlendedDataset(parts, weights, num_samples=num_samples)
