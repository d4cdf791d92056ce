"""What the torchrun-launched training benchmarks share: one hyperacc step timed on this rank, and the
threads each of 2 processes gets."""
import os
import time


def timed_step(acc, model, optimizer, batch) -> float:
    """Train one step on ``batch`` (its micro-batches); the seconds this rank spent, counted from a
    barrier so that every rank's clock starts together (the caller takes the slowest rank's)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    with acc.accumulate(model, batch) as micro_batches:
        for mb in micro_batches:
            acc.backward(model(**mb).loss)
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def threads() -> int:
    """Threads per process: the cores shared by the 2 processes (1 each on a 2-core machine); more
    threads than cores only contend."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def launch_workers(script: str, out: str, worker_args: list) -> dict:
    """``script --worker out *worker_args`` on 2 torchrun processes (one thread per core, offline, the
    repository importable); returns the JSON rank 0 wrote to ``out`` (`finish_workers`)."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads()), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
           "--worker", out, *worker_args]
    subprocess.run(cmd, check=True, env=env, cwd=repo)
    with open(out) as handle:
        return json.load(handle)


def finish_workers(out: str, results: dict) -> None:
    """Rank 0 writes ``results`` to ``out``; every rank then leaves the process group."""
    import json

    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()
