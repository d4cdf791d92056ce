"""Housekeeping around the training step: this process's memory, a step timer that can wait for
the device, and periodic garbage collection / device-cache emptying at the same step on every rank.
(`hyperacc.training.metrics` reports what these measure.)"""
from __future__ import annotations

import gc
import os
import time
from typing import Dict, Optional

from hyperacc.runtime import device_module

_GIB = float(1 << 30)


def _rss_bytes() -> Optional[int]:
    try:
        import psutil  # optional
        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:  # noqa: BLE001
        return None


def device_memory_gib(device_type: str = "cpu") -> Dict[str, float]:
    """This process's memory in GiB: allocator counters on cuda/npu, RSS on CPU ({} if unknown)."""
    module = device_module(device_type)
    if module is not None:
        return {"memory_allocated_gib": module.memory_allocated() / _GIB,
                "memory_reserved_gib": module.memory_reserved() / _GIB,
                "max_memory_allocated_gib": module.max_memory_allocated() / _GIB}
    rss = _rss_bytes()
    return {} if rss is None else {"memory_rss_gib": rss / _GIB}


class StepTimer:
    """Wall time of a block, optionally synchronizing the device first (accurate async timing).

    ``with timer: ...`` then ``timer.elapsed`` (seconds); or ``timer.start()`` / ``timer.stop()``.
    """

    def __init__(self, device_type: str = "cpu", synchronize: bool = True):
        self._module = device_module(device_type) if synchronize else None
        self._start: Optional[float] = None
        self.elapsed = 0.0

    def _sync(self):
        if self._module is not None:
            self._module.synchronize()

    def start(self) -> "StepTimer":
        self._sync()
        self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        if self._start is None:
            raise RuntimeError("StepTimer.stop() called before start()")
        self._sync()
        self.elapsed = time.perf_counter() - self._start
        self._start = None
        return self.elapsed

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


class PeriodicCleanup:
    """``gc.collect()`` every ``gc_steps`` steps and empty the device cache every
    ``empty_cache_steps`` (0 = never). Call ``maybe_run(step)`` once per optimizer step.

    ``disable_automatic_gc=True`` (only with ``gc_steps > 0``) turns Python's automatic collection
    off so that collections happen on all ranks at the same step (no straggler from a random
    collection); ``close()`` turns it back on.
    """

    def __init__(self, gc_steps: int = 0, empty_cache_steps: int = 0, device_type: str = "cpu",
                 disable_automatic_gc: bool = False):
        if gc_steps < 0 or empty_cache_steps < 0:
            raise ValueError("gc_steps and empty_cache_steps must be >= 0 (0 = never)")
        self.gc_steps = gc_steps
        self.empty_cache_steps = empty_cache_steps
        self._module = device_module(device_type)
        self._reenable_gc = False
        if disable_automatic_gc and gc_steps > 0 and gc.isenabled():
            gc.disable()
            self._reenable_gc = True
        self.gc_runs = 0
        self.cache_runs = 0

    def maybe_run(self, step: int) -> None:
        if self.gc_steps and step % self.gc_steps == 0:
            gc.collect()
            self.gc_runs += 1
        if self.empty_cache_steps and step % self.empty_cache_steps == 0:
            if self._module is not None:
                self._module.empty_cache()
            self.cache_runs += 1

    def close(self) -> None:
        if self._reenable_gc:
            gc.enable()
            self._reenable_gc = False
