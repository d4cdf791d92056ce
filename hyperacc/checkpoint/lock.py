"""Single writer: one job at a time may save into a ``checkpoint_dir``.

Two jobs writing one directory (a relaunch while orphaned workers of the previous launch still
run, two users sharing a path) move LATEST under each other and prune each other's checkpoints.
Rank 0 of a job that may save holds ``fcntl.flock`` on ``<checkpoint_dir>/.hyperacc.lock``; the
kernel drops the lock when the process dies, however it dies, so a crashed job never leaves a
stale lock behind. The file names the holder (host, pid, start time) for the error the second
job gets. The Checkpointer asks rank 0 and broadcasts the verdict, so every rank of the second
job fails at once, before any collective could wait for rank 0.

Caveat: ``flock`` is per host on some network file systems (older NFS); there the lock only
protects against a second job started on the same host.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from hyperacc.checkpoint import containment

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, no single-writer check
    fcntl = None

LOCK_FILE = ".hyperacc.lock"


class CheckpointDirLocked(RuntimeError):
    """Another job holds the checkpoint directory."""


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown (the lock file names none yet)"


class DirLock:
    """An exclusive, process-lifetime lock on one checkpoint directory (used on rank 0 only)."""

    def __init__(self, checkpoint_dir: str):
        self.root = os.path.abspath(checkpoint_dir)
        self.path = os.path.join(self.root, LOCK_FILE)
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (no-op when held). Raises CheckpointDirLocked naming the holder."""
        if self._fd is not None or fcntl is None:
            return
        os.makedirs(self.root, exist_ok=True)
        containment.refuse_foreign(self.path, "writes")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            if self._held_by_this_process(holder):
                return   # another Checkpointer of this very process (sequential use in one script)
            raise CheckpointDirLocked(
                f"checkpoint_dir {self.root} is in use by another job ({_describe(holder)}): two jobs "
                "must not save into one directory. Stop that job (or wait for it to end), or use another "
                "checkpoint_dir.") from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
        self._fd = fd

    @staticmethod
    def _held_by_this_process(text: str) -> bool:
        try:
            holder = json.loads(text)
        except ValueError:
            return False
        return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a job about to lock it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
