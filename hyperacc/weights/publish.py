"""Putting a finished export into its directory, also in place of hyperacc's own earlier export.

Why: transformers' `Trainer` saves into the same ``output_dir`` again and again, beside files that
are no part of the export (checkpoints, a tokenizer, ``training_args.bin``). A save must therefore
replace the previous export -- and only an export hyperacc itself wrote -- such that no reader ever
loads a mix of old and new files, and a crash mid-way still leaves a loadable model.

How an export is known as hyperacc's own: next to it hyperacc writes ``.hyperacc_export.json`` (the
marker: the export's file names and its mark, a random id per export) and puts the mark into every
safetensors header and the index metadata. A weight file the marker does not list, or whose mark is
not the marker's (say, a ``save_pretrained`` over the export), is someone else's: the save is
refused, naming it. Files that are no part of an export are never touched.

The replacement (rank 0, once every new file is complete in the temporary directory):
  1. the marker lists the old and the new files (from here on a crash leaves nothing unaccounted for);
  2. the new shards, then ``config.json``/``generation_config.json``, move in; shard names never
     equal those the old index points to (`writer.shard_names`), so the old export stays whole;
  3. the entry point moves in, atomically: ``model.safetensors``, the index, or
     ``adapter_model.safetensors``;
  4. the old files the new export lacks are removed, the old entry point first;
  5. the marker lists the new files only.
Readers take ``model.safetensors`` before the index (transformers and `WeightFiles` alike), so at each
step the weights a reader finds are the whole old export or the whole new one. The configs are
replaced one by one just before the weights (the same model saved again has the same config).
A reader that is halfway through loading when step 4 removes an old shard fails; it never gets a mix.
A crash leaves the old or the new export loadable, and the next save removes what is left over.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from typing import Dict, FrozenSet, Iterable, List, Optional

from hyperacc.weights.files import INDEX_FILE, MARK_KEY, SINGLE_FILE, header_metadata

MARKER = ".hyperacc_export.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ENTRY_POINTS = (SINGLE_FILE, INDEX_FILE, ADAPTER_WEIGHTS)   # what a reader opens first
CONFIGS = ("config.json", "generation_config.json")
ADAPTER_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin", "adapter_config.json")
KEEP_THEIRS = ("README.md",)      # PEFT writes one; a README already there is the user's and stays
ASIDE = ".hyperacc-replaced"      # an old adapter sub-directory while its new one moves in


@dataclasses.dataclass(frozen=True)
class Target:
    """What every rank needs to know before writing: the temporary directory, the new export's mark,
    and the shard names the current export uses (the new plan avoids them)."""

    tmp: str
    mark: str
    in_use: FrozenSet[str]


# --------------------------------------------------------------------------- marker and ownership
def read_marker(directory: str) -> Optional[Dict[str, List[str]]]:
    """The marker's {"marks": [...], "files": [...]}, or None (absent or not hyperacc's)."""
    try:
        with open(os.path.join(directory, MARKER)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != "hyperacc-export":
        return None
    return {"marks": [str(m) for m in data.get("marks", [])], "files": [str(f) for f in data.get("files", [])]}


def write_marker(directory: str, marks: Iterable[str], files: Iterable[str]) -> None:
    """Atomically (temp file + rename): a reader of the marker sees the old list or the new one."""
    path = os.path.join(directory, MARKER)
    with open(path + ".tmp", "w") as handle:
        json.dump({"format": "hyperacc-export", "version": 1, "marks": sorted(set(marks)),
                   "files": sorted(set(files))}, handle, indent=1)
    os.replace(path + ".tmp", path)


def file_mark(path: str) -> Optional[str]:
    """The export mark inside a safetensors header or an index's metadata (None: no mark)."""
    if path.endswith(".safetensors"):
        return (header_metadata(path) or {}).get(MARK_KEY)
    if path.endswith(".index.json"):
        try:
            with open(path) as handle:
                return (json.load(handle).get("metadata") or {}).get(MARK_KEY)
        except (OSError, ValueError, AttributeError):
            return None
    return None


def _not_ours_because(directory: str, name: str, marker) -> Optional[str]:
    """Why ``name`` in ``directory`` is not hyperacc's own export file (None: it is)."""
    if marker is None:
        return f"there is no {MARKER} beside it"
    if name not in marker["files"]:
        return f"{MARKER} does not list it"
    path = os.path.join(directory, name)
    if name.endswith((".safetensors", ".index.json")) and file_mark(path) not in marker["marks"]:
        return "it does not carry the mark of hyperacc's export (it was written over since)"
    return None


def _guarded(name: str, kind: str) -> bool:
    """Names an export of ``kind`` ("model" or "adapter") must not write over unless they are its own."""
    if kind == "adapter":
        return name in ADAPTER_FILES
    return name.endswith((".safetensors", ".safetensors.index.json")) or name in CONFIGS


def check_replaceable(out_dir: str, kind: str, new_names: Iterable[str] = ()) -> None:
    """Raise one FileExistsError naming the first file in ``out_dir`` that the export would replace
    but hyperacc did not write, and the fix."""
    marker, new_names = read_marker(out_dir), set(new_names)
    for name in sorted(os.listdir(out_dir)):
        if name in KEEP_THEIRS or not (_guarded(name, kind) or name in new_names):
            continue
        why = _not_ours_because(out_dir, name, marker)
        if why is not None:
            raise FileExistsError(
                f"{out_dir} already holds {name}, which hyperacc did not write ({why}); hyperacc replaces "
                f"only its own earlier export there and never writes over other files. Fix: save to a new or "
                f"empty directory, or move {name} (and the rest of the model it belongs to) out of {out_dir}.")


def owned_files(out_dir: str, marker) -> List[str]:
    """The files of hyperacc's earlier export(s) in ``out_dir`` that are still as it wrote them."""
    if marker is None:
        return []
    present = set(os.listdir(out_dir))
    return [n for n in marker["files"] if n in present and _not_ours_because(out_dir, n, marker) is None]


def shards_in_use(out_dir: str) -> FrozenSet[str]:
    """The files the current export's entry points name: a new export must not write over them."""
    names = {SINGLE_FILE}
    try:
        with open(os.path.join(out_dir, INDEX_FILE)) as handle:
            names.update(str(v) for v in json.load(handle).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        pass
    return frozenset(names)


# --------------------------------------------------------------------------- start and publish
def start(out_dir: str, into_existing: bool, kind: str = "model") -> Target:
    """Rank 0, before anything is written: refuse what must not be replaced, clear a stale temp
    directory of ours, create the temp directory."""
    if os.path.islink(out_dir) or os.path.isfile(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose another output directory.")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not into_existing:
            what = sorted(os.listdir(out_dir))[0]
            raise FileExistsError(f"{out_dir} is not empty (it holds {what}); this export never writes into a "
                                  "directory: export to a new directory or remove it.")
        check_replaceable(out_dir, kind)
    tmp = f"{out_dir}.tmp-hyperacc-export"
    if os.path.islink(tmp):
        raise FileExistsError(f"{tmp} is a symlink; remove it.")
    shutil.rmtree(tmp, ignore_errors=True)      # a crashed export of ours; never a user's directory name
    os.makedirs(tmp)
    in_use = shards_in_use(out_dir) if os.path.isdir(out_dir) else frozenset()
    return Target(tmp, uuid.uuid4().hex, in_use)


def publish(tmp: str, out_dir: str, mark: str, kind: str = "model") -> str:
    """Rank 0: move the complete export in ``tmp`` into ``out_dir`` (see the module docstring for the
    order and what it guarantees). Returns ``out_dir``."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        write_marker(tmp, [mark], _exported(tmp, out_dir))
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)            # a fresh directory: everything appears at once
        return out_dir
    new = _exported(tmp, out_dir)
    check_replaceable(out_dir, kind, new)   # again: something may have arrived while we wrote
    marker = read_marker(out_dir)
    old = owned_files(out_dir, marker)
    asides = [n + ASIDE for n in new if os.path.isdir(os.path.join(out_dir, n))]
    write_marker(out_dir, (marker["marks"] if marker else []) + [mark], old + new + asides)
    for name in sorted(new, key=_move_order):
        _move(os.path.join(tmp, name), os.path.join(out_dir, name))
    for name in sorted(set(old) - set(new), key=lambda n: n not in ENTRY_POINTS):
        _remove(os.path.join(out_dir, name))
    write_marker(out_dir, [mark], new)
    shutil.rmtree(tmp)
    return out_dir


def _exported(tmp: str, out_dir: str) -> List[str]:
    """The names the new export brings (a README the user already has stays theirs)."""
    return [n for n in sorted(os.listdir(tmp))
            if not (n in KEEP_THEIRS and os.path.exists(os.path.join(out_dir, n))) and n != MARKER]


def _move_order(name: str) -> int:
    """Shards (and anything else) first, then configs, the entry points last."""
    return 2 if name in ENTRY_POINTS else 1 if name in CONFIGS or name.endswith("_config.json") else 0


def _move(src: str, dst: str) -> None:
    """A file replaces its old version atomically; a directory (a non-default adapter) replaces its
    old version via a short-lived aside copy."""
    if os.path.isdir(src) and os.path.isdir(dst):
        shutil.rmtree(dst + ASIDE, ignore_errors=True)      # left by a crashed save of ours
        os.replace(dst, dst + ASIDE)
        os.replace(src, dst)
        shutil.rmtree(dst + ASIDE)
    else:
        os.replace(src, dst)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
