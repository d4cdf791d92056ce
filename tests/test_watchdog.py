"""The heartbeat thread (hyperacc.runtime.watchdog) on a real local TCPStore: it beats, it stops when
closed, and a process that exits with heartbeats still running ends with status 0."""
import datetime
import subprocess
import sys
import time

import torch.distributed as dist

from dist_utils import REPO, _env
from hyperacc.runtime.watchdog import Heartbeat, _LIVE


def _store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    return master, dist.TCPStore("127.0.0.1", master.port, is_master=False)


def test_close_stops_and_joins_the_thread():
    master, client = _store()
    beat = Heartbeat(0, 2, store=client, interval_s=0.001)
    thread = beat._thread
    time.sleep(0.05)
    assert beat._count > 1 and beat in _LIVE
    beat.close()
    assert not thread.is_alive() and beat not in _LIVE
    count = beat._count
    time.sleep(0.02)
    assert beat._count == count, "a closed heartbeat kept beating"
    beat.close()   # twice is harmless


def test_exit_with_heartbeats_still_beating_ends_with_status_0():
    """12 never-closed heartbeats (12 ranks) at a 0.1 ms beat: 5 of 5 exits aborted (SIGABRT) without the atexit
    hook."""
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "heartbeat_exit.py"), "12"],
                              cwd=str(REPO), env=_env(None), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_new_heartbeat_for_the_same_rank_stops_the_older_thread():
    """A second Accelerator in one process: its heartbeat replaces the first one's thread (same key)."""
    master, client = _store()
    first = Heartbeat(0, 2, store=client, interval_s=0.001)
    thread = first._thread
    second = Heartbeat(0, 2, store=dist.TCPStore("127.0.0.1", master.port, is_master=False), interval_s=0.001)
    assert not thread.is_alive() and first not in _LIVE and second in _LIVE
    first.step = 3           # the older one still publishes when asked (its Accelerator may still be used)
    second.close()
