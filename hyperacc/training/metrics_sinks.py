"""Where finished metric records go: one small interface, three built-in sinks.

A sink receives the records ``MetricsLogger`` has already reduced over the ranks (plain host
numbers, identical on every rank), on the main process only:

- ``write(records, kind)``: ``kind="step"``: one record per optimizer step of a flushed window
  (the last one is the logging step, it alone carries the memory fields); ``kind="eval"``: a
  one-record list from ``log_eval``. The records are shared with the caller and the other sinks:
  read them, do not modify them.
- ``progress(step)``: called on every optimizer step that does not flush (no values: nothing has
  been read yet). Optional.
- ``close()``: called once, by ``MetricsLogger.close``. Optional.

Any object with a ``write`` method is a sink; ``MetricsSink`` gives the no-op defaults.
Built in: ``JsonlSink`` (one JSON object per record appended to a file, flushed per line),
``TensorBoardSink`` (scalars under ``train/`` and ``eval/``), ``ConsoleSink`` (a line per logging
step and per evaluation, and an optional tqdm bar).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Callable, List, Literal, Optional

__all__ = ["MetricsSink", "JsonlSink", "TensorBoardSink", "ConsoleSink"]

Kind = Literal["step", "eval"]

# The step-record keys TensorBoardSink plots (when present).
_TB_STEP_KEYS = ("loss", "grad_norm", "lr", "step_time", "tokens_per_second",
                 "memory_allocated_gib", "memory_reserved_gib", "memory_rss_gib")


def _format_number(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsSink:
    """The sink interface, with no-op defaults for the optional methods."""

    def write(self, records: List[dict], kind: Kind) -> None:
        raise NotImplementedError

    def progress(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(MetricsSink):
    """Appends ``json.dumps(record)`` lines to ``path`` (flushed per line).

    The file describes one history: records of steps after ``start_step`` (the step training
    resumes from, 0 for a fresh start) belong to a branch this run replays or abandons, so they are
    moved, with any partial last line a killed process left, to ``<path>.superseded-<time>`` (kept,
    never deleted) before new records are appended. Each step then appears once, in order."""

    def __init__(self, path: str, start_step: Optional[int] = None):
        self.path = path
        self.superseded: Optional[str] = None
        if start_step is not None:
            self.superseded = _set_aside_after(path, int(start_step))
        self._file = _open_append(path)

    def write(self, records: List[dict], kind: Kind) -> None:
        if self._file is None:
            return
        for record in records:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_TB_WARNED = False


class TensorBoardSink(MetricsSink):
    """Scalars ``train/<key>`` per step record and ``eval/loss``, ``eval/ppl`` per evaluation.
    Without the ``tensorboard`` package it warns once and writes nothing."""

    def __init__(self, log_dir: str):
        global _TB_WARNED
        self.log_dir = log_dir
        self._writer = None
        try:
            import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if not _TB_WARNED:
                warnings.warn(f"tensorboard_dir={log_dir!r} is set but tensorboard is not installed; "
                              "TensorBoard logging is off (pip install tensorboard).", stacklevel=3)
                _TB_WARNED = True
            return
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, records: List[dict], kind: Kind) -> None:
        if self._writer is None:
            return
        for record in records:
            step = record["step"]
            if kind == "eval":
                self._writer.add_scalar("eval/loss", record["eval_loss"], step)
                self._writer.add_scalar("eval/ppl", record["eval_ppl"], step)
                continue
            for key in _TB_STEP_KEYS:
                if record.get(key) is not None:
                    self._writer.add_scalar(f"train/{key}", record[key], step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class ConsoleSink(MetricsSink):
    """The logging step's line ``step=N loss=... lr=... grad_norm=... tokens/s=... step_time=...s``
    and ``eval step=N eval_loss=... eval_ppl=...``, through ``log_fn`` if given, else printed
    (above the bar when there is one). ``progress_bar``: a tqdm bar on ``file`` (default stderr),
    ``initial=initial_step``, ``total=max_steps``, postfix loss / lr / tokens per second."""

    def __init__(self, *, progress_bar: bool = True, max_steps: Optional[int] = None, initial_step: int = 0,
                 file=None, log_fn: Optional[Callable[[str], None]] = None):
        self._log_fn = log_fn
        self._bar = None
        if progress_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=max_steps, initial=initial_step, desc="train", unit="step",
                             dynamic_ncols=True, file=file if file is not None else sys.stderr)

    def progress(self, step: int) -> None:
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def write(self, records: List[dict], kind: Kind) -> None:
        if not records:
            return
        record = records[-1]
        step = record["step"]
        if kind == "eval":
            self._print(f"eval step={step} eval_loss={_format_number(record['eval_loss'])} "
                        f"eval_ppl={_format_number(record['eval_ppl'])}")
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

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _print(self, line: str) -> None:
        if self._log_fn is not None:
            self._log_fn(line)
        elif self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)


def _set_aside_after(path: str, step: int) -> Optional[str]:
    """Move the lines of ``path`` whose record's step is after ``step`` (or that do not parse) to a
    sibling file; rewrite ``path`` atomically with the rest. Returns the sibling's path, or None."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line for line in handle.read().splitlines() if line.strip()]
    kept, moved = [], []
    for line in lines:
        try:
            record_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            moved.append(line)
            continue
        (kept if record_step <= step else moved).append(line)
    if not moved:
        return None
    aside = f"{path}.superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    with open(aside, "a", encoding="utf-8") as handle:
        handle.write("\n".join(moved) + "\n")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    warnings.warn(f"{path}: {len(moved)} record(s) after step {step} (the step this run starts from) moved to "
                  f"{aside}; the file now holds each step once, in order.", stacklevel=4)
    return aside


def _open_append(path: str):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
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
