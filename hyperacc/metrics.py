"""Training metrics: reduced across ranks on logging steps only, then written by rank 0 to its sinks.

``MetricsLogger.log_step`` is called by every rank once per optimizer step. On a step that does not
log it only adds host numbers to the current window (step time, the step's global token and sample
counts) and moves the progress bar: no collective, no tensor read. Values passed as zero-argument
callables (``loss=lambda: acc.step_loss``) are evaluated on logging steps only, so a device loss is
never synchronised on the others. Every ``logging_steps`` (and at ``max_steps``) the window's time and
the memory are exchanged with ONE ``all_gather`` over ``group``; every rank then holds the same record:
``step_time`` = the slowest rank's mean step time over the window, ``tokens_per_second`` = the
window's tokens over the slowest rank's window time. Rank 0 alone writes the sinks: a tqdm progress
bar, a ``step=N loss=... lr=... grad_norm=... tokens/s=...`` line, one JSON object per logged step
appended (and flushed) to ``metrics_file``, and TensorBoard scalars when ``tensorboard_dir`` is set.

Counters, one meaning each: ``tokens`` = the logged step's valid label tokens over all ranks (what the
loss averages over; the accumulator's ``step_tokens``), ``consumed_tokens`` = their running sum,
``samples``/``consumed_samples`` likewise in sequences.

Memory: on cuda/npu the record holds ``memory_allocated_gib``, ``memory_reserved_gib`` and
``max_memory_allocated_gib`` (the maximum over ranks); on CPU it holds ``memory_rss_gib`` (the
largest resident set size among the ranks, from psutil or /proc/self/statm), omitted when
neither is available.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from hyperacc.runtime import collective_float_dtype, device_module

__all__ = ["MetricsLogger", "StepTimer", "PeriodicCleanup", "device_memory_gib"]

_GIB = float(1 << 30)
# Memory values gathered with the window time (max over ranks; -1 = not available here).
_MEMORY = ("memory_allocated_gib", "memory_reserved_gib", "max_memory_allocated_gib", "memory_rss_gib")


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


def _to_float(value) -> Optional[float]:
    if callable(value) and not isinstance(value, torch.Tensor):
        value = value()
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):  # DTensor
            value = value.full_tensor()
        return float(value.detach().float().item())
    if isinstance(value, (list, tuple)):  # e.g. scheduler.get_last_lr()
        return _to_float(value[0]) if value else None
    return float(value)


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


def _format_number(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsLogger:
    """Collects step metrics on every rank (one collective) and writes them on the main process.

    ``group``: the process group of the ranks whose tokens/samples add up to the global batch
    (e.g. a gloo group, or the data-parallel group); None = the default group. Without an
    initialized process group it works as a single process.
    ``is_main_process``: None = global rank 0 (or no process group).
    ``initial_step``: the step training resumes from (the progress bar starts there).
    ``consumed_tokens``/``consumed_samples``: the cumulative counts at ``initial_step`` (e.g. from
    the restored progress bucket); ``log_step`` adds each step's global counts to them unless the
    caller passes the cumulative values itself.
    ``metrics_file`` is opened in append mode: on resume new records follow the old ones (after a
    crash a step may therefore appear twice; the last record of a step is the valid one).
    """

    def __init__(self, *, metrics_file: Optional[str] = None, logging_steps: int = 1,
                 tensorboard_dir: Optional[str] = None, progress_bar: bool = True,
                 max_steps: Optional[int] = None, initial_step: int = 0,
                 is_main_process: Optional[bool] = None, group=None, device_type: str = "cpu",
                 consumed_tokens: int = 0, consumed_samples: int = 0,
                 progress_file=None, log_fn=None):
        if logging_steps < 1:
            raise ValueError(f"logging_steps={logging_steps} must be >= 1")
        self.logging_steps = logging_steps
        self.max_steps = max_steps
        self.group = group
        self.device_type = device_type
        self.consumed_tokens = int(consumed_tokens)
        self.consumed_samples = int(consumed_samples)
        self._window = [0.0, 0, 0]      # seconds, tokens, steps since the last record
        if is_main_process is None:
            is_main_process = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.is_main_process = bool(is_main_process)
        self._log_fn = log_fn
        self._file = None
        self._bar = None
        self._writer = None
        if not self.is_main_process:
            return
        if metrics_file:
            self._file = _open_append(metrics_file)
        if tensorboard_dir:
            self._writer = _summary_writer(tensorboard_dir)
        if progress_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=max_steps, initial=initial_step, desc="train", unit="step",
                             dynamic_ncols=True, file=progress_file if progress_file is not None
                             else sys.stderr)

    # -- collective --------------------------------------------------------------------------

    def _world(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def _collective_device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        if backend == "gloo":
            return torch.device("cpu")
        module = device_module(self.device_type)
        if module is not None:
            return torch.device(self.device_type, module.current_device())
        return torch.device("cpu")

    def _gather(self, values: list) -> torch.Tensor:
        """All ranks' packed values, shape (world, len(values)); one all_gather."""
        world = self._world()
        local = torch.tensor(values, dtype=torch.float64)
        if world == 1:
            return local.unsqueeze(0)
        device = self._collective_device()
        dtype = collective_float_dtype(dist.get_backend(self.group))
        local = local.to(device=device, dtype=dtype)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).to("cpu", torch.float64)

    # -- public API --------------------------------------------------------------------------

    def log_step(self, *, step: int, loss, step_time: float, tokens: int = 0, samples: int = 0,
                 epoch: int = 0, grad_norm=None, lr=None, consumed_tokens: Optional[int] = None,
                 consumed_samples: Optional[int] = None, extra: Optional[Dict[str, Any]] = None) -> Optional[dict]:
        """Record one optimizer step; call on EVERY rank of ``group`` (logging steps hold a collective).

        ``loss``/``grad_norm``/``lr``/``extra`` values: floats, tensors or zero-argument callables
        (evaluated on logging steps only). ``loss`` is the global mean already (not reduced here).
        ``step_time``: this rank's seconds. ``tokens``/``samples``: the step's global counts.
        Returns the record (identical on every rank) on a logging step, else None.
        """
        self._window[0] += float(step_time)
        self._window[1] += int(tokens)
        self._window[2] += 1
        self.consumed_tokens = self.consumed_tokens + int(tokens) if consumed_tokens is None else int(consumed_tokens)
        self.consumed_samples = self.consumed_samples + int(samples) if consumed_samples is None \
            else int(consumed_samples)
        if step % self.logging_steps and step != self.max_steps:
            if self._bar is not None and step > self._bar.n:
                self._bar.update(step - self._bar.n)
            return None
        memory = device_memory_gib(self.device_type)
        maxima = self._gather([self._window[0]] + [memory.get(k, -1.0) for k in _MEMORY]).max(dim=0).values.tolist()
        window_time, window_tokens, window_steps = maxima[0], self._window[1], self._window[2]
        self._window = [0.0, 0, 0]
        record = {"step": int(step), "epoch": int(epoch), "loss": _to_float(loss), "grad_norm": _to_float(grad_norm),
                  "lr": _to_float(lr), "step_time": window_time / window_steps,
                  "tokens_per_second": window_tokens / window_time if window_time > 0 else 0.0,
                  "tokens": int(tokens), "samples": int(samples), "consumed_tokens": self.consumed_tokens,
                  "consumed_samples": self.consumed_samples}
        record.update({key: value for key, value in zip(_MEMORY, maxima[1:]) if value >= 0})
        for key, value in (extra or {}).items():
            value = value() if callable(value) else value
            if value is not None:
                record[key] = _to_float(value) if isinstance(value, torch.Tensor) else value
        record["time"] = time.time()
        if self.is_main_process:
            self._write(record)
        return record

    def log_eval(self, *, step: int, loss, extra: Optional[Dict[str, Any]] = None) -> dict:
        """Record an evaluation result (``loss`` already reduced over ranks); no collective."""
        eval_loss = _to_float(loss)
        try:
            ppl = math.exp(eval_loss)
        except OverflowError:
            ppl = float("inf")
        record = {"step": int(step), "eval_loss": eval_loss, "eval_ppl": ppl}
        if extra:
            record.update(extra)
        record["time"] = time.time()
        if self.is_main_process:
            self._write_line(record)
            if self._writer is not None:
                self._writer.add_scalar("eval/loss", eval_loss, step)
                self._writer.add_scalar("eval/ppl", ppl, step)
            self._print(f"eval step={step} eval_loss={_format_number(eval_loss)} "
                        f"eval_ppl={_format_number(ppl)}")
        return record

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- sinks (main process) ----------------------------------------------------------------

    def _print(self, line: str) -> None:
        if self._log_fn is not None:
            self._log_fn(line)
        elif self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def _write_line(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def _write(self, record: dict) -> None:
        step = record["step"]
        self._write_line(record)
        if self._writer is not None:
            for key in ("loss", "grad_norm", "lr", "step_time", "tokens_per_second",
                        "memory_allocated_gib", "memory_reserved_gib", "memory_rss_gib"):
                if record.get(key) is not None:
                    self._writer.add_scalar(f"train/{key}", record[key], step)
        if self._bar is not None:
            self._bar.set_postfix(loss=_format_number(record["loss"]), lr=_format_number(record["lr"]),
                                  tok_s=f"{record['tokens_per_second']:.0f}", refresh=False)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            else:
                self._bar.refresh()
        self._print(f"step={step} loss={_format_number(record['loss'])} lr={_format_number(record['lr'])} "
                    f"grad_norm={_format_number(record['grad_norm'])} tokens/s={record['tokens_per_second']:.1f} "
                    f"step_time={record['step_time']:.3f}s")


def _open_append(path: str):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # A process killed in the middle of a write may have left a partial last line: end it so the
    # next record starts on its own line.
    needs_newline = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as existing:
            existing.seek(-1, os.SEEK_END)
            needs_newline = existing.read(1) != b"\n"
    handle = open(path, "a", encoding="utf-8")
    if needs_newline:
        handle.write("\n")
        handle.flush()
    return handle


_TB_WARNED = False


def _summary_writer(log_dir: str):
    global _TB_WARNED
    try:
        import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _TB_WARNED:
            warnings.warn(f"tensorboard_dir={log_dir!r} is set but tensorboard is not installed; "
                          "TensorBoard logging is off (pip install tensorboard).", stacklevel=3)
            _TB_WARNED = True
        return None
    return SummaryWriter(log_dir=log_dir)
