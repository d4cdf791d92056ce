"""How long each phase of a checkpoint call took (reported, e.g. by benchmarks/checkpoint.py)."""
from __future__ import annotations

import time


class PhaseClock:
    """Seconds per phase of one save or load (``Checkpointer.last_load_timings``), and the total."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps = {}

    def lap(self, name):
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    def done(self):
        self.laps["total"] = time.perf_counter() - self.start
        return self.laps
