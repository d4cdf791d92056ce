"""Local text files behind a dataset spec, and what is wrong with them: the file and line that
break `datasets.load_dataset` (bad UTF-8, a bad JSON line), and non-string values in the text
column — each as one line naming where, instead of a `DatasetGenerationError` traceback."""
from __future__ import annotations

import glob
import os
from typing import Optional

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text",
                 ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}


def _local_files(path: str, data_files=None) -> list:
    """The local data files a spec names (for error messages), in a stable order."""
    if data_files is not None:
        specs = [data_files] if isinstance(data_files, (str, os.PathLike)) else (
            [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)]
            if isinstance(data_files, dict) else list(data_files))
        return sorted(f for spec in specs for f in glob.glob(os.fspath(spec)))
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                      if os.path.splitext(f[:-3] if f.endswith(".gz") else f)[1].lower() in FILE_BUILDERS)
    return []


def _open_bytes(path: str):
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def _first_bad_line(path: str) -> Optional[str]:
    """What is wrong with a text/JSON Lines file, naming its line, or None if nothing is found."""
    import json

    ext = os.path.splitext(path[:-3] if path.endswith(".gz") else path)[1].lower()
    if ext not in (".txt", ".text", ".jsonl", ".json"):
        return None
    with _open_bytes(path) as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"file {path!r} is not valid UTF-8: line {number} has byte 0x{raw[e.start]:02x} at column "
                        f"{e.start + 1}. Fix: convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)")
            if ext in (".jsonl", ".json") and line.strip():
                try:
                    json.loads(line.strip())
                except ValueError as e:
                    if ext == ".json" and number == 1:
                        break  # a whole-file JSON document, not JSON Lines: checked below
                    what = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                    return f"file {path!r} line {number} is not valid JSON ({what}). Fix: correct or remove that line"
        else:
            return None
    try:  # a .json file holding one document
        with _open_bytes(path) as handle:
            json.loads(handle.read().decode("utf-8"))
    except UnicodeDecodeError:
        return f"file {path!r} is not valid UTF-8. Fix: convert the file to UTF-8"
    except ValueError as e:
        return f"file {path!r} is neither JSON Lines nor one JSON document ({e})"
    return None


def diagnose_unreadable(path: str, data_files, err: BaseException) -> str:
    """One line for a ``DatasetGenerationError``: the file and line that broke it when we can
    find them, else the underlying error and the files involved."""
    files = _local_files(path, data_files)
    for f in files:
        try:
            problem = _first_bad_line(f)
        except OSError as e:
            problem = f"file {f!r} cannot be read ({e})"
        if problem:
            return f"dataset {path!r}: {problem}"
    cause = err.__cause__ or err.__context__ or err
    detail = " ".join(str(cause).split()) or type(cause).__name__
    where = f" (files: {', '.join(files[:5])}{' ...' if len(files) > 5 else ''})" if files else ""
    return f"dataset {path!r} cannot be read{where}: {type(cause).__name__}: {detail}"


def check_texts(texts, offset: int, text_column: str, source: str) -> None:
    """Every value of the text column is a string: an int or a null is an error naming the row
    (it would otherwise be tokenized as its repr or as an empty document)."""
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"row {offset + i} of text column {text_column!r} in {source} is "
                             f"{'null' if t is None else f'{type(t).__name__} {t!r}'}, not a string. Fix: drop or "
                             f"convert such rows before converting/training (e.g. Dataset.filter)")
