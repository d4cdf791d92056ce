"""Text pipeline: ``datasets.load_dataset`` + ``AutoTokenizer`` -> packed causal-LM samples.

One entry point for training scripts::

    from hyperacc.data.text import build_train_dataset
    train_ds, tokenizer = build_train_dataset(seq_len=128)                     # embedded default
    eval_ds, _ = build_train_dataset(seq_len=128, split="validation")          # held-out tail
    train_ds, tokenizer = build_train_dataset("data/corpus.jsonl", "gpt2", seq_len=1024)
    train_ds, tokenizer = build_train_dataset("/data/c4_text_document", seq_len=2048)  # Megatron

Samples are the same everywhere (see ``hyperacc.data.packed``): ``input_ids == labels`` of length
``seq_len`` plus an all-ones ``attention_mask``; the model shifts the labels itself. Documents are
encoded without special tokens, each followed by EOS, concatenated, and cut into windows that
overlap by one token so that every token after the first is predicted exactly once.

``datasets`` and ``transformers`` are imported lazily, inside the functions that need them.
"""
from __future__ import annotations

import glob
import hashlib
import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from hyperacc.data.default_corpus import (DEFAULT_VOCAB_SIZE, collect_documents, default_token_prefix,
                                           load_default_tokenizer)
from hyperacc.data.megatron import exists as megatron_exists, normalize_prefix, optimal_dtype
from hyperacc.data.packed import TokenWindows, build_packed_dataset, parse_blend
from hyperacc.data.text_files import FILE_BUILDERS as _FILE_BUILDERS, _local_files, check_texts, diagnose_unreadable

__all__ = [
    "build_train_dataset",
    "build_text_dataset",
    "check_dataset_source",
    "load_text_dataset",
    "load_tokenizer",
    "tokenize_dataset",
    "flatten_tokens",
    "is_megatron_spec",
    "DEFAULT_HOLDOUT_FRACTION",
]

DEFAULT_HOLDOUT_FRACTION = 0.05
_PIPELINE_VERSION = "2"


# -- tokenizer ------------------------------------------------------------------------------------
def load_tokenizer(tokenizer=None, *, vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Optional[str] = None):
    """A transformers tokenizer with an EOS token.

    ``None`` or ``"default"``: the embedded default (byte-level BPE, ``len(tok) == vocab_size``);
    a string: ``AutoTokenizer.from_pretrained`` (hub id, or a local directory); a tokenizer object
    is returned as is.
    """
    if tokenizer is None or (isinstance(tokenizer, str) and tokenizer == "default"):
        tok = load_default_tokenizer(vocab_size, cache_dir)
    elif isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        name = os.fspath(tokenizer)
        try:
            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
            raise ValueError(
                f"cannot load tokenizer {name!r}: it is not a local tokenizer directory and could not be "
                f"loaded from the Hugging Face hub{' (HF_HUB_OFFLINE is set)' if offline else ''}. Pass a "
                f"directory saved with save_pretrained(), a cached hub id, or 'default' for the embedded "
                f"tokenizer. ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    else:
        tok = tokenizer
    if len(tok) < 2 or not tok("hello world")["input_ids"]:
        # transformers builds an empty tokenizer from a directory holding only a model's config.json
        raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', tok)!r} is empty ({len(tok)} entries; it turns "
                         "text into no tokens): the directory has no tokenizer files. Pass a tokenizer directory "
                         "or hub id, or 'default' for the embedded tokenizer.")
    if getattr(tok, "eos_token_id", None) is None:
        raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', tok)!r} has no EOS token, which is appended "
                         f"to every document; set one (tokenizer.eos_token = '...') before building the data")
    return tok


def _tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr((type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer))).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()[:16]


# -- datasets -------------------------------------------------------------------------------------
def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def _load_all_splits(path: str, name: Optional[str], data_files=None):
    """Return a ``DatasetDict``-like mapping ``split -> Dataset`` for any supported source."""
    import datasets

    if data_files is not None:
        builder = path
        return datasets.load_dataset(builder, name, data_files=data_files)
    if _is_saved_dataset(path):
        state = os.path.join(path, "state.json")
        if os.path.isfile(state):
            import json

            with open(state) as f:
                if not json.load(f).get("_data_files"):
                    raise ValueError(f"dataset {path!r} is empty: the save_to_disk directory holds no rows")
        obj = datasets.load_from_disk(path)
        return obj if isinstance(obj, datasets.DatasetDict) else datasets.DatasetDict({"train": obj})
    files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if os.path.isfile(path) else [])
    if files:
        if all(os.path.getsize(f) == 0 for f in files):
            raise ValueError(f"dataset {path!r} is empty: {'the file is' if len(files) == 1 else 'all files are'} "
                             f"0 bytes")
        exts = {os.path.splitext(f[:-3] if f.endswith(".gz") else f)[1].lower() for f in files}
        builders = {_FILE_BUILDERS.get(e) for e in exts}
        if len(builders) != 1 or None in builders:
            raise ValueError(f"cannot tell the format of {path!r} (extensions {sorted(exts)}); supported: "
                             f"{', '.join(sorted(_FILE_BUILDERS))} (optionally .gz), or a save_to_disk directory")
        kwargs = {"delimiter": "\t"} if exts == {".tsv"} else {}
        return datasets.load_dataset(builders.pop(), data_files=files, **kwargs)
    if os.path.isdir(path):
        return datasets.load_dataset(path, name)
    looks_local = path.startswith((".", "/", "~")) or os.path.splitext(
        path[:-3] if path.endswith(".gz") else path)[1].lower() in _FILE_BUILDERS
    if looks_local:
        raise ValueError(f"dataset {path!r} not found: no such file or directory (a local path was expected "
                         f"from its form; hub names look like 'owner/name')")
    return _HubSplits(path, name)


class _HubSplits:
    """Split name -> Dataset for a hub dataset, loading only the splits that are asked for (a
    pre-training corpus may have large splits that are not needed)."""

    def __init__(self, path: str, name: Optional[str]):
        import datasets

        self.path, self.name = path, name
        try:
            self._names = list(datasets.get_dataset_split_names(path, name))
            self._all = None
        except Exception:  # no split metadata (e.g. some offline caches): load everything once
            self._all = datasets.load_dataset(path, name)
            self._names = list(self._all.keys())

    def keys(self):
        return list(self._names)

    def __getitem__(self, split: str):
        if self._all is not None:
            return self._all[split]
        import datasets

        try:
            return datasets.load_dataset(self.path, self.name, split=split)
        except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
            raise ValueError(f"split {split!r} of dataset {self.path!r} is not cached and cannot be downloaded "
                             f"({e}); download it on a machine with network access") from e


def load_text_dataset(path: Union[str, os.PathLike], *, name: Optional[str] = None, split: str = "train",
                      text_column: Optional[str] = "text", holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION,
                      data_files=None, held_out: Optional[list] = None):
    """Load one split of a text dataset with ``datasets``.

    ``path``: a hub name (``name`` = its config), a local file or glob (json, jsonl, text, parquet,
    csv), a directory of such files, or a ``save_to_disk`` directory. ``split`` may use the
    ``datasets`` slicing syntax (``"train[:95%]"``). When the dataset has no ``validation`` split,
    ``"validation"`` is the last ``holdout_fraction`` of the ``train`` rows and ``"train"`` the rest
    (``holdout_fraction=0`` keeps all of ``train``). ``text_column=None`` checks no column (chat records).
    ``held_out``: a list that receives that held-out share when ``split="train"`` is carved from it, so
    that its rows are checked too (they are never trained on, and evaluation may be off).
    Returns a ``datasets.Dataset``.
    """
    import datasets

    path = os.path.expanduser(os.fspath(path))
    try:
        if "[" in split:
            base = split.split("[", 1)[0]
            if _is_saved_dataset(path):
                raise ValueError(f"split slicing ({split!r}) is not supported for save_to_disk directories; "
                                 f"use split={base!r} with holdout_fraction")
            splits = None
            ds = (datasets.load_dataset(path, name, split=split) if not os.path.exists(path) or os.path.isdir(path)
                  else datasets.load_dataset(_FILE_BUILDERS.get(os.path.splitext(path)[1].lower(), "json"),
                                             data_files=path, split=split))
        else:
            splits = _load_all_splits(path, name, data_files)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise ValueError(f"dataset {path!r} not found: not a local file or directory, and not a Hugging Face hub "
                         f"dataset available {'offline in the cache' if os.environ.get('HF_HUB_OFFLINE') == '1' else 'online'}"
                         f". Pass a path to json/jsonl/text/parquet/csv files, a save_to_disk directory, or a "
                         f"hub name. ({e})") from e
    except FileNotFoundError as e:
        raise ValueError(f"dataset {path!r} not found ({e}). Pass a path to json/jsonl/text/parquet/csv files, "
                         f"a save_to_disk directory, or a hub name.") from e
    except datasets.exceptions.DatasetGenerationError as e:
        raise ValueError(diagnose_unreadable(path, data_files, e)) from e
    except (StopIteration, IndexError) as e:  # what datasets raises on some empty inputs
        raise ValueError(f"dataset {path!r} is empty or unreadable ({type(e).__name__}: {e})") from e
    except ConnectionError as e:
        raise ValueError(f"dataset {path!r} is not cached and cannot be downloaded here ({e}). Fix: load it once "
                         f"where the hub is reachable (it is cached then), or pass local files, a save_to_disk "
                         f"directory or a Megatron prefix instead (build_train_dataset(dataset=PATH))") from e
    if splits is not None:
        available = list(splits.keys())
        if (split in ("train", "validation") and "train" in available and "validation" not in available
                and holdout_fraction > 0):
            ds = _carve(splits["train"], split, holdout_fraction, path)
            if held_out is not None and split == "train":
                held_out.append(_carve(splits["train"], "validation", holdout_fraction, path))
        elif split in available:
            ds = splits[split]
        else:
            raise ValueError(f"unknown split {split!r} for dataset {path!r}; available splits: "
                             f"{', '.join(available)}" + (" (or 'validation' = the last holdout_fraction of "
                                                          "'train')" if "train" in available else ""))
    if text_column is not None and text_column not in ds.column_names:
        raise ValueError(f"text column {text_column!r} not found in dataset {path!r}; available columns: "
                         f"{', '.join(ds.column_names)} (pass --text-column / text_column=...)")
    if len(ds) == 0:
        raise ValueError(f"dataset {path!r} (split {split!r}) is empty: it has no rows")
    return ds


def _carve(train, split: str, holdout_fraction: float, path: str):
    n = len(train)
    if n < 2:
        raise ValueError(f"dataset {path!r} has {n} row(s) in 'train' and no 'validation' split: too few rows "
                         f"to hold some out; pass holdout_fraction=0 or a dataset with a validation split")
    k = min(n - 1, max(1, int(round(n * holdout_fraction))))
    return train.select(range(n - k)) if split == "train" else train.select(range(n - k, n))


def tokenize_dataset(ds, tokenizer, *, text_column: str = "text", num_proc: Optional[int] = None):
    """``datasets.map`` that turns each row's text into ``input_ids`` + EOS (no other special tokens).

    Runs with ``num_proc`` processes and is cached by ``datasets`` (keyed by the dataset's
    fingerprint, the tokenizer's content and the text column) when the dataset lives in files.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token")

    def encode(batch, indices):
        texts = batch[text_column]
        check_texts(texts, indices[0] if len(indices) else 0, text_column, "the dataset")
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    # datasets has no public accessor for a Dataset's fingerprint (the cache key its transforms chain on)
    fp = hashlib.sha256("|".join((ds._fingerprint,  # private: see the line above _tokenizer_fingerprint(tokenizer), text_column,
                                  _PIPELINE_VERSION)).encode()).hexdigest()[:16]
    if num_proc is not None and num_proc <= 1:
        num_proc = None
    if num_proc is not None:
        num_proc = max(1, min(num_proc, len(ds)))
    return ds.map(encode, batched=True, with_indices=True, num_proc=num_proc, remove_columns=ds.column_names,
                  new_fingerprint=fp, desc="Tokenizing")


def flatten_tokens(tokenized, vocab_size: Optional[int] = None) -> np.ndarray:
    """All ``input_ids`` of a tokenized dataset as one 1-D array (uint16 when the vocabulary allows)."""
    import pyarrow.compute as pc

    if getattr(tokenized, "_indices", None) is not None:
        tokenized = tokenized.flatten_indices()
    col = tokenized.data.column("input_ids")
    flat = pc.list_flatten(col).to_numpy() if len(col) else np.zeros(0, dtype=np.int64)
    dtype = np.dtype(optimal_dtype(vocab_size))
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
        dtype = np.dtype(np.int64)
    return np.ascontiguousarray(flat, dtype=dtype)


def build_text_dataset(path, tokenizer, seq_len: int, *, name: Optional[str] = None, split: str = "train",
                       text_column: str = "text", holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION,
                       num_proc: Optional[int] = None, data_files=None) -> TokenWindows:
    """Load, tokenize (cached, ``num_proc``), concatenate and cut into ``seq_len`` samples."""
    held = []
    ds = load_text_dataset(path, name=name, split=split, text_column=text_column,
                           holdout_fraction=holdout_fraction, data_files=data_files, held_out=held)
    for rows in held:       # the held-out rows of the same file: checked whether or not evaluation runs
        check_texts(rows[text_column], len(ds), text_column, f"dataset {os.fspath(path)!r}")
    tokenized = tokenize_dataset(ds, tokenizer, text_column=text_column, num_proc=num_proc)
    tokens = flatten_tokens(tokenized, len(tokenizer))
    return TokenWindows(tokens, seq_len, source=f"dataset {os.fspath(path)!r} (split {split!r})")


def check_dataset_source(dataset) -> None:
    """Cheap check, no loading: a dataset spec that names local files (a path, a glob, a Megatron
    prefix or blend) must exist. Raises ValueError naming what is missing. Hub names pass (they are
    checked when loaded)."""
    if dataset is None or (isinstance(dataset, str) and dataset == "default"):
        return
    if is_megatron_spec(dataset):
        return
    specs = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
    if len(specs) == 1 and isinstance(specs[0], str) and len(specs[0].split()) > 1:
        try:
            specs, _ = parse_blend(specs[0])
        except (ValueError, TypeError):
            pass
    for spec in specs:
        path = os.path.expanduser(os.fspath(spec))
        prefix = normalize_prefix(path)
        suffix = os.path.splitext(path[:-3] if path.endswith(".gz") else path)[1].lower()
        supported = f"supported: {', '.join(sorted(_FILE_BUILDERS))} (optionally .gz), save_to_disk, Megatron"
        if os.path.isfile(path) and suffix not in _FILE_BUILDERS and not megatron_exists(prefix):
            # e.g. the config YAML itself: found only once the data is built (after the process group)
            raise ValueError(f"{os.fspath(spec)!r} is a file of no format hyperacc reads as data "
                             f"({f'suffix {suffix!r}' if suffix else 'no suffix'}); {supported}. Fix: pass the data "
                             "file itself, named with its format's suffix")
        if os.path.isdir(path) and not _is_saved_dataset(path) and not _local_files(path):
            raise ValueError(f"{os.fspath(spec)!r} is a directory holding no data file ({supported}). Fix: pass the "
                             "directory that holds the data files, or one of them")
        if os.path.exists(path) or (any(c in path for c in "*?[") and glob.glob(path)):
            continue
        if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
            missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.exists(p)]
            raise ValueError(f"Megatron dataset {prefix!r} is incomplete: {', '.join(missing)} is missing")
        if path.startswith((".", "/", "~")) or suffix in _FILE_BUILDERS or len(specs) > 1:      # looks local
            raise ValueError(f"{os.fspath(spec)!r} not found: no such file, directory or Megatron prefix "
                             f"(PREFIX.idx + PREFIX.bin). Fix: pass an existing path, or a hub name like 'owner/name'")


def is_megatron_spec(spec) -> bool:
    """True when ``spec`` names Megatron token files: a prefix (``PREFIX.idx`` exists), a
    ``"w1 p1 w2 p2"`` blend string, or a list of them."""
    if spec is None:
        return False
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str) and megatron_exists(normalize_prefix(spec)):
        return True
    try:
        prefixes, _ = parse_blend(spec)
    except (ValueError, TypeError):
        return False
    return all(megatron_exists(normalize_prefix(p)) for p in prefixes)


def build_train_dataset(dataset=None, tokenizer=None, *, seq_len: int = 128, split: str = "train",
                        name: Optional[str] = None, text_column: str = "text",
                        holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION, num_proc: Optional[int] = None,
                        weights: Optional[Sequence[float]] = None, num_samples: Optional[int] = None,
                        vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Optional[str] = None) -> Tuple[object, object]:
    """Return ``(dataset, tokenizer)``: a map-style dataset of packed samples and its tokenizer.

    ``dataset``:
      * ``None`` / ``"default"``: the embedded default corpus (stdlib docstrings, offline);
      * a Megatron prefix (``PREFIX.idx`` exists), a ``"0.7 A 0.3 B"`` blend or a list of prefixes:
        :class:`~hyperacc.data.packed.PackedDataset` / ``BlendedDataset`` (``weights`` overrides);
      * anything else: ``datasets.load_dataset`` (hub name + ``name`` config, local files, or a
        ``save_to_disk`` directory), see :func:`load_text_dataset`.
    ``tokenizer``: ``None``/``"default"`` (the embedded one, ``vocab_size`` entries), a hub id or a
    local directory. Size the model with ``len(tokenizer)``.
    ``split``: ``"train"`` or ``"validation"``. For the default corpus and Megatron files (and
    datasets without a validation split) ``"validation"`` is the last ``holdout_fraction`` of the
    data and ``"train"`` the rest, so the two never overlap.
    """
    tok = load_tokenizer(tokenizer, vocab_size=vocab_size, cache_dir=cache_dir)
    default_tok = tokenizer is None or tokenizer == "default"
    if dataset is None or dataset == "default":
        if default_tok:
            ds = build_packed_dataset(default_token_prefix(vocab_size, cache_dir), seq_len, split=split,
                                      holdout_fraction=holdout_fraction, num_samples=num_samples)
            return ds, tok
        # A custom tokenizer over the default corpus: tokenize the documents in memory.
        import datasets

        docs = datasets.Dataset.from_dict({"text": collect_documents()})
        if split not in ("train", "validation"):
            raise ValueError(f"unknown split {split!r} for the default corpus; available: train, validation")
        rows = _carve(docs, split, holdout_fraction, "default corpus") if holdout_fraction > 0 else docs
        tokens = flatten_tokens(tokenize_dataset(rows, tok, num_proc=num_proc), len(tok))
        return TokenWindows(tokens, seq_len, source=f"the default corpus (split {split!r})"), tok
    if is_megatron_spec(dataset):
        ds = build_packed_dataset(dataset, seq_len, weights=weights, split=split,
                                  holdout_fraction=holdout_fraction, num_samples=num_samples)
        return ds, tok
    ds = build_text_dataset(dataset, tok, seq_len, name=name, split=split, text_column=text_column,
                            holdout_fraction=holdout_fraction, num_proc=num_proc)
    return ds, tok
