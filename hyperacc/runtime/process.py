"""The process's place in the job: device type, backend, process group, launcher.

Everything here is decided once, when an `Accelerator` is built. A process group that already
exists is reused (and left alone at the end); one that hyperacc creates is destroyed by
`Accelerator.end_training()`. A plain `python script.py` run gets a one-process gloo group so that
FSDP2, DTensor and DCP follow the same code path as a multi-process job.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import sys
import time
import warnings
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from hyperacc.config.launch_env import launch_env   # the launcher environment is read there (torch-free)
from hyperacc.runtime.watchdog import Heartbeat

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEVICE_ENV = "HYPERACC_DEVICE"


@dataclasses.dataclass(frozen=True)
class Runtime:
    device_type: str           # "npu" | "cuda" | "cpu"
    backend: str               # "hccl" | "nccl" | "gloo"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str              # "accelerate" | "torchrun" | "python"
    owns_process_group: bool
    cpu_group: Optional[object] = None   # gloo group for CPU-side collectives (None: the default group)
    heartbeat: Optional[object] = None   # hyperacc.runtime.watchdog.Heartbeat: who went silent when a collective times out

    @property
    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank % max(1, _device_count(self.device_type)))


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return hasattr(torch, "npu") and torch.npu.is_available() and torch.npu.device_count() > 0


def device_module(device_type: str):
    """``torch.cuda`` / ``torch.npu`` when that accelerator is usable, else None (CPU).

    The one place that maps a device type to its torch module; metrics, RNG capture and device
    setup all go through it.
    """
    if device_type in ("cuda", "npu"):
        module = getattr(torch, device_type, None)
        if module is not None and module.is_available():
            return module
    return None


def collective_float_dtype(backend: str) -> torch.dtype:
    """float64 for small reductions of counts and losses, float32 on HCCL (no float64 there on
    some chips; counts stay exact below 2**24)."""
    return torch.float32 if backend == "hccl" else torch.float64


def _device_count(device_type: str) -> int:
    module = device_module(device_type)
    return module.device_count() if module is not None else 1


def detect_device_type(requested: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> str:
    """NPU when torch_npu imports and a device is present, else CUDA, else CPU.

    ``requested`` (or the HYPERACC_DEVICE variable) forces a type, and fails loudly if the
    machine cannot provide it instead of silently training somewhere else.
    """
    env = launch_env(env)
    requested = requested or env.get(DEVICE_ENV) or None
    if requested is not None:
        requested = requested.lower()
        if requested not in BACKENDS:
            raise ValueError(f"Unknown device type {requested!r}: use one of {sorted(BACKENDS)}.")
        if requested == "npu" and not _npu_available():
            raise RuntimeError("NPU requested but torch_npu is not importable or sees no NPU device. "
                               "Install the Ascend toolkit and `pip install hyperacc[npu]` (torch-npu "
                               "matching your torch), or request device 'cpu'/'cuda'.")
        if requested == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA requested but torch.cuda.is_available() is False. Install a CUDA "
                               "build of torch, or request device 'cpu'.")
        return requested
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def detect_launcher(env: Optional[Mapping[str, str]] = None) -> str:
    env = launch_env(env)
    if any(key.startswith("ACCELERATE_") for key in env) and "RANK" in env:
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in env or "RANK" in env:
        return "torchrun"
    return "python"


def _set_local_device(device_type: str, local_rank: int) -> None:
    module = device_module(device_type)
    if module is not None:
        module.set_device(local_rank % module.device_count())


def die_with_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
    """Ask Linux to SIGKILL this worker when its launcher dies (``prctl(PR_SET_PDEATHSIG)``).

    torchrun (and ``accelerate launch``, which runs it) starts each worker in a session of its own,
    so a SIGKILLed launcher would leave the workers training and saving into ``checkpoint_dir``.
    Only for workers of the torch elastic agent (``TORCHELASTIC_RUN_ID`` set: their parent is the
    launcher's Python process). SIGKILL, not SIGTERM: an orphan must not run a save-on-SIGTERM
    handler. If the launcher died before the call (the worker was already adopted by init or a
    subreaper, which is not a Python process), the worker exits now. Returns True when armed.
    """
    env = launch_env(env)
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in env:
        return False
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>; no public Python API for prctl
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        warnings.warn(f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this worker will not "
                      "stop by itself if its launcher is killed.")
        return False
    # The race: the launcher may have died between fork and prctl; then the parent is no longer it.
    parent = os.getppid()
    try:
        parent_exe = os.path.basename(os.readlink(f"/proc/{parent}/exe"))
    except OSError:
        parent_exe = "python"  # unreadable: assume the launcher
    if parent == 1 or not parent_exe.startswith("python"):
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def init_runtime(device_type: Optional[str] = None, timeout_s: Optional[float] = None) -> Runtime:
    """Detect the device, start (or reuse) the process group (collective timeout ``timeout_s``,
    default 1800 s) and pin the local device; start this rank's heartbeat (`hyperacc.runtime.watchdog`)."""
    timeout_s = 1800.0 if timeout_s is None else float(timeout_s)
    die_with_launcher()
    device_type = detect_device_type(device_type)
    backend = BACKENDS[device_type]
    launcher = detect_launcher()
    env = launch_env()
    local_rank = int(env.get("LOCAL_RANK", 0))
    _set_local_device(device_type, local_rank)

    owns = False
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in env and "WORLD_SIZE" in env:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # One process, no launcher: a private in-memory store, nothing listens on a port.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        owns = True
    elif dist.get_backend() != backend and device_type != "cpu":
        warnings.warn(f"Reusing an existing process group with backend {dist.get_backend()!r} "
                      f"although {backend!r} is the native one for {device_type}.")

    _release_gil_at_exit()        # whoever ends it: a group alive at exit must not abort the process
    cpu_group = None
    if device_type != "cpu" and dist.get_world_size() > 1:
        cpu_group = dist.new_group(backend="gloo")
    return Runtime(
        device_type=device_type, backend=backend, rank=dist.get_rank(),
        world_size=dist.get_world_size(), local_rank=local_rank,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        launcher=launcher, owns_process_group=owns, cpu_group=cpu_group,
        heartbeat=Heartbeat(dist.get_rank(), dist.get_world_size(), timeout_s=timeout_s),
    )


def shutdown(runtime: Runtime) -> None:
    """Destroy the process group if hyperacc created it.

    A gloo worker thread releases a collective's tensors only after the caller saw it complete,
    and needs the GIL to do so. If it is still waiting for the GIL when the interpreter shuts down
    (FSDP keeps its groups alive until then), the process aborts with "terminate called without an
    active exception". The barrier and the short sleep release the GIL so those threads finish now.
    """
    if runtime.heartbeat is not None:
        runtime.heartbeat.close()
    if runtime.owns_process_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.05)
    elif dist.is_initialized():
        # Not ours to destroy (a script's, or an earlier Accelerator's in the same job): its gloo threads may
        # still be releasing the last collective's tensors; give them the GIL now, and again at exit.
        time.sleep(0.05)
        _release_gil_at_exit()


_AT_EXIT = []


def _release_gil_at_exit() -> None:
    """Once per process: at interpreter exit, while a process group still exists, sleep 50 ms so that gloo
    threads waiting for the GIL finish before finalization (else "terminate called without an active
    exception", SIGABRT). The aborts seen in CI came, it turned out, from the heartbeat thread in a store call
    (fixed in runtime.watchdog, reproduced 10 of 10 without it); this sleep stays as the cheap guard for gloo's
    own threads, which the same mechanism would kill the same way."""
    if _AT_EXIT:
        return
    import atexit

    def release():
        if dist.is_available() and dist.is_initialized():
            time.sleep(0.05)

    atexit.register(release)
    _AT_EXIT.append(release)
