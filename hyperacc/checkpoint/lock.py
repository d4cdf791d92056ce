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

from hyperacc.checkpoint import _comm, containment
from hyperacc.errors import CheckpointDirLocked  # noqa: F401 - defined with every error class
from hyperacc.errors import CheckpointDirNotShared  # noqa: F401 - defined with every error class

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, no single-writer check
    fcntl = None

LOCK_FILE = ".hyperacc.lock"


def lock_shared(lock: "DirLock", checkpoint_dir: str, group=None) -> None:
    """Collective: rank 0 takes ``lock``; then every rank checks it sees rank 0's lock record in
    ``checkpoint_dir`` (`shared_problem`) and every rank raises the same CheckpointDirNotShared if one
    does not."""
    rank0 = _comm.decide_on_rank0(lambda: (lock.root, lock.acquire()), group)
    problems = _comm.all_gather(shared_problem(checkpoint_dir, rank0), group)
    if any(problems):
        raise CheckpointDirNotShared(next(p for p in problems if p))


def shared_problem(checkpoint_dir: str, rank0: tuple) -> Optional[str]:
    """On every rank, after rank 0 took the lock (``rank0`` = its directory and lock record): None
    when this rank uses the same directory and reads rank 0's record there; else what is wrong. A
    node that does not see it would save its shards where no other node (and no resume) finds them."""
    root, record = rank0
    if os.path.abspath(checkpoint_dir) != root:
        return (f"checkpoint_dir is {root} on rank 0 but {os.path.abspath(checkpoint_dir)} on host "
                f"{socket.gethostname()}: every rank must save into the same (shared) directory. Fix: launch every "
                "node with the same CheckpointConfig.checkpoint_dir.")
    if record is None:
        return None
    try:
        with open(os.path.join(root, LOCK_FILE), encoding="utf-8") as handle:
            seen = handle.read()
    except OSError:
        seen = None
    if seen == record:
        return None
    return (f"checkpoint_dir {root} is not shared between the nodes: host {socket.gethostname()} does not see the "
            f"lock file rank 0 wrote there ({_describe(record)}). Every rank writes its shards into checkpoint_dir: "
            "put it on storage all nodes mount (NFS, Lustre, a shared volume) at the same path.")


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

    def acquire(self) -> Optional[str]:
        """Take the lock (no-op when held); returns the lock record written (None without locks).
        Raises CheckpointDirLocked naming the holder."""
        if fcntl is None:
            return None
        if self._fd is not None:
            return os.pread(self._fd, 4096, 0).decode("utf-8", "replace")
        os.makedirs(self.root, exist_ok=True)
        containment.refuse_foreign(self.path, "writes")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            if self._held_by_this_process(holder):
                return holder   # another Checkpointer of this very process (sequential use in one script)
            raise CheckpointDirLocked(
                f"checkpoint_dir {self.root} is in use by another job ({_describe(holder)}): two jobs "
                "must not save into one directory. Stop that job (or wait for it to end), or use another "
                "CheckpointConfig.checkpoint_dir.") from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
        os.fsync(fd)      # other nodes read it at once (`shared_problem`); NFS flushes on fsync, not on pwrite
        self._fd = fd
        return record + "\n"

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
