"""Offline conversion of a text dataset to Megatron ``PREFIX.bin`` / ``PREFIX.idx``.

    python -m hyperacc.data.convert --input HUB_NAME_OR_PATH [--name CONFIG] [--split train] \\
        [--text-column text] --tokenizer ID_OR_DIR --output-prefix PREFIX [--workers N] [--overwrite]

``--input``: a hub dataset name (online, or from the local cache offline), local json/jsonl/text/
parquet/csv files (globs allowed), or a ``save_to_disk`` directory. ``--tokenizer``: a hub id, a
local tokenizer directory, or ``default`` (also when omitted) for the embedded tokenizer. Every
document is encoded without special tokens and followed by EOS; one document = one sequence.
Tokens are uint16 when the vocabulary has fewer than 65500 entries, else int32.

Tokenization runs in ``--workers`` processes (order preserved). Output goes to temporary files
that are renamed to the final names only when the conversion is complete: an interrupted
conversion leaves no file under ``PREFIX.bin``/``PREFIX.idx``; temporary files that a killed
conversion of the same prefix left (``PREFIX.bin.tmp-<pid>-...``) are removed by the next run once their
writer is gone. Existing outputs are refused unless ``--overwrite``; ``--output-prefix dir/`` is refused
(it names a directory, not a file prefix). Every value of the text column must be a string (an int or a
null is an error naming the row); an unreadable input (not UTF-8, a broken JSON line) is one error
naming the file and line. The last line printed is a summary: documents, tokens, seconds, tokens/s.

Importing this module is cheap: datasets/transformers are imported when a conversion runs.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hyperacc.data.megatron import bin_path, idx_path
from hyperacc.data.megatron_writer import IndexedDatasetWriter, remove_stale_temp_files

__all__ = ["convert", "main", "build_parser"]


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


_WORKER_ENCODER: Optional[_Encoder] = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interrupts
    _WORKER_ENCODER = encoder


def _encode_in_worker(texts):
    return _WORKER_ENCODER.encode(texts)


def _encoded_batches(encoder: _Encoder, batches: Iterable[List], workers: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
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
def _check_outputs(prefix: str, overwrite: bool) -> None:
    base = os.path.basename(prefix)
    if prefix.endswith((os.sep, "/")) or base in ("", ".", "..") or os.path.isdir(prefix):
        raise IsADirectoryError(f"--output-prefix {prefix!r} names a directory; give a file prefix inside it, e.g. "
                                f"--output-prefix {os.path.join(prefix, 'corpus')} (writes corpus.bin and corpus.idx)")
    existing = [p for p in (bin_path(prefix), idx_path(prefix)) if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"output already exists: {', '.join(existing)}; refusing to overwrite it. Choose "
                              f"another --output-prefix or pass --overwrite")
    for p in existing:
        if os.path.isdir(p):
            raise IsADirectoryError(f"output path {p} is a directory")


def convert(input: str, output_prefix: str, *, tokenizer=None, name: Optional[str] = None, split: str = "train",
            text_column: str = "text", workers: int = 1, overwrite: bool = False, batch_size: int = 256,
            progress: bool = True, log=print) -> dict:
    """Convert ``input`` to ``output_prefix.bin/.idx``; return a summary dict.

    Arguments mirror the CLI flags. ``tokenizer`` may also be a tokenizer object.
    """
    from hyperacc.data.text import load_text_dataset, load_tokenizer
    from hyperacc.data.text_files import check_texts

    output_prefix = os.fspath(output_prefix)
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    _check_outputs(output_prefix, overwrite)
    remove_stale_temp_files(output_prefix, log=log)  # left by a conversion of this prefix that was killed
    t_load = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    vocab = len(tok)
    ds = load_text_dataset(input, name=name, split=split, text_column=text_column, holdout_fraction=0.0)
    column = ds.select_columns([text_column])
    n_docs = len(column)

    def batches():
        offset = 0
        for batch in column.iter(batch_size=batch_size):
            texts = batch[text_column]
            check_texts(texts, offset, text_column, f"{input!r}")  # ints/nulls: an error, not str(value)
            offset += len(texts)
            yield texts

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_docs, unit="doc", desc=f"convert -> {os.path.basename(output_prefix)}",
                   file=sys.stderr, dynamic_ncols=True)
    writer = IndexedDatasetWriter(output_prefix, vocab_size=vocab, overwrite=overwrite)
    t0 = time.perf_counter()  # tokens/s counts tokenizing + writing, not loading the tokenizer and data
    load_seconds = t0 - t_load
    try:
        docs = 0
        for flat, lengths in _encoded_batches(_Encoder(tok), batches(), workers):
            writer.add_documents_flat(flat, lengths)
            docs += len(lengths)
            if bar is not None:
                bar.update(len(lengths))
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    summary = {"documents": writer.num_documents, "tokens": writer.num_tokens, "seconds": seconds,
               "tokens_per_second": writer.num_tokens / max(seconds, 1e-9), "dtype": writer.dtype.name,
               "vocab_size": vocab, "output_prefix": output_prefix, "load_seconds": load_seconds}
    if log is not None:
        log(f"converted {summary['documents']} documents, {summary['tokens']} tokens in {seconds:.2f} s "
            f"({summary['tokens_per_second']:,.0f} tokens/s) -> {output_prefix}.bin/.idx "
            f"({summary['dtype']}, vocab {vocab}, {workers} worker{'s' if workers > 1 else ''}; loading the "
            f"tokenizer and dataset took {load_seconds:.2f} s more)")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hyperacc.data.convert",
        description="Tokenize a text dataset into Megatron PREFIX.bin/PREFIX.idx files (EOS after each document).")
    p.add_argument("--input", required=True, help="hub dataset name, local json/jsonl/text/parquet/csv file(s), "
                   "or a save_to_disk directory")
    p.add_argument("--name", default=None, help="dataset config name (hub datasets)")
    p.add_argument("--split", default="train", help="split to convert (default: train)")
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    p.add_argument("--tokenizer", default="default", help="hub id or local tokenizer directory; 'default' "
                   "(or omitted) = the embedded default tokenizer")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="tokenizer processes (default: min(4, CPUs))")
    p.add_argument("--overwrite", action="store_true", help="replace existing PREFIX.bin/PREFIX.idx")
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
                text_column=args.text_column, workers=args.workers, overwrite=args.overwrite,
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
