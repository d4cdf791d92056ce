"""Offline conversion of a text or chat dataset to Megatron ``PREFIX.bin`` / ``PREFIX.idx``.

    python -m hyperacc.data.convert --input HUB_NAME_OR_PATH [--name CONFIG] [--split train] \\
        [--text-column text] --tokenizer ID_OR_DIR --output-prefix PREFIX [--workers N] [--overwrite]
    python -m hyperacc.data.convert --format chat --input CHATS [--messages-column messages] \\
        [--chat-template chatml|FILE.jinja] --tokenizer ID_OR_DIR --output-prefix PREFIX ...

``--input``: a hub dataset name (online, or from the local cache offline), local json/jsonl/text/
parquet/csv files (globs allowed), or a ``save_to_disk`` directory. ``--tokenizer``: a hub id, a
local tokenizer directory, or ``default`` (also when omitted) for the embedded tokenizer. Every
document is encoded without special tokens and followed by EOS; one document = one sequence.
Tokens are uint16 when the vocabulary has fewer than 65500 entries, else int32.

``--format chat``: each record (a ``--messages-column`` of role/content messages, or ``prompt`` +
``completion`` columns) is rendered whole with the chat template by ``hyperacc.data.chat.render_record``
(one document = one conversation, not truncated: ``seq_len`` is applied when reading), and a second pair,
``PREFIX_loss_mask.bin/.idx`` (uint8, 1 on the assistant's tokens), is written with the same document
lengths (layout and reader: ``hyperacc.data.megatron_chat``). ``--chat-template`` defaults to ``chatml``
(hyperacc's ChatML training template) for the embedded tokenizer, else to the tokenizer's own; a template
without ``{% generation %}`` blocks is an error before anything is written. All four files appear together.

Tokenization runs in ``--workers`` processes (order preserved). Output goes to temporary files
that are renamed to the final names only when the conversion is complete: an interrupted
conversion leaves no file under ``PREFIX.bin``/``PREFIX.idx`` (nor the mask's); temporary files that a killed
conversion of the same prefix left (``PREFIX.bin.tmp-<pid>-...``) are removed by the next run once their
writer is gone. Existing outputs are refused unless ``--overwrite``; ``--output-prefix dir/`` is refused
(it names a directory, not a file prefix). Every value of the text column must be a string (an int or a
null is an error naming the row); an unreadable input (not UTF-8, a broken JSON line) is one error
naming the file and line. The last line printed is a summary: documents, tokens (and, for chat, trained
tokens), seconds, tokens/s.

Importing this module is cheap: datasets/transformers are imported when a conversion runs.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import signal
import sys
import time
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hyperacc.data.megatron import bin_path, idx_path
from hyperacc.data.megatron_chat import LOSS_MASK_SUFFIX, ChatDatasetWriter, ChatEncoder
from hyperacc.data.megatron_writer import IndexedDatasetWriter, remove_stale_temp_files

__all__ = ["convert", "main", "build_parser", "FORMATS"]

FORMATS = ("text", "chat")
# hyperacc.data.chat's messages name its keyword arguments; the converter's flags are spelt differently.
_CONVERTER_FLAGS = {"chat_template='chatml'": "--chat-template chatml", "chat_template=": "--chat-template ",
                    "messages_column=": "--messages-column ", "(build_text_dataset)": "(--format text)"}


def _for_converter(message: str) -> str:
    for train_flag, cli_flag in _CONVERTER_FLAGS.items():
        message = message.replace(train_flag, cli_flag)
    return message


# -- encoding (runs in worker processes) ------------------------------------------------------------
class _Encoder:
    """Encodes batches of texts to (flat tokens, lengths); picklable and light to ship to workers.

    Fast tokenizers travel as their ``tokenizer.json`` string and are rebuilt with the
    ``tokenizers`` library (no transformers import in workers); others travel pickled.
    """

    def __init__(self, tokenizer):
        self.eos = int(tokenizer.eos_token_id)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._json = backend.to_str() if backend is not None else None
        self._slow = None if backend is not None else tokenizer
        self._backend = None

    def __getstate__(self):
        return {"eos": self.eos, "_json": self._json, "_slow": self._slow, "_backend": None}

    def encode(self, texts: Sequence) -> Tuple[np.ndarray, np.ndarray]:
        if self._json is not None:
            if self._backend is None:
                from tokenizers import Tokenizer

                self._backend = Tokenizer.from_str(self._json)
            ids = [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = self._slow(texts, add_special_tokens=False)["input_ids"]
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = np.empty(int(lengths.sum()), dtype=np.int64)
        ends = np.cumsum(lengths)
        pos = 0
        for x, end in zip(ids, ends):
            flat[pos:end - 1] = x
            flat[end - 1] = self.eos
            pos = end
        return flat, lengths


def _chat_tokenizer(tok, tokenizer_arg, chat_template: Optional[str]):
    """The tokenizer ready to render conversations; a template problem is raised here, before any data is
    read or file written."""
    from hyperacc.data.chat import prepare_chat_tokenizer

    embedded = tokenizer_arg is None or isinstance(tokenizer_arg, str) and tokenizer_arg == "default"
    if chat_template is None and embedded:
        chat_template = "chatml"  # the embedded tokenizer has no template of its own
    if tok is tokenizer_arg:
        tok = copy.deepcopy(tok)  # the caller's tokenizer object is left as it was
    try:
        prepare_chat_tokenizer(tok, chat_template)
    except ValueError as e:
        raise ValueError(_for_converter(str(e))) from None
    return tok


def _chat_columns(column_names, messages_column: str, source: str) -> List[str]:
    names = list(column_names)
    if messages_column not in names and not {"prompt", "completion"} <= set(names):
        raise ValueError(f"{source} has no {messages_column!r} column (role/content messages) and no 'prompt' + "
                         f"'completion' columns; its columns are {sorted(names)}. Fix: --messages-column NAME of "
                         "the column that holds the conversations.")
    return [c for c in (messages_column, "prompt", "completion", "tools") if c in names]


_WORKER_ENCODER = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interrupts
    _WORKER_ENCODER = encoder


def _encode_in_worker(texts):
    return _WORKER_ENCODER.encode(texts)


def _encoded_batches(encoder, batches: Iterable, workers: int) -> Iterator[tuple]:
    """``encoder.encode`` of each batch (an ``_Encoder`` or a ``megatron_chat.ChatEncoder``), in order."""
    if workers <= 1:
        for texts in batches:
            yield encoder.encode(texts)
        return
    import multiprocessing as mp

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=(encoder,))
    # A bounded window of batches in flight, results in order: Pool.imap would read the whole
    # input ahead of the workers, which does not fit in memory for large corpora.
    window = collections.deque()
    try:
        for texts in batches:
            window.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(window) >= 2 * workers + 1:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


# -- conversion -----------------------------------------------------------------------------------
def _check_outputs(prefixes: Sequence[str], overwrite: bool) -> None:
    prefix = prefixes[0]
    base = os.path.basename(prefix)
    if prefix.endswith((os.sep, "/")) or base in ("", ".", "..") or os.path.isdir(prefix):
        raise IsADirectoryError(f"--output-prefix {prefix!r} names a directory; give a file prefix inside it, e.g. "
                                f"--output-prefix {os.path.join(prefix, 'corpus')} (writes corpus.bin and corpus.idx)")
    existing = [p for q in prefixes for p in (bin_path(q), idx_path(q)) if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"output already exists: {', '.join(existing)}; refusing to overwrite it. Choose "
                              f"another --output-prefix or pass --overwrite")
    for p in existing:
        if os.path.isdir(p):
            raise IsADirectoryError(f"output path {p} is a directory")


def convert(input: str, output_prefix: str, *, tokenizer=None, name: Optional[str] = None, split: str = "train",
            text_column: str = "text", format: str = "text", messages_column: str = "messages",
            chat_template: Optional[str] = None, workers: int = 1, overwrite: bool = False, batch_size: int = 256,
            progress: bool = True, log=print) -> dict:
    """Convert ``input`` to ``output_prefix.bin/.idx`` (and, for ``format="chat"``, the loss-mask pair
    ``output_prefix_loss_mask.bin/.idx``); return a summary dict.

    Arguments mirror the CLI flags. ``tokenizer`` may also be a tokenizer object (left unchanged: chat
    conversion prepares a copy).
    """
    from hyperacc.data.text import load_text_dataset, load_tokenizer
    from hyperacc.data.text_files import check_texts

    output_prefix = os.fspath(output_prefix)
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    chat = format == "chat"
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    prefixes = [output_prefix] + ([output_prefix + LOSS_MASK_SUFFIX] if chat else [])
    _check_outputs(prefixes, overwrite)
    for prefix in prefixes:
        remove_stale_temp_files(prefix, log=log)  # left by a conversion of this prefix that was killed
    t_load = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    if chat:
        tok = _chat_tokenizer(tok, tokenizer, chat_template)
    vocab = len(tok)
    ds = load_text_dataset(input, name=name, split=split, text_column=None if chat else text_column,
                           holdout_fraction=0.0)
    if chat:
        columns = _chat_columns(ds.column_names, messages_column, f"dataset {input!r}")
        encoder = ChatEncoder(tok, messages_column, f"{input!r}")
    else:
        columns, encoder = [text_column], _Encoder(tok)
    rows = ds.select_columns(columns)
    n_docs = len(rows)

    def batches():
        offset = 0
        for batch in rows.iter(batch_size=batch_size):
            n = len(batch[columns[0]])
            if chat:
                yield offset, batch
            else:
                check_texts(batch[text_column], offset, text_column, f"{input!r}")  # ints/nulls: an error
                yield batch[text_column]
            offset += n

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_docs, unit="doc", desc=f"convert -> {os.path.basename(output_prefix)}",
                   file=sys.stderr, dynamic_ncols=True)
    writer = None
    t0 = time.perf_counter()  # tokens/s counts tokenizing + writing, not loading the tokenizer and data
    load_seconds = t0 - t_load
    try:
        writer = (ChatDatasetWriter(output_prefix, vocab_size=vocab, overwrite=overwrite) if chat
                  else IndexedDatasetWriter(output_prefix, vocab_size=vocab, overwrite=overwrite))
        for encoded in _encoded_batches(encoder, batches(), workers):
            writer.add_documents_flat(*encoded)
            if bar is not None:
                bar.update(len(encoded[1]))
        writer.finalize()
    except BaseException:
        if writer is not None:
            writer.abort()
        for prefix in prefixes:     # also what a signal left between a writer's file and `writer`
            remove_stale_temp_files(prefix, own=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    summary = {"documents": writer.num_documents, "tokens": writer.num_tokens, "seconds": seconds,
               "tokens_per_second": writer.num_tokens / max(seconds, 1e-9), "dtype": writer.dtype.name,
               "vocab_size": vocab, "output_prefix": output_prefix, "load_seconds": load_seconds, "format": format}
    trained = outputs = ""
    if chat:
        summary["trained_tokens"] = writer.num_trained
        trained = f" ({writer.num_trained} trained)"
        outputs = f" + {output_prefix}{LOSS_MASK_SUFFIX}.bin/.idx"
    if log is not None:
        log(f"converted {summary['documents']} documents, {summary['tokens']} tokens{trained} in {seconds:.2f} s "
            f"({summary['tokens_per_second']:,.0f} tokens/s) -> {output_prefix}.bin/.idx{outputs} "
            f"({summary['dtype']}, vocab {vocab}, {workers} worker{'s' if workers > 1 else ''}; loading the "
            f"tokenizer and dataset took {load_seconds:.2f} s more)")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hyperacc.data.convert",
        description="Tokenize a text dataset into Megatron PREFIX.bin/PREFIX.idx files (EOS after each document), "
                    "or render a chat dataset (--format chat) into ids plus a PREFIX_loss_mask pair.")
    p.add_argument("--input", required=True, help="hub dataset name, local json/jsonl/text/parquet/csv file(s), "
                   "or a save_to_disk directory")
    p.add_argument("--name", default=None, help="dataset config name (hub datasets)")
    p.add_argument("--split", default="train", help="split to convert (default: train)")
    p.add_argument("--format", choices=FORMATS, default="text", help="text: plain documents + EOS (default); "
                   "chat: conversations rendered with the chat template, plus a loss mask on the assistant's tokens")
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    p.add_argument("--messages-column", default="messages", help="--format chat: column of role/content messages "
                   "(default: messages; prompt + completion columns are read as such)")
    p.add_argument("--chat-template", default=None, help="--format chat: 'chatml' (hyperacc's ChatML training "
                   "template) or a .jinja file with {%% generation %%} blocks (default: chatml for the embedded "
                   "tokenizer, else the tokenizer's own)")
    p.add_argument("--tokenizer", default="default", help="hub id or local tokenizer directory; 'default' "
                   "(or omitted) = the embedded default tokenizer")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="tokenizer processes (default: min(4, CPUs))")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs (PREFIX.bin/.idx, and "
                   "PREFIX_loss_mask.bin/.idx for chat)")
    p.add_argument("--batch-size", type=int, default=256, help="documents per tokenization task")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        convert(args.input, args.output_prefix, tokenizer=args.tokenizer, name=args.name, split=args.split,
                text_column=args.text_column, format=args.format, messages_column=args.messages_column,
                chat_template=args.chat_template, workers=args.workers, overwrite=args.overwrite,
                batch_size=args.batch_size, progress=not args.no_progress)
    except KeyboardInterrupt:
        print("error: conversion interrupted; no output was written", file=sys.stderr)
        return 130
    except (ValueError, FileExistsError, IsADirectoryError, OverflowError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
