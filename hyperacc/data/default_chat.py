"""The embedded chat corpus: conversations made from the standard library's docstrings, offline.

It keeps the chat demo and tests free of downloads (as the embedded text corpus does for
pre-training) and has the length spread of real instruction data: most answers are short, some are
long (the docstrings run from ~40 characters to several thousand). Each docstring ``title\\n\\nbody``
becomes a user asking about the title and the assistant answering with the body; every third
conversation starts with a system turn, every fourth has a second exchange (so that a conversation
has assistant turns that are not the last turn). Deterministic for a given Python installation.
"""
from __future__ import annotations

from typing import Dict, List

from hyperacc.data.default_corpus import collect_documents

__all__ = ["default_chat_records"]

SYSTEM = "You explain the Python standard library, precisely and briefly."


def _conversation(index: int, title: str, body: str) -> Dict[str, List[Dict[str, str]]]:
    messages = [{"role": "system", "content": SYSTEM}] if index % 3 == 0 else []
    messages += [{"role": "user", "content": f"What does this mean: {title}"},
                 {"role": "assistant", "content": body}]
    if index % 4 == 1:
        messages += [{"role": "user", "content": "Say it in one line."},
                     {"role": "assistant", "content": title}]
    return {"messages": messages}


def default_chat_records() -> List[Dict[str, List[Dict[str, str]]]]:
    """One conversation per docstring that has a title line and a body (a few thousand records)."""
    records = []
    for doc in collect_documents():
        title, _, body = doc.partition("\n")
        title, body = title.strip(), body.strip()
        if title and body:
            records.append(_conversation(len(records), title, body))
    return records
