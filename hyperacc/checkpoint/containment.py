"""Containment: what hyperacc may touch inside ``checkpoint_dir``, and how it writes there.

A symlink inside ``checkpoint_dir`` points at something hyperacc did not create (another run's
checkpoint, a shared archive). hyperacc never deletes, renames or writes *through* one: a
symlinked ``global_step_<N>`` is "foreign" (read if asked to, never written into or pruned), and
every small file hyperacc writes (pointer, sentinel, manifest, extra state, config.yaml) goes to a
fresh temp file opened with ``O_NOFOLLOW | O_EXCL`` and is renamed over the final name, so a
crash leaves either the old file or the new one and a planted link is replaced, never followed.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Union

from hyperacc.errors import ForeignPathError  # noqa: F401 - defined with every error class

logger = logging.getLogger("hyperacc.checkpoint")

RUN_CONFIG_FILE = "config.yaml"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_foreign(path: str) -> bool:
    """A symlink (to anything, dangling included): not hyperacc's to write into or delete."""
    return os.path.islink(path)


def refuse_foreign(path: str, action: str) -> None:
    if is_foreign(path):
        raise ForeignPathError(f"{path} is a symlink (to {os.readlink(path)!r}): hyperacc never {action} "
                               "through a symlink inside checkpoint_dir. Remove the link or use another "
                               "CheckpointConfig.checkpoint_dir.")


def open_new_file(path: str):
    """Open ``path`` for writing, creating it; fails instead of following a symlink planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644)
    return os.fdopen(fd, "wb")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: Union[bytes, str], *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` all or nothing: new temp file (never a followed link), fsync,
    rename over ``path`` (which replaces a link named ``path`` instead of writing into its target)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)   # a leftover of this pid's crashed write (a link is unlinked, not followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(parent)


def write_run_config(checkpoint_dir: str, text: str) -> str:
    """Atomically write the run's config (YAML text) as ``<checkpoint_dir>/config.yaml``.

    Call it only once a resume was accepted (or when starting fresh): a rejected resume must leave
    the config that produced the existing checkpoints in place. Returns the path written.
    """
    path = os.path.join(checkpoint_dir, RUN_CONFIG_FILE)
    atomic_write(path, text)
    return path


def remove_tree(path: str) -> bool:
    """Delete one checkpoint directory hyperacc wrote; a symlink is left alone (returns False).

    ``.metadata`` goes first so that a crash mid-way leaves an incomplete (ignored) directory.
    ``shutil.rmtree`` unlinks links found inside the tree without following them.
    """
    if is_foreign(path) or not os.path.isdir(path):
        return False
    marker = os.path.join(path, ".metadata")
    if os.path.lexists(marker):
        os.unlink(marker)
    failures = []
    shutil.rmtree(path, onerror=lambda _fn, name, exc: failures.append(f"{name}: {exc[1]}"))
    if failures:
        logger.warning("could not remove all of %s: %s", path, "; ".join(failures[:3]))
    return True
