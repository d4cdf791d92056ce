"""Read-ahead for the micro-batch loader: items are collated in a daemon thread, at most
``_PREFETCH_DEPTH`` ahead, so collation overlaps the training step; errors reach the consumer and
``close()`` never hangs (a full queue is drained, the join is bounded)."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_PREFETCH_DEPTH = 2
_JOIN_TIMEOUT_S = 2.0


def _put(q: queue.Queue, message: tuple, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(message, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _prefetch_worker(produce: Callable[[int], Any], steps: range, q: queue.Queue,
                     stop: threading.Event) -> None:
    try:
        for step in steps:
            if stop.is_set():
                return
            if not _put(q, ("item", produce(step)), stop):
                return
        _put(q, ("end", None), stop)
    except BaseException as exc:   # handed to the consumer, re-raised there
        _put(q, ("error", exc), stop)


class Prefetcher:
    """Collate items in a daemon thread, at most ``_PREFETCH_DEPTH`` ahead; close() never hangs."""

    def __init__(self, produce: Callable[[int], Any], steps: range):
        self._produce, self._steps = produce, steps
        self._queue: queue.Queue = queue.Queue(maxsize=_PREFETCH_DEPTH)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=_prefetch_worker, name="hyperacc-prefetch", daemon=True,
                                            args=(self._produce, self._steps, self._queue, self._stop))
            self._thread.start()
        while True:
            try:
                kind, payload = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("the prefetch thread stopped without a result") from None
                continue
            if kind == "item":
                return payload
            self._done = True
            self.close()
            if kind == "error":
                raise payload
            raise StopIteration

    def close(self) -> None:
        self._done = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        while True:                       # unblock a put() in progress and drop read-ahead items
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        thread.join(timeout=_JOIN_TIMEOUT_S)

    def __del__(self):
        self._stop.set()
