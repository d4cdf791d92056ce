"""Asynchronous saves: the state is staged into CPU memory, then written by a background thread.

Why a module of its own: the Checkpointer decides *what* and *where*; this holds the machinery of
*when it lands* -- one save in flight at a time (a new save, a load or the end of training waits for
it and re-raises its error), reused staging buffers (`storage.ReusableCpuStager`), and a process group
of its own, because the background thread's collectives must not interleave with the training loop's
on the same group.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Optional

import torch.distributed as dist

from hyperacc.checkpoint import _comm, storage


class AsyncSaves:
    """The async save in flight (at most one) and what it reuses from one save to the next."""

    def __init__(self):
        self.pending: Optional[concurrent.futures.Future] = None
        self.pending_path: Optional[str] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._group = None
        self._stager: Optional[storage.ReusableCpuStager] = None

    def start(self, payload: dict, path: str, writer, on_complete: Callable[[], None]) -> None:
        """Stage ``payload`` (returns once the caller may change its tensors), then write it in the
        background; ``on_complete()`` runs on rank 0 once every rank's files and ``.metadata`` are written."""
        if self._stager is None:
            self._stager = storage.ReusableCpuStager()
        upload = storage.dcp_async_save(payload, path, process_group=self._process_group(), stager=self._stager,
                                        storage_writer=writer)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hyperacc-ckpt")
        self.pending = self._executor.submit(self._complete, upload, path, on_complete)
        self.pending_path = path

    def wait(self) -> None:
        """Block until the save in flight (if any) completed; re-raise its error."""
        pending, self.pending, self.pending_path = self.pending, None, None
        if pending is not None:
            pending.result()

    def reap(self) -> None:
        """`wait` for a save that has already finished (its error surfaces at the next step, not later)."""
        if self.pending is not None and self.pending.done():
            self.wait()

    def close(self) -> None:
        """After the last `wait`: stop the thread, drop the staging buffers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _process_group(self):
        if not _comm.distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @staticmethod
    def _complete(upload: concurrent.futures.Future, path: str, on_complete: Callable[[], None]) -> str:
        upload.result()  # on rank 0 this returns after every rank's files and .metadata are written
        if _comm.rank() == 0:
            on_complete()
        return path
