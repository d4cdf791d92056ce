"""Training metrics: buffered per optimizer step, reduced across ranks on logging steps only.

``MetricsLogger.log_step`` is called by every rank once per optimizer step. It only buffers the
step: host numbers, device tensors as they are (no read), and the step's end time (a device event
on cuda/npu, ``perf_counter`` on CPU: no synchronisation). Every ``logging_steps`` (at ``max_steps``,
before an evaluation record and on ``close``) the window is flushed: the device values are read in
one go and the per-rank values go through ONE ``all_gather`` over ``group``; every rank then holds
the same records, ONE PER OPTIMIZER STEP of the window. Rank 0 writes them to the sinks: one JSON
object per step appended (and flushed) to ``metrics_file``, TensorBoard scalars when
``tensorboard_dir`` is set; the console line ``step=N loss=... lr=... grad_norm=... tokens/s=...``
and the tqdm bar show the logging step only.

Per step: ``step_time`` = the slowest rank's time from the previous step's end (or the last
evaluation record) to this step's end, ``tokens_per_second`` = ``tokens`` / ``step_time``. ``loss``
(and any ``rank_shares`` entry) = the sum over ranks of each rank's share, e.g. the accumulator's
``loss_sum / global_tokens`` (``GradientAccumulator.step_metrics()``).

Counters, one meaning each: ``tokens`` = the step's valid label tokens over all ranks (what the
loss averages over; the accumulator's ``step_tokens``), ``consumed_tokens`` = their running sum,
``samples``/``consumed_samples`` likewise in sequences.

Memory (on the logging step's record only): on cuda/npu ``memory_allocated_gib``,
``memory_reserved_gib`` and ``max_memory_allocated_gib`` (the maximum over ranks); on CPU
``memory_rss_gib`` (the largest resident set size among the ranks), omitted when unknown.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from hyperacc.housekeeping import PeriodicCleanup, StepTimer, device_memory_gib
from hyperacc.runtime import collective_float_dtype, device_module

__all__ = ["MetricsLogger", "StepTimer", "PeriodicCleanup", "device_memory_gib"]

# Memory values gathered with the window time (max over ranks; -1 = not available here).
_MEMORY = ("memory_allocated_gib", "memory_reserved_gib", "max_memory_allocated_gib", "memory_rss_gib")


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


def _format_number(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class _Clock:
    """Step boundaries without a host sync: device events on cuda/npu (read when the window is
    flushed), ``perf_counter`` on CPU."""

    def __init__(self, device_type: str):
        module = device_module(device_type)
        self._event = getattr(module, "Event", None) if module is not None else None

    def now(self):
        if self._event is None:
            return time.perf_counter()
        event = self._event(enable_timing=True)
        event.record()
        return event

    def seconds(self, spans: list) -> List[float]:
        """Seconds of each ``(start, end)`` span; waits for the last event (a logging step)."""
        if self._event is None:
            return [end - start for start, end in spans]
        if spans:
            spans[-1][1].synchronize()
        return [start.elapsed_time(end) / 1000.0 for start, end in spans]


def _read_tensors(values: list) -> list:
    """Host floats of ``values``; device tensors are read with one copy per device."""
    out, by_device = list(values), {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            if hasattr(value, "full_tensor"):   # DTensor: its value (hyperacc's own norms are plain tensors)
                value = value.full_tensor()
            by_device.setdefault(value.device, []).append((index, value.detach().reshape(-1)[0].to(torch.float64)))
    for items in by_device.values():
        for (index, _), number in zip(items, torch.stack([v for _, v in items]).cpu().tolist()):
            out[index] = number
    return out


class MetricsLogger:
    """Buffers step metrics on every rank, reduces them (one collective) on logging steps and
    writes one record per optimizer step on the main process.

    ``group``: the process group of the ranks whose tokens/samples add up to the global batch
    (e.g. a gloo group, or the data-parallel group); None = the default group. Without an
    initialized process group it works as a single process.
    ``is_main_process``: None = global rank 0 (or no process group).
    ``initial_step``: the step training resumes from (the progress bar starts there).
    ``consumed_tokens``/``consumed_samples``: the cumulative counts at ``initial_step`` (e.g. from
    the restored progress bucket); ``log_step`` adds each step's global counts to them unless the
    caller passes the cumulative values itself.
    ``flush_on``: exception types raised on every rank at the same point (e.g. a non-finite step):
    leaving a ``with MetricsLogger(...)`` block with one of them still flushes the buffered steps
    (a collective); other exceptions drop them (a lone failing rank must not hang the others).
    ``metrics_file`` is opened in append mode: on resume new records follow the old ones (after a
    crash a step may therefore appear twice; the last record of a step is the valid one).
    """

    def __init__(self, *, metrics_file: Optional[str] = None, logging_steps: int = 1,
                 tensorboard_dir: Optional[str] = None, progress_bar: bool = True,
                 max_steps: Optional[int] = None, initial_step: int = 0,
                 is_main_process: Optional[bool] = None, group=None, device_type: str = "cpu",
                 consumed_tokens: int = 0, consumed_samples: int = 0,
                 progress_file=None, log_fn=None, flush_on: tuple = ()):
        if logging_steps < 1:
            raise ValueError(f"logging_steps={logging_steps} must be >= 1")
        self.logging_steps = logging_steps
        self.max_steps = max_steps
        self.group = group
        self.device_type = device_type
        self.flush_on = tuple(flush_on)
        self.consumed_tokens = int(consumed_tokens)
        self.consumed_samples = int(consumed_samples)
        self._rows: List[dict] = []     # the buffered steps since the last flush
        self._clock = _Clock(device_type)
        self._mark = self._clock.now()  # the current step's start
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

    def start(self) -> None:
        """The next step's time starts now (e.g. after start-up or an evaluation)."""
        self._mark = self._clock.now()

    def log_step(self, *, step: int, loss=None, step_time: Optional[float] = None, tokens: int = 0,
                 samples: int = 0, epoch: int = 0, grad_norm=None, lr=None, consumed_tokens: Optional[int] = None,
                 consumed_samples: Optional[int] = None, rank_shares: Optional[Dict[str, Any]] = None,
                 extra: Optional[Dict[str, Any]] = None) -> Optional[List[dict]]:
        """Buffer one optimizer step; call on EVERY rank of ``group`` (logging steps hold a collective).

        ``loss``/``grad_norm``/``lr``/``extra`` values: numbers or tensors (device tensors are read
        on the logging step), the same on every rank (``loss`` is the global mean already).
        ``rank_shares``: name -> this rank's share (a number or tensor); the record holds their sum
        over the ranks (``loss`` from a share replaces the ``loss`` argument).
        ``step_time``: this rank's seconds; None = measured (see the module doc).
        ``tokens``/``samples``: the step's global counts.
        Returns the window's records (identical on every rank) on a logging step, else None.
        """
        end = self._clock.now()
        span, self._mark = (self._mark, end), end
        self.consumed_tokens = self.consumed_tokens + int(tokens) if consumed_tokens is None else int(consumed_tokens)
        self.consumed_samples = self.consumed_samples + int(samples) if consumed_samples is None \
            else int(consumed_samples)
        values = {"loss": loss, "grad_norm": grad_norm, "lr": lr[0] if isinstance(lr, (list, tuple)) else lr}
        values.update({k: v() if callable(v) else v for k, v in (extra or {}).items()})
        self._rows.append({"step": int(step), "epoch": int(epoch), "values": values, "span": span,
                           "step_time": step_time, "shares": dict(rank_shares or {}), "tokens": int(tokens),
                           "samples": int(samples), "consumed_tokens": self.consumed_tokens,
                           "consumed_samples": self.consumed_samples})
        if step % self.logging_steps and step != self.max_steps:
            if self._bar is not None and step > self._bar.n:
                self._bar.update(step - self._bar.n)
            return None
        return self.flush()

    def flush(self) -> Optional[List[dict]]:
        """Reduce and write the buffered steps (collective: every rank calls it at the same point)."""
        rows, self._rows = self._rows, []
        if not rows:
            return None
        measured = self._clock.seconds([row["span"] for row in rows])
        times = [m if row["step_time"] is None else float(row["step_time"]) for row, m in zip(rows, measured)]
        names = sorted({name for row in rows for name in row["shares"]})
        shares = _read_tensors([row["shares"].get(name, math.nan) for row in rows for name in names])
        memory = device_memory_gib(self.device_type)
        table = self._gather(times + shares + [memory.get(k, -1.0) for k in _MEMORY])
        k, n = len(rows), len(shares)
        maxima, sums = table[:, :k].max(dim=0).values.tolist(), table[:, k:k + n].sum(dim=0).tolist()
        memory = table[:, k + n:].max(dim=0).values.tolist()
        keys = list(rows[0]["values"])
        read = _read_tensors([row["values"].get(key) for row in rows for key in keys])
        records = []
        for i, row in enumerate(rows):
            record = {"step": row["step"], "epoch": row["epoch"]}
            record.update({key: _to_float(value) if key in ("loss", "grad_norm", "lr") else value
                           for key, value in zip(keys, read[i * len(keys):(i + 1) * len(keys)])})
            record.update(zip(names, sums[i * len(names):(i + 1) * len(names)]))
            record.update({"step_time": maxima[i], "tokens_per_second": row["tokens"] / maxima[i] if maxima[i] > 0
                           else 0.0, "tokens": row["tokens"], "samples": row["samples"],
                           "consumed_tokens": row["consumed_tokens"], "consumed_samples": row["consumed_samples"]})
            records.append({key: value for key, value in record.items()
                            if value is not None or key in ("loss", "grad_norm", "lr")})
        records[-1].update({key: value for key, value in zip(_MEMORY, memory) if value >= 0})
        for record in records:
            record["time"] = time.time()
            if self.is_main_process:
                self._write(record, console=record is records[-1])
        return records

    def log_eval(self, *, step: int, loss, extra: Optional[Dict[str, Any]] = None) -> dict:
        """Record an evaluation result (``loss`` already reduced over ranks). Call on every rank:
        the buffered steps are flushed first (a collective), and the next step's time starts after it."""
        self.flush()
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
        self.start()
        return record

    def close(self, flush: bool = True) -> None:
        """Flush the buffered steps (collective, unless ``flush=False``) and close the sinks."""
        if flush:
            self.flush()
        self._rows = []
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

    def __exit__(self, exc_type, *exc):
        self.close(flush=exc_type is None or (bool(self.flush_on) and issubclass(exc_type, self.flush_on)))
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

    def _write(self, record: dict, console: bool = True) -> None:
        step = record["step"]
        self._write_line(record)
        if self._writer is not None:
            for key in ("loss", "grad_norm", "lr", "step_time", "tokens_per_second",
                        "memory_allocated_gib", "memory_reserved_gib", "memory_rss_gib"):
                if record.get(key) is not None:
                    self._writer.add_scalar(f"train/{key}", record[key], step)
        if not console:
            return
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
