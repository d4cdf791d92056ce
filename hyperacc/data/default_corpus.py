"""The embedded default corpus and tokenizer: real English text that every Python install has.

Corpus: the documentation strings (module, class, function and method docstrings) of a fixed,
sorted list of pure-Python standard-library modules, read from their source files with ``ast``
(nothing is imported, so no side effects and no dependence on installed packages). One docstring
is one document; documents keep source order within a module, modules are in sorted order. The
text is not stored in this repository: it is collected from the running interpreter's stdlib.
Modules missing from an unusual install are skipped; the corpus hash then differs, which only
changes the cache key.

Tokenizer: byte-level BPE trained on that corpus with the ``tokenizers`` library (about a second),
``vocab_size`` 512 by default (the tiny demo model's vocabulary; it includes the 256 byte symbols
and the ``<|endoftext|>`` EOS/pad token). It is saved as a standard Hugging Face tokenizer
directory (``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``),
loadable with ``AutoTokenizer.from_pretrained(dir)``.

Cache: ``$HYPERACC_CACHE`` or ``~/.cache/hyperacc``, under ``default_corpus/<key>/`` where
``key`` hashes the corpus text and every setting. The directory holds the tokenizer files and
the tokenized corpus as a Megatron ``corpus.bin``/``corpus.idx`` pair (each document + EOS). The
same inputs give byte-identical files. Directories are built in a temporary directory and renamed
into place, so concurrent ranks never see a half-written cache. The parsed documents themselves are
memoised under ``default_corpus/documents/`` (see `collect_documents`).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from typing import List, Optional, Sequence, Tuple

from hyperacc.config.launch_env import env_value

__all__ = [
    "DEFAULT_MODULES",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "collect_documents",
    "default_cache_dir",
    "corpus_fingerprint",
    "build_default_corpus",
    "default_tokenizer_dir",
    "default_token_prefix",
    "load_default_tokenizer",
]

FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
MIN_DOC_CHARS = 40  # shorter docstrings ("Return self.") carry little text

# Pure-Python stdlib modules with substantial documentation. Fixed and sorted; packages are named
# by their __init__ or a submodule file.
DEFAULT_MODULES = tuple(sorted((
    "argparse", "ast", "asyncio/events", "asyncio/locks", "asyncio/queues", "asyncio/streams",
    "asyncio/tasks", "base64", "bdb", "bisect", "calendar", "cmd", "codecs", "collections/__init__",
    "concurrent/futures/_base", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "difflib", "dis", "doctest", "email/message", "email/utils", "enum", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip",
    "heapq", "hmac", "html/parser", "http/client", "http/cookiejar", "http/server", "imaplib",
    "inspect", "ipaddress", "json/__init__", "json/decoder", "json/encoder", "locale",
    "logging/__init__", "logging/handlers", "mailbox", "mimetypes", "netrc", "numbers", "optparse",
    "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib",
    "pprint", "profile", "pstats", "pydoc", "queue", "quopri", "random", "re/__init__", "reprlib",
    "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "turtle", "typing", "unittest/case",
    "unittest/mock", "urllib/parse", "urllib/request", "uuid", "warnings", "wave", "weakref",
    "zipfile", "zipfile/__init__",
)))


def default_cache_dir() -> str:
    """``$HYPERACC_CACHE`` if set, else ``~/.cache/hyperacc``."""
    return env_value("HYPERACC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hyperacc")


def _module_file(stdlib: str, name: str) -> Optional[str]:
    path = os.path.join(stdlib, *name.split("/")) + ".py"
    return path if os.path.isfile(path) else None


def _docstrings(source: str) -> List[str]:
    """Module, class and function docstrings of a source file, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    nodes = [tree]
    while nodes:  # depth-first, preserving source order
        node = nodes.pop(0)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
        children = [c for c in ast.iter_child_nodes(node)
                    if isinstance(c, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes[0:0] = children
    return out


def collect_documents(modules: Sequence[str] = DEFAULT_MODULES, *, min_chars: int = MIN_DOC_CHARS) -> List[str]:
    """The corpus: one document per docstring of at least ``min_chars`` characters.

    Memoised per process (the stdlib does not change while it runs) and in the cache, under
    ``default_corpus/documents/`` keyed like the build's fast path (the source files' names, sizes and
    mtimes, and the settings): parsing the stdlib costs about 1.5 s of CPU in every process that uses
    the corpus (each rank of a job, one after the other while rank 0 builds first), reading the memo a
    few milliseconds. The memo holds exactly what the parse returns; a missing, unreadable or foreign
    memo is parsed again."""
    return list(_documents(tuple(sorted(modules)), min_chars))


@functools.lru_cache(maxsize=4)
def _documents(modules: Tuple[str, ...], min_chars: int) -> Tuple[str, ...]:
    memo = os.path.join(default_cache_dir(), "default_corpus", "documents",
                        _source_key(modules, {"min_chars": min_chars}) + ".json")
    try:
        with open(memo, encoding="utf-8") as f:
            docs = json.load(f)
        if isinstance(docs, list) and docs and all(isinstance(d, str) for d in docs):
            return tuple(docs)
    except (OSError, ValueError):
        pass
    docs = _collect(modules, min_chars)
    _write_file(memo, json.dumps(list(docs)))
    return docs


@functools.lru_cache(maxsize=4)
def _collect(modules: Tuple[str, ...], min_chars: int) -> Tuple[str, ...]:
    stdlib = sysconfig.get_paths()["stdlib"]
    docs: List[str] = []
    seen = set()
    for name in sorted(modules):
        path = _module_file(stdlib, name)
        if path is None or path in seen:
            continue
        seen.add(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            source = f.read()
        for doc in _docstrings(source):
            doc = doc.strip()
            if len(doc) >= min_chars:
                docs.append(doc)
    if not docs:
        raise RuntimeError(f"no documentation strings found under {stdlib}: this Python install has no "
                           f"stdlib sources; pass a dataset and tokenizer explicitly")
    return tuple(docs)


def corpus_fingerprint(documents: Sequence[str], **settings) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    for d in documents:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def _train_tokenizer(documents: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tok


def _write_tokenizer_dir(tok, directory: str, model_max_length: int) -> None:
    tok.save(os.path.join(directory, "tokenizer.json"), pretty=False)
    eos_id = tok.token_to_id(EOS_TOKEN)
    special = {"content": EOS_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(eos_id): special},
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, f, indent=2, sort_keys=True)
        f.write("\n")


def build_default_corpus(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Optional[str] = None,
                         *, modules: Sequence[str] = DEFAULT_MODULES, model_max_length: int = 1 << 20) -> str:
    """Build (or find in the cache) the default tokenizer and token files; return their directory.

    The directory holds a Hugging Face tokenizer (``AutoTokenizer.from_pretrained(dir)``) and the
    tokenized corpus ``dir/corpus.bin`` + ``dir/corpus.idx`` (Megatron format).
    """
    if not 256 + 1 <= vocab_size <= 65499:
        raise ValueError(f"vocab_size must be in [257, 65499] (256 byte symbols + EOS), got {vocab_size}")
    root = os.path.join(cache_dir or default_cache_dir(), "default_corpus")
    settings = dict(vocab_size=vocab_size, model_max_length=model_max_length, min_chars=MIN_DOC_CHARS,
                    eos=EOS_TOKEN)
    # Fast path: the source files' names, sizes and mtimes map to a built directory (which itself is
    # keyed by the content hash), so a warm start does not re-read the stdlib.
    pointer = os.path.join(root, "by_source", _source_key(modules, settings))
    try:
        with open(pointer) as f:
            known = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(known, "corpus.idx")):
            return known
    except OSError:
        pass
    documents = collect_documents(modules)
    key = corpus_fingerprint(documents, **settings)
    name = f"v{vocab_size}-{key}"
    final = os.path.join(root, name)
    if os.path.isfile(os.path.join(final, "corpus.idx")):
        _write_pointer(pointer, name)
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        tok = _train_tokenizer(documents, vocab_size)
        _write_tokenizer_dir(tok, tmp, model_max_length)
        eos_id = tok.token_to_id(EOS_TOKEN)
        from hyperacc.data.megatron_writer import IndexedDatasetWriter

        with IndexedDatasetWriter(os.path.join(tmp, "corpus"), vocab_size=tok.get_vocab_size()) as w:
            for enc in tok.encode_batch(list(documents), add_special_tokens=False):
                w.add_document(enc.ids + [eos_id])
        with open(os.path.join(tmp, "corpus.json"), "w") as f:
            json.dump({"modules": list(modules), "documents": len(documents), "key": key,
                       "vocab_size": vocab_size, "format": FORMAT_VERSION}, f, indent=2)
            f.write("\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "corpus.idx")):  # not a lost race: a real error
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    _write_pointer(pointer, name)
    return final


def _source_key(modules: Sequence[str], settings: dict) -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "stdlib": stdlib, **settings}, sort_keys=True).encode())
    for name in sorted(modules):
        path = _module_file(stdlib, name)
        if path is not None:
            st = os.stat(path)
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:24]


def _write_pointer(pointer: str, name: str) -> None:
    _write_file(pointer, name + "\n")


def _write_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader sees the old file or the whole new one)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass  # only an optimisation


def default_tokenizer_dir(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Optional[str] = None) -> str:
    """Directory of the default tokenizer, built on first use."""
    return build_default_corpus(vocab_size, cache_dir)


def default_token_prefix(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Optional[str] = None) -> str:
    """Megatron prefix of the tokenized default corpus (``PREFIX.bin`` / ``PREFIX.idx``)."""
    return os.path.join(build_default_corpus(vocab_size, cache_dir), "corpus")


def load_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Optional[str] = None):
    """The default tokenizer as a transformers tokenizer (``len(tok) == vocab_size``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_tokenizer_dir(vocab_size, cache_dir))
