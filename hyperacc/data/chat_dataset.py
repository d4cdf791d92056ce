"""Chat datasets for training: rendered conversations, assistant-only labels, at most ``seq_len`` tokens.

One entry point, the chat counterpart of ``hyperacc.data.text.build_train_dataset``::

    from hyperacc.data.chat import prepare_chat_tokenizer
    from hyperacc.data.chat_dataset import build_chat_dataset, chat_collate
    tok = prepare_chat_tokenizer(load_tokenizer("default"), "chatml")
    train_ds = build_chat_dataset(None, tok, seq_len=512)                      # embedded chat corpus
    train_ds = build_chat_dataset("data/chat.jsonl", tok, seq_len=2048)        # HF datasets, local files
    train_ds = build_chat_dataset("/data/sft_chat", tok, seq_len=2048)         # Megatron ids + loss mask
    loader = MicroBatchDataLoader(train_ds, ..., collate_fn=chat_collate(tok, packing=True))

A sample is ``{"input_ids", "labels"}`` of its own length (no padding: the collator pads, or packs).
Records are rendered by ``hyperacc.data.chat`` and cut by its ``fit_sample`` rule, the same for every
source; conversations with no assistant token within ``seq_len`` are skipped (counted, and said once).
Rendering runs through ``datasets.map`` (``num_proc`` processes, cached by datasets for file-backed data).
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from typing import Optional

import torch

from hyperacc.data.chat import fit_sample, render_row
from hyperacc.data.collate import pad_collate
from hyperacc.data.default_chat import default_chat_records
from hyperacc.data.megatron_chat import ChatIndexedDataset, has_loss_mask
from hyperacc.data.packing import pack_collate
from hyperacc.data.text import (DEFAULT_HOLDOUT_FRACTION, _carve, _tokenizer_fingerprint, is_megatron_spec,
                                load_text_dataset)

__all__ = ["ChatSamples", "build_chat_dataset", "chat_collate", "check_chat_columns"]

_PIPELINE_VERSION = "chat-1"


class ChatSamples:
    """Map-style dataset over rendered rows (a ``datasets.Dataset`` with ``input_ids`` and ``labels``)."""

    def __init__(self, rows, *, fingerprint: str, source: str, skipped: int = 0):
        self.rows = rows.with_format(None)
        self._fingerprint = fingerprint
        self.source = source
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self.rows)

    @staticmethod
    def _sample(ids, labels) -> dict:
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}

    def __getitem__(self, i: int) -> dict:
        row = self.rows[int(i)]
        return self._sample(row["input_ids"], row["labels"])

    def __getitems__(self, indices) -> list:
        rows = self.rows[list(map(int, indices))]          # one read of the arrow table for a micro-batch
        return [self._sample(x, y) for x, y in zip(rows["input_ids"], rows["labels"])]

    def fingerprint(self) -> str:
        return self._fingerprint

    def num_tokens(self) -> int:
        return sum(len(x) for x in self.rows["input_ids"])

    def __repr__(self) -> str:
        return f"ChatSamples(samples={len(self)}, source={self.source!r}, skipped={self.skipped})"


def check_chat_columns(columns, messages_column: str, where: str) -> None:
    """One ValueError when records have neither ``messages_column`` nor ``prompt`` + ``completion``."""
    if messages_column in columns or {"prompt", "completion"} <= set(columns):
        return
    raise ValueError(f"{where} has no {messages_column!r} column (role/content messages) and no 'prompt' + "
                     f"'completion' columns; its columns are {sorted(columns)}. Fix: messages_column=NAME "
                     "of the column that holds the conversations.")


def _render(rows, source: str, *, tokenizer, seq_len: int, messages_column: str, num_proc, offset: int = 0):
    """(``rows`` rendered and fitted, their fingerprint): one ``datasets.map``, cached by datasets under a
    fingerprint of the rows, the tokenizer, the template and the settings (the loader's identity of the data)."""
    identity = "|".join((rows._fingerprint,   # datasets' cache key of the rows (no public accessor)
                         _tokenizer_fingerprint(tokenizer), hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
                         str(seq_len), messages_column, _PIPELINE_VERSION))
    fingerprint = hashlib.sha256(identity.encode()).hexdigest()[:16]
    num_proc = num_proc if num_proc is not None and num_proc > 1 else None
    rendered = rows.map(functools.partial(_render_rows, tokenizer, seq_len, messages_column, source, offset),
                        batched=True, with_indices=True, remove_columns=rows.column_names,
                        num_proc=num_proc and min(num_proc, len(rows)), new_fingerprint=fingerprint,
                        desc="Rendering conversations")
    return rendered, fingerprint


def _render_rows(tokenizer, seq_len: int, messages_column: str, source: str, offset: int, batch: dict, indices) -> dict:
    out = {"input_ids": [], "labels": []}
    names = list(batch)
    for row, values in zip((offset + i for i in indices), zip(*(batch[n] for n in names))):
        sample = render_row(tokenizer, dict(zip(names, values)), messages_column=messages_column,
                            where=f"record {row} of {source}")
        fitted = fit_sample(sample["input_ids"], sample["labels"], seq_len)
        if fitted is not None:
            out["input_ids"].append(fitted["input_ids"])
            out["labels"].append(fitted["labels"])
    return out


def _records(dataset, *, name, split, messages_column, holdout_fraction, held_out=None):
    """(a ``datasets.Dataset`` of chat records, a description of where they come from); ``held_out``
    receives the held-out share carved from ``train`` (see `load_text_dataset`)."""
    import datasets

    if dataset is None or dataset == "default":
        if split not in ("train", "validation"):
            raise ValueError(f"unknown split {split!r} for the embedded chat corpus; available: train, validation")
        rows = datasets.Dataset.from_list(default_chat_records())
        if holdout_fraction > 0 and held_out is not None and split == "train":
            held_out.append(_carve(rows, "validation", holdout_fraction, "embedded chat corpus"))
        return (_carve(rows, split, holdout_fraction, "embedded chat corpus") if holdout_fraction > 0 else rows,
                f"the embedded chat corpus (split {split!r})")
    rows = load_text_dataset(dataset, name=name, split=split, text_column=None, holdout_fraction=holdout_fraction,
                             held_out=held_out)
    check_chat_columns(rows.column_names, messages_column, f"dataset {dataset!r}")
    return rows, f"{dataset} (split {split!r})"


def build_chat_dataset(dataset, tokenizer, *, seq_len: int, split: str = "train", name: Optional[str] = None,
                       messages_column: str = "messages", holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION,
                       num_proc: Optional[int] = None):
    """Rendered chat samples of ``dataset`` (see the module docstring); ``tokenizer`` from
    ``prepare_chat_tokenizer``. ``dataset``: None/"default" (embedded corpus), a Megatron prefix written
    by ``python -m hyperacc.data.convert --format chat``, or anything ``datasets.load_dataset`` reads."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if dataset not in (None, "default") and is_megatron_spec(dataset):
        return _megatron_chat(os.fspath(dataset), seq_len, split, holdout_fraction)
    held = []
    rows, source = _records(dataset, name=name, split=split, messages_column=messages_column,
                            holdout_fraction=holdout_fraction, held_out=held)
    render = functools.partial(_render, tokenizer=tokenizer, seq_len=seq_len, messages_column=messages_column,
                               num_proc=num_proc)
    rendered, fingerprint = render(rows, source)
    for share in held:      # the held-out rows of the same records: refused if malformed, evaluation or not
        render(share, source.replace(f"(split {split!r})", "(its held-out share)"), offset=len(rows))
    skipped = len(rows) - len(rendered)
    if len(rendered) == 0:
        raise ValueError(f"no conversation of {source} has an assistant token within seq_len={seq_len} tokens "
                         "(all were skipped). Fix: a larger seq_len, or data with assistant turns.")
    if skipped:
        warnings.warn(f"{skipped} of {len(rows)} conversations of {source} have no assistant token within "
                      f"seq_len={seq_len} tokens: skipped", stacklevel=2)
    return ChatSamples(rendered, fingerprint=fingerprint, source=source, skipped=skipped)


def _megatron_chat(prefix: str, seq_len: int, split: str, holdout_fraction: float):
    if not has_loss_mask(prefix):
        raise ValueError(f"Megatron prefix {prefix!r} holds token ids only (pre-training text: no loss mask), so "
                         "it cannot say which tokens are the assistant's. Fix: convert the chat records with "
                         "`python -m hyperacc.data.convert --format chat`, or train it as text (build_text_dataset).")
    return ChatIndexedDataset(prefix, seq_len, split=split, holdout_fraction=holdout_fraction)


def chat_collate(tokenizer, *, packing: bool):
    """The micro-batch collator for chat samples: ``pack_collate`` (one row, no padding) or ``pad_collate``
    (right-padded with the tokenizer's pad token, labels -100 on padding). Picklable (loader workers)."""
    if packing:
        return pack_collate
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return functools.partial(pad_collate, pad_token_id=int(pad))
