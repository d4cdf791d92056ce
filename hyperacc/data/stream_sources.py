"""Open a dataset as a stream: ``datasets.load_dataset(..., streaming=True)``, the engine streamed corpora run on.

``open_stream(dataset)`` gives the ``datasets.IterableDataset`` that ``StreamingDataLoader`` reads:

- a hub id (``name`` = its config) or a directory of data files: ``load_dataset(dataset, name,
  split=split, streaming=True)`` — the files are read as they are trained on, nothing is tokenized or
  copied ahead, so memory and disk stay flat in the corpus size;
- a local file or glob (json, jsonl, txt, parquet, csv): the matching builder with ``data_files``;
- ``None`` / ``"default"``: the embedded offline corpus (text: the stdlib docstrings; chat: the embedded
  conversations) as a stream of 8 shards, its ``train`` split without the held-out tail that the map-style
  pipelines keep for ``validation`` (so evaluation never sees trained rows).

A Megatron prefix is refused: its ``.bin`` is memory-mapped already, nothing is loaded ahead to avoid.
A stream has no held-out tail to carve: ``split="validation"`` needs a source with that split.
"""
from __future__ import annotations

import glob
import os
from typing import Optional

from hyperacc.data.text import DEFAULT_HOLDOUT_FRACTION, _carve, check_dataset_source, is_megatron_spec
from hyperacc.data.text_files import FILE_BUILDERS

__all__ = ["open_stream", "DEFAULT_STREAM_SHARDS"]

DEFAULT_STREAM_SHARDS = 8


def _embedded(kind: str, split: str):
    import datasets

    from hyperacc.data.default_chat import default_chat_records
    from hyperacc.data.default_corpus import collect_documents

    if split not in ("train", "validation"):
        raise ValueError(f"unknown split {split!r} for the embedded corpus; available: train, validation")
    rows = (datasets.Dataset.from_list(default_chat_records()) if kind == "chat"
            else datasets.Dataset.from_dict({"text": collect_documents()}))
    rows = _carve(rows, split, DEFAULT_HOLDOUT_FRACTION, "the embedded corpus")
    return rows.to_iterable_dataset(num_shards=min(DEFAULT_STREAM_SHARDS, len(rows)))


def open_stream(dataset=None, *, kind: str = "text", name: Optional[str] = None, split: str = "train"):
    """``dataset`` as a ``datasets.IterableDataset`` (see the module docstring); ``kind``: ``"text"`` or
    ``"chat"`` (which embedded corpus ``None`` means)."""
    import datasets

    if kind not in ("text", "chat"):
        raise ValueError(f"kind must be 'text' or 'chat', got {kind!r}")
    if dataset is None or dataset == "default":
        return _embedded(kind, split)
    path = os.path.expanduser(os.fspath(dataset))
    if is_megatron_spec(path):
        raise ValueError(f"{path!r} is a Megatron prefix: its tokens are memory-mapped, not loaded ahead, so there "
                         "is nothing to stream. Fix: read it with build_train_dataset / MicroBatchDataLoader")
    check_dataset_source(path)          # a missing path, the config YAML, a directory without data: one line
    extension = os.path.splitext(path)[1].lower()
    try:
        if extension in FILE_BUILDERS and (os.path.isfile(path) or glob.has_magic(path)):
            if not glob.glob(path):
                raise FileNotFoundError(path)
            return datasets.load_dataset(FILE_BUILDERS[extension], data_files=path, split=split, streaming=True)
        return datasets.load_dataset(path, name, split=split, streaming=True)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise ValueError(f"dataset {path!r} not found: not a local file or directory, and not a hub dataset "
                         f"reachable {'offline' if os.environ.get('HF_HUB_OFFLINE') == '1' else 'here'} ({e}). "
                         "Fix: a path to json/jsonl/txt/parquet/csv files or a hub id") from e
    except FileNotFoundError as e:
        raise ValueError(f"dataset {path!r} not found ({e}). Fix: a path to json/jsonl/txt/parquet/csv files or a "
                         "hub id") from e
    except ValueError as e:
        if "split" in str(e).lower():
            raise ValueError(f"dataset {path!r} has no split {split!r} to stream ({e}); a stream cannot carve a "
                             "held-out tail. Fix: a split the source has") from e
        raise
