"""Which rank went silent: heartbeats in the launcher's store, read when a collective times out.

A rank that stops (SIGSTOP, a wedged driver, a node that hangs) leaves every other rank waiting in
its next collective until the process group's timeout, and the error then only says that some
receive timed out. So each rank runs a daemon thread that writes "<step> <count>" into the c10d
store torchrun already runs (one small set every ``interval_s``, the count incremented each time).
A blocked collective releases the GIL, so a rank that merely waits keeps beating; a stopped process,
or one whose Python is wedged, does not. When a collective times out, the ranks still alive read
every heartbeat twice, ``2 x interval_s`` apart: the ranks whose count did not move are silent,
and the line names them and the step. Comparing counts, not clocks, needs no clock agreement
between nodes. The beat also carries the phase the caller sets (``heartbeat.phase = "building the
data"``, "prepare", "load_state", "the final save"; "training" by default), so a hang outside the
loop names what this rank and each silent rank were doing.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
import time
import weakref
from typing import Dict, List, Optional

import torch.distributed as dist

from hyperacc.config.launch_env import env_value
from hyperacc.errors import CollectiveTimeout  # noqa: F401 - defined with every error class

TIMEOUT_WORDS = ("timed out", "timeout")

# Heartbeats whose thread may still run. A daemon thread caught inside a store call (C++, GIL released) when
# the interpreter finalizes is ended by pthread_exit while it unwinds through C++ frames that may not throw:
# the process aborts with "terminate called without an active exception" (22 of 30 exits with a 0.1 ms beat;
# a CI run lost 14 tests to it in a script that made five Accelerators and never ended them). So every
# heartbeat still running at exit is stopped and joined by an atexit hook, before finalization begins.
_LIVE: "weakref.WeakSet[Heartbeat]" = weakref.WeakSet()
_STOP_AT_EXIT = []


def _stop_all() -> None:
    for heartbeat in list(_LIVE):
        heartbeat.close()


def is_collective_timeout(err: BaseException) -> bool:
    """A process-group collective that gave up waiting (gloo: "Timed out waiting ... for recv")."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, dist.DistError)) and any(word in text for word in TIMEOUT_WORDS)


def _launcher_store(timeout_s: float):
    """A client of the c10d store torchrun's agent hosts (MASTER_ADDR:MASTER_PORT), or None."""
    host, port = env_value("MASTER_ADDR"), env_value("MASTER_PORT")
    if not host or not port or env_value("TORCHELASTIC_RUN_ID") is None:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError):
        return None


class Heartbeat:
    """This rank's heartbeat thread, and the diagnosis of a timed-out collective (see module doc)."""

    def __init__(self, rank: int, world_size: int, *, timeout_s: Optional[float] = None, interval_s: float = 2.0,
                 store=None):
        """``timeout_s``: the process group's collective timeout (named in the diagnosis)."""
        self.rank, self.world_size, self.interval_s, self.timeout_s = rank, world_size, interval_s, timeout_s
        self._step, self._count = 0, 0     # the optimizer step this rank is working on; beats so far
        self._phase = "training"           # what this rank is doing (set by the caller: "building the data" ...)
        self._lock = threading.Lock()      # the thread and the training loop share one store client
        self.store = store if store is not None else (_launcher_store(10.0) if world_size > 1 else None)
        restart = env_value("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"hyperacc/heartbeat/{env_value('TORCHELASTIC_RUN_ID', 'run')}/{restart}"
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="hyperacc-heartbeat", daemon=True)
            self._thread.start()
            for older in [b for b in _LIVE if (b._prefix, b.rank) == (self._prefix, self.rank)]:
                older.close()   # an earlier Accelerator's in this process beats the same key: one thread is enough
            _LIVE.add(self)
            if not _STOP_AT_EXIT:
                atexit.register(_stop_all)
                _STOP_AT_EXIT.append(_stop_all)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        """A new step is published at once (one store set per step), not at the next beat."""
        self._step = int(value)
        if self.store is not None:
            self._beat()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        """What the job does now ("building the data", "prepare", "load_state", "the final save"...):
        named in the diagnosis, for this rank and for the silent ones. Published at once."""
        self._phase = str(value)
        if self.store is not None:
            self._beat()

    def _beat(self) -> None:
        with self._lock:
            self._count += 1
            self.store.set(f"{self._prefix}/{self.rank}", f"{self._step} {self._count} {self._phase}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store went away with the job: nothing to report to
                return

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread and wait for its beat in flight (a store set: bounded by the store's timeout)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        _LIVE.discard(self)

    def _read(self) -> Dict[int, Optional[str]]:
        out = {}
        with self._lock:
            for rank in range(self.world_size):   # check() first: get() would wait for a missing key
                key = f"{self._prefix}/{rank}"
                out[rank] = self.store.get(key).decode() if self.store.check([key]) else None
        return out

    def silent_ranks(self) -> List[tuple]:
        """[(rank, last step it reported, its phase)] of the ranks whose heartbeat stopped moving."""
        first = self._read()
        time.sleep(2 * self.interval_s)
        second = self._read()
        silent = []
        for rank in range(self.world_size):
            if rank != self.rank and (second[rank] is None or second[rank] == first[rank]):
                silent.append((rank, *_parse_beat(second[rank])))
        return silent

    @contextlib.contextmanager
    def watching(self):
        """Turn a collective timeout raised inside into a `CollectiveTimeout` naming the silent ranks."""
        try:
            yield
        except Exception as err:
            message = self.explain(err)
            if message is None:
                raise
            raise CollectiveTimeout(message) from err

    def explain(self, err: BaseException) -> Optional[str]:
        """One line for a collective timeout (None for any other error)."""
        if not is_collective_timeout(err):
            return None
        waited = f" after {self.timeout_s:g} s" if self.timeout_s else ""
        where = f"step {self.step}" if self._phase == "training" else f"{self._phase} (step {self.step})"
        if self.store is None:
            return (f"{where}: a collective timed out{waited} on rank {self.rank}; no launcher store to "
                    "tell which rank went silent (run under torchrun / accelerate launch).")
        try:
            silent = self.silent_ranks()
        except Exception as store_err:  # noqa: BLE001 - the diagnosis must not hide the timeout
            return f"{where}: a collective timed out{waited} on rank {self.rank} (heartbeats unreadable: {store_err})."
        if not silent:
            return (f"{where}: a collective timed out{waited} on rank {self.rank}, but every rank's heartbeat "
                    "still moves: some rank is stuck outside Python (a kernel, I/O) or far behind.")
        names = ", ".join(f"{rank} (last at step {step}{'' if phase == 'training' else ', ' + phase})"
                          for rank, step, phase in silent)
        return (f"{where}: a collective timed out{waited} on rank {self.rank}; silent rank(s): {names}. "
                "The job stops so that an elastic launcher (torchrun --max-restarts) restarts it from LATEST.")


def _parse_beat(text: Optional[str]) -> tuple:
    """(step, phase) from a heartbeat "<step> <count> <phase>" (older beats have no phase)."""
    if not text:
        return "?", "not started"
    parts = text.split(" ", 2)
    return parts[0], (parts[2] if len(parts) > 2 else "training")
