"""Exit with heartbeat threads beating as fast as they can: the process must end with status 0.

    heartbeat_exit.py N

N heartbeats of N ranks (each its own store client, a 0.1 ms beat, never closed) on a local TCPStore; the
script then returns. Without the atexit hook that stops them, a thread caught in a store set at finalization
aborts the process ("terminate called without an active exception"): 5 of 5 exits with twelve.
"""
import datetime
import sys
import time

import torch.distributed as dist

from hyperacc.runtime.watchdog import Heartbeat

store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
count = int(sys.argv[1])      # one rank each: heartbeats of one rank replace each other (one thread per key)
beats = [Heartbeat(rank, count, store=dist.TCPStore("127.0.0.1", store.port, is_master=False), interval_s=0.0001)
         for rank in range(count)]
deadline = time.monotonic() + 30          # a loaded machine (a test suite beside) schedules the threads late
while not all(b._count > 2 for b in beats) and time.monotonic() < deadline:
    time.sleep(0.05)
assert all(b._count > 2 for b in beats), "the heartbeats did not beat"
time.sleep(0.1)                              # beating as fast as they can when the interpreter exits
