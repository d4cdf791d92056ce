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
