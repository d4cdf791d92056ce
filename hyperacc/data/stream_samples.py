"""Records of a stream -> training samples, by the same rules as the map-style pipelines.

``StreamingDataLoader(transform=...)`` calls one of these on every record, in order:

- ``TextWindows(tokenizer, seq_len)``: a document's text + EOS (no other special tokens), appended to the
  tokens carried over from the documents before, cut into ``seq_len`` windows that overlap by one token —
  exactly ``hyperacc.data.text.build_text_dataset``'s windows over the same documents in the same order
  (``hyperacc.data.packed.TokenWindows``). The tokens not yet forming a window are the carry-over
  (``state_dict``: fewer than ``seq_len`` ints) that a checkpoint stores.
- ``ChatRecords(tokenizer, seq_len)``: a conversation (messages, or prompt + completion) rendered with the
  tokenizer's chat template, labels on the assistant's tokens only, cut by ``fit_sample`` — exactly
  ``build_chat_dataset``'s samples; a conversation with nothing trained within ``seq_len`` gives no sample.

``identity()`` names the tokenizer, template and settings, so that a resume with another tokenizer or
``seq_len`` is refused instead of continuing on different samples.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch

from hyperacc.data.chat import fit_sample, render_row

__all__ = ["TextWindows", "ChatRecords"]


def _tokenizer_identity(tokenizer) -> str:
    from hyperacc.data.text import _tokenizer_fingerprint

    return _tokenizer_fingerprint(tokenizer)


class TextWindows:
    """A text record -> the ``seq_len``-token windows it completes (``input_ids == labels``, all-ones mask)."""

    def __init__(self, tokenizer, seq_len: int, *, text_column: str = "text"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token (each document ends with one)")
        self.tokenizer, self.seq_len, self.text_column = tokenizer, seq_len, text_column
        self._eos = int(tokenizer.eos_token_id)
        self._carry: list[int] = []
        self.documents = 0

    def __call__(self, record) -> list:
        if not isinstance(record, dict) or self.text_column not in record:
            raise KeyError(f"the record has no {self.text_column!r} field (its fields: "
                           f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); "
                           "pass text_column=NAME of the field that holds the text")
        text = record[self.text_column]
        if not isinstance(text, str):
            raise TypeError(f"its {self.text_column!r} is {'null' if text is None else type(text).__name__}, "
                            "not a string")
        ids = self._carry + self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self._eos]
        length, out = self.seq_len, []
        start = 0
        while len(ids) - start >= length:
            window = torch.tensor(ids[start:start + length], dtype=torch.long)
            out.append({"input_ids": window, "attention_mask": torch.ones_like(window), "labels": window.clone()})
            start += length - 1
        self._carry = ids[start:]
        self.documents += 1
        return out

    def state_dict(self) -> dict:
        return {"carry": list(self._carry)}

    def load_state_dict(self, state: dict) -> None:
        self._carry = [int(t) for t in state["carry"]]

    def reset(self) -> None:
        self._carry = []

    def identity(self) -> str:
        return hashlib.sha256(f"text|{_tokenizer_identity(self.tokenizer)}|{self.seq_len}|{self.text_column}"
                              .encode()).hexdigest()[:16]


class ChatRecords:
    """A chat record -> ``[{"input_ids", "labels"}]`` (its own length; the collator pads or packs), or ``[]``."""

    def __init__(self, tokenizer, seq_len: int, *, messages_column: str = "messages"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: prepare it with "
                             "hyperacc.data.prepare_chat_tokenizer(tokenizer, 'chatml' or a template file)")
        self.tokenizer, self.seq_len, self.messages_column = tokenizer, seq_len, messages_column
        self.skipped = 0        # conversations with nothing trained within seq_len

    def __call__(self, record) -> list:
        if not isinstance(record, dict):
            raise TypeError(f"a chat record is a mapping of fields, got {type(record).__name__}")
        sample = render_row(self.tokenizer, record, messages_column=self.messages_column, where="the record")
        fitted: Optional[dict] = fit_sample(sample["input_ids"], sample["labels"], self.seq_len)
        if fitted is None:
            self.skipped += 1
            return []
        return [{"input_ids": torch.tensor(fitted["input_ids"], dtype=torch.long),
                 "labels": torch.tensor(fitted["labels"], dtype=torch.long)}]

    def identity(self) -> str:
        template = hashlib.sha256(self.tokenizer.chat_template.encode()).hexdigest()
        return hashlib.sha256(f"chat|{_tokenizer_identity(self.tokenizer)}|{template}|{self.seq_len}|"
                              f"{self.messages_column}".encode()).hexdigest()[:16]
