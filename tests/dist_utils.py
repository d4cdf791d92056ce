"""Run real multi-process jobs (torchrun or accelerate launch, gloo) from tests."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Rendezvous ports. A port the OS hands out for bind(0) lies in the ephemeral range, which every
# outgoing connection on the machine also draws from (gloo's own pairs among them): between the
# moment a test picks it and the moment torchrun binds it, another job's socket may take it. Ports
# are therefore drawn below that range (Linux: 32768-60999), and claimed by an exclusive file in
# one folder that every pytest session on the machine shares, so two sessions never pick the same
# one. A launch that still loses its port (torchrun: EADDRINUSE) is retried on another (`_run_launch`).
PORT_RANGE = (20000, 32000)
PORT_CLAIMS = Path(tempfile.gettempdir()) / "hyperacc-test-ports"
CLAIM_TTL_S = 1800       # a claim older than any launch of the suite is stale


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now and claimed for this session (see PORT_RANGE)."""
    PORT_CLAIMS.mkdir(exist_ok=True)
    draw = random.SystemRandom()
    for _ in range(500):
        port = draw.randrange(*PORT_RANGE)
        claim = PORT_CLAIMS / str(port)
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            try:
                if time.time() - claim.stat().st_mtime > CLAIM_TTL_S:
                    claim.unlink()
            except FileNotFoundError:
                pass
            continue
        if _bindable(port):
            return port
    with socket.socket() as sock:        # the range is exhausted: the OS's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lost_its_port(proc) -> bool:
    """Whether a launcher failed because its rendezvous port was taken (nothing ran: safe to retry)."""
    text = f"{proc.stdout or ''}{proc.stderr or ''}"
    return proc.returncode != 0 and ("EADDRINUSE" in text or "address already in use" in text.lower())


def _env(extra=None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra or {})
    return env


def _run(cmd, env, timeout, check):
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(_failure(proc))
    return proc


def _failure(proc) -> str:
    return (f"command failed ({proc.returncode}): {' '.join(map(str, proc.args))}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")


def _run_launch(make_cmd, env, timeout, check, tries: int = 3):
    """``make_cmd(port)`` run with a fresh port, again on another one when the port was lost."""
    for attempt in range(tries):
        proc = _run(make_cmd(free_port()), env, timeout, check=False)
        if not lost_its_port(proc) or attempt == tries - 1:
            break
    if check and proc.returncode != 0:
        raise AssertionError(_failure(proc))
    return proc


def torchrun_cmd(script, nproc: int, args=(), port=None, extra=()):
    """The torchrun command line for ``script`` on ``nproc`` local processes (``extra``: launcher options)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={port or free_port()}", "--master_addr=127.0.0.1", *map(str, extra), str(script),
            *map(str, args)]


def run_torchrun(script, nproc: int, args=(), env=None, timeout: int = 600, check: bool = True):
    """Launch ``script`` on ``nproc`` local processes with torchrun; returns CompletedProcess."""
    return _run_launch(lambda port: torchrun_cmd(script, nproc, args, port), _env(env), timeout, check)


def accelerate_cmd(script, config_file, args=(), port=None, num_processes=None):
    """The ``accelerate launch --config_file`` command line for ``script``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           "--main_process_port", str(port or free_port())]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    return cmd + [str(script), *map(str, args)]


def run_accelerate(script, config_file, args=(), env=None, timeout: int = 600, check: bool = True,
                   num_processes=None):
    """Launch ``script`` with ``accelerate launch --config_file``; returns CompletedProcess."""
    return _run_launch(lambda port: accelerate_cmd(script, config_file, args, port, num_processes),
                       _env(env), timeout, check)


def run_python(script, args=(), env=None, timeout: int = 600, check: bool = True):
    """Run ``script`` in one plain python process (no launcher)."""
    return _run([sys.executable, str(script), *map(str, args)], _env(env), timeout, check)


def run_together(*calls):
    """Independent jobs side by side (zero-argument callables, e.g. lambdas around run_python or
    run_torchrun), their results in order; the first failure is raised once all have ended. A
    1-process job leaves one of this machine's 2 cores idle, and a multi-process launch has phases
    that do (the launcher's imports, rank 0 building the data first): a reference run beside the
    launch it is compared with costs little wall time. Only for jobs whose assertions do not depend
    on timing (exactness comparisons of deterministic runs), never for timeouts or kills."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]


def max_rel(a, b) -> float:
    """The largest relative difference between two equally long, non-empty series."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def run_layouts(folder, layouts, args=(), nproc: int = 1) -> dict:
    """tests/scripts/train_parallel.py on ``layouts`` (one job: plain python for one process,
    torchrun otherwise); returns {layout: its record}."""
    import json

    out = Path(folder) / "out.json"
    script, argv = REPO / "tests" / "scripts" / "train_parallel.py", [out, *layouts, *map(str, args)]
    if nproc == 1:
        run_python(script, argv)
    else:
        run_torchrun(script, nproc, argv)
    return {r["layout"]: r for r in json.loads(out.read_text())}
