"""Training metrics: buffered per optimizer step, reduced across ranks on logging steps only.

``MetricsLogger.log_step`` is called by every rank once per optimizer step. It only buffers the
step: host numbers, device tensors as they are (no read), and the step's end time (a device event
on cuda/npu, ``perf_counter`` on CPU: no synchronisation). Every ``logging_steps`` (at ``max_steps``,
before an evaluation record and on ``close``) the window is flushed: the device values are read in
one go and the per-rank values go through ONE ``all_gather`` over ``group``; every rank then holds
the same records, ONE PER OPTIMIZER STEP of the window. Rank 0 hands them to the sinks
(``hyperacc.training.metrics_sinks``): one JSON object per step appended (and flushed) to ``metrics_file``,
TensorBoard scalars when ``tensorboard_dir`` is set (accelerate's ``TensorBoardTracker``), the records
of every tracker of ``accelerator=`` (accelerate's ``log_with``), the console line
``step=N loss=... lr=... grad_norm=... tokens/s=...`` and the tqdm bar (logging step only), and
any sink passed as ``sinks=``.

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

import math
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from hyperacc.runtime.housekeeping import PeriodicCleanup, StepTimer, device_memory_gib
from hyperacc.training.metrics_sinks import (ConsoleSink, JsonlSink, MetricsSink, TensorBoardSink,
                                             require_accelerate_state, write_to_tracker)
from hyperacc.runtime import collective_float_dtype, device_module

__all__ = ["MetricsLogger", "MetricsSink", "JsonlSink", "TensorBoardSink", "ConsoleSink", "StepTimer",
           "PeriodicCleanup", "device_memory_gib"]

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
    ``metrics_file`` is appended to; records of steps after ``initial_step`` (a branch this run
    replays, e.g. after a crash past the last checkpoint) are first moved to a sibling
    ``.superseded-<time>`` file, so each step appears once, in order (``JsonlSink``).
    Sinks (main process only): ``metrics_file`` -> ``JsonlSink``, ``tensorboard_dir`` ->
    ``TensorBoardSink``, then ``ConsoleSink`` (``progress_bar``, ``progress_file``, ``log_fn``), then
    ``sinks`` (objects with ``write(records, kind)``, optionally ``progress(step)`` and ``close()``,
    see ``MetricsSink``). The logger owns them: ``close`` closes each once (``sinks`` on every rank,
    as each rank was handed its own; they are written on the main process only).
    ``accelerator``: an Accelerator (anything with a ``trackers`` list, e.g. after
    ``init_trackers`` with ``log_with=...``): the records also go to each of its trackers (read when
    written, so trackers added later count too; ``metrics_sinks.write_to_tracker``), and the
    logger's own ``JsonlSink`` / ``TensorBoardSink`` join ``accelerator.trackers`` until ``close``,
    so ``accelerator.log(values, step=...)`` reaches the same file and TensorBoard run: one logging
    system. The accelerator's trackers are not closed here (``end_training`` finishes them).
    """

    def __init__(self, *, metrics_file: Optional[str] = None, logging_steps: int = 1,
                 tensorboard_dir: Optional[str] = None, progress_bar: bool = True,
                 max_steps: Optional[int] = None, initial_step: int = 0,
                 is_main_process: Optional[bool] = None, group=None, device_type: str = "cpu",
                 consumed_tokens: int = 0, consumed_samples: int = 0,
                 progress_file=None, log_fn=None, flush_on: tuple = (), sinks: Sequence[Any] = (),
                 accelerator=None):
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
        self._given = list(sinks)       # closed on every rank, written on the main process only
        self.sinks: List[Any] = []      # what the main process writes to, in order
        self._accelerator = accelerator
        self._registered: List[Any] = []   # our sinks in accelerator.trackers, taken out again by close
        if tensorboard_dir:
            require_accelerate_state("MetricsLogger(tensorboard_dir=...)")   # every rank: raised alike
        if self.is_main_process:
            if metrics_file:
                self.sinks.append(JsonlSink(metrics_file, start_step=initial_step, main_process_only=False))
            if tensorboard_dir:
                self.sinks.append(TensorBoardSink(tensorboard_dir, main_process_only=False))
            for sink in self.sinks:
                sink.start()            # the JSONL set-aside happens now, not at the first write
            if accelerator is not None:
                self._registered = list(self.sinks)
                accelerator.trackers.extend(self._registered)
            self.sinks.append(ConsoleSink(progress_bar=progress_bar, max_steps=max_steps, initial_step=initial_step,
                                          file=progress_file, log_fn=log_fn))
            self.sinks.extend(self._given)

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
            for sink in self.sinks:
                progress = getattr(sink, "progress", None)
                if progress is not None:
                    progress(step)
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
        self._emit(records, "step")
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
        self._emit([record], "eval")
        self.start()
        return record

    def close(self, flush: bool = True) -> None:
        """Flush the buffered steps (collective, unless ``flush=False``) and close the sinks."""
        if flush:
            self.flush()
        self._rows = []
        sinks = self.sinks if self.is_main_process else self._given   # the main process's include sinks=
        self.sinks, self._given = [], []
        if self._registered:
            self._accelerator.trackers[:] = [t for t in self._accelerator.trackers
                                             if not any(t is ours for ours in self._registered)]
            self._registered = []
        error = None
        for sink in sinks:              # each is closed once, even if another one fails
            try:
                close = getattr(sink, "close", None)
                if close is not None:
                    close()
            except Exception as exc:    # noqa: BLE001  (re-raised below)
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(flush=exc_type is None or (bool(self.flush_on) and issubclass(exc_type, self.flush_on)))
        return False

    def _emit(self, records: List[dict], kind: str) -> None:
        for sink in self.sinks:         # empty on the other ranks
            sink.write(records, kind)
        if self._accelerator is not None and self.is_main_process:
            for tracker in self._accelerator.trackers:
                if not any(tracker is ours for ours in self.sinks):
                    write_to_tracker(tracker, records, kind)
