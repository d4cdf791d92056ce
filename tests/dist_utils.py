"""Run real multi-process jobs (torchrun or accelerate launch, gloo) from tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_torchrun(script, nproc: int, args=(), env=None, timeout: int = 600, check: bool = True):
    """Launch ``script`` on ``nproc`` local processes with torchrun; returns CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "--master_addr=127.0.0.1", str(script), *map(str, args)]
    return _run(cmd, _env(env), timeout, check)


def run_accelerate(script, config_file, args=(), env=None, timeout: int = 600, check: bool = True,
                   num_processes=None):
    """Launch ``script`` with ``accelerate launch --config_file``; returns CompletedProcess."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           "--main_process_port", str(free_port())]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    cmd += [str(script), *map(str, args)]
    return _run(cmd, _env(env), timeout, check)


def run_python(script, args=(), env=None, timeout: int = 600, check: bool = True):
    """Run ``script`` in one plain python process (no launcher)."""
    return _run([sys.executable, str(script), *map(str, args)], _env(env), timeout, check)


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
