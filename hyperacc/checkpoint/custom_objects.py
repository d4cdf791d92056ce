"""accelerate-compatible extras of a checkpoint: objects registered with `register_for_checkpointing`
and the `<project_dir>/checkpoints/checkpoint_<i>` naming of `ProjectConfiguration`.

Registered objects join the checkpoint's dict of Stateful buckets (`hyperacc.checkpoint.state`) under
``custom_checkpoint_<i>``: they are written as accelerate writes them (`custom_checkpoint_<i>.pkl`, a state
dict saved by the main process, before the checkpoint's `.metadata` and inside its integrity manifest),
their count is checked on rank 0 before anything loads, and they are read back with `weights_only=True`:
a checkpoint never runs code.
Automatic naming prunes old `checkpoint_<i>` directories for `total_limit`, but never a symlink.
"""
from __future__ import annotations

import io
import logging
import os
import re
import shutil
from typing import Dict, List, Optional

import torch

from hyperacc.checkpoint import containment, integrity

logger = logging.getLogger("hyperacc.checkpoint")
_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")


def key(index: int) -> str:
    """The state-dict key (and file stem) of the ``index``-th registered object: accelerate's naming."""
    return f"custom_checkpoint_{index}"


def _path(directory: str, name: str) -> str:
    return os.path.join(directory, f"{name}.pkl")


def save(objects: Dict[str, object], directory: str, *, is_main: bool) -> Dict[str, dict]:
    """Write each object's ``state_dict()`` (main process; ``objects``: key -> object) before the checkpoint
    is complete; returns their digests, which the checkpoint's integrity manifest then covers like its own files."""
    if not is_main:
        return {}
    digests = {}
    for name, obj in objects.items():
        buffer = io.BytesIO()
        torch.save(obj.state_dict(), buffer)
        data = buffer.getvalue()
        containment.atomic_write(_path(directory, name), data)
        digests[os.path.basename(_path(directory, name))] = integrity.digest_bytes(data)
    return digests


def save_files(files: Dict[str, bytes], directory: str, *, is_main: bool) -> Dict[str, dict]:
    """Write named files (main process) into a checkpoint before it is complete; returns their
    digests for its integrity manifest. A name is a plain file name, never a path."""
    if not is_main:
        return {}
    digests = {}
    for name, data in files.items():
        if os.path.basename(name) != name or name.startswith("."):
            raise ValueError(f"extra checkpoint file {name!r}: give a plain file name (no directory, no dot file).")
        containment.atomic_write(os.path.join(directory, name), data)
        digests[name] = integrity.digest_bytes(data)
    return digests


def count_problem(directory: str, registered: int) -> Optional[str]:
    """Rank 0, before anything loads: why the objects saved in ``directory`` cannot be restored into
    ``registered`` objects, or None."""
    found = [name for name in os.listdir(directory) if re.fullmatch(r"custom_checkpoint_\d+\.pkl", name)]
    if len(found) == registered:
        return None
    return (f"{directory} holds {len(found)} custom checkpoint(s) but {registered} object(s) are registered "
            "with register_for_checkpointing: register the same objects, in the same order, as the saving run.")


def load(objects: Dict[str, object], directory: str) -> None:
    """Each object's state, read with ``weights_only=True`` (a checkpoint never runs code); the count was
    checked by `count_problem`."""
    for name, obj in objects.items():
        obj.load_state_dict(torch.load(_path(directory, name), map_location="cpu", weights_only=True))


def _automatic_dirs(root: str) -> List[tuple]:
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _AUTOMATIC.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def next_automatic_dir(project_dir: str, iteration: int, total_limit: Optional[int], *, is_main: bool) -> str:
    """``<project_dir>/checkpoints/checkpoint_<iteration>``, after pruning to ``total_limit - 1`` old ones."""
    root = os.path.join(project_dir, "checkpoints")
    target = os.path.join(root, f"checkpoint_{iteration}")
    if os.path.exists(target):
        raise ValueError(f"Checkpoint directory {target} already exists: set "
                         "accelerator.project_configuration.iteration to the next free number.")
    existing = _automatic_dirs(root)
    if is_main and total_limit is not None and len(existing) + 1 > total_limit:
        for _, path in existing[: len(existing) + 1 - total_limit]:
            if os.path.islink(path):
                logger.warning("total_limit: %s is a symlink; it is left alone (hyperacc never deletes "
                               "through a link).", path)
                continue
            shutil.rmtree(path)
    return target


def newest_automatic_dir(project_dir: str) -> Optional[str]:
    found = _automatic_dirs(os.path.join(project_dir, "checkpoints"))
    if not found:
        raise ValueError(f"No checkpoint_<i> directory under {os.path.join(project_dir, 'checkpoints')}: "
                         "nothing to load (pass a path to load_state).")
    return found[-1][1]
