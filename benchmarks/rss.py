"""Memory probes the benchmarks share: a process's RSS figures from /proc and the bytes of tensors a
rank holds (local shards of DTensors)."""
import resource


def status(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs "5"); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak() -> int:
    """VmHWM, or ru_maxrss (since the process started) where /proc has none."""
    try:
        return status("VmHWM")
    except RuntimeError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def local_bytes(tensors) -> int:
    """Bytes of ``tensors`` held by this rank (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total
